"""A Session in a supervised child process: the one worker protocol (sweep, matrix, and any
caller that needs another llama.cpp library or flag set than its own process has loaded).

    with Worker(lib="stock", threads=2) as w:      # Session arguments
        r = w.prefill("some text", n_predict=4)    # a PrefillResult, as Session.prefill returns

The child is `python -m dflash.worker`, started and watched like every dflash worker
(dflash/run/supervisor.py: its stage in a state file, llama.cpp's own output captured). Requests and
answers are JSON lines: the parent writes {"op", "args"} to the child's stdin, the child answers
{"ok": value} or {"error": {"type", "message", "exit_code"}} on a pipe of its own, one at a time
(so at most one llama.cpp process computes at any moment; an idle child blocks on its stdin).
Ops: open (Session arguments; answers Session.info()), tokenize, prefill (answers
PrefillResult.to_json()), provenance, close. A typed error in the child is raised in the parent
as the same type with the same text; a child that dies (a crash inside llama.cpp) is a LlamaError
naming the signal and the stage.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from dflash.core import errors, stage
from dflash.core.errors import DflashError, LlamaError
from dflash.core.results import Json, PrefillResult
from dflash.core.settings import ENV_FLAGS, ENV_LIB_DIR, Settings
from dflash.run.supervisor import Child

_ERRORS: dict[str, type[DflashError]] = {c.__name__: c for c in (
    errors.DflashError, errors.UsageError, errors.ModelError, errors.LlamaError, errors.LibraryNotBuilt,
    errors.NotExactError, errors.NoDeviceError)}


class Worker:
    """A child process holding one Session (keyword arguments as Session takes them, JSON-able;
    `settings`: the environment flags, as Session takes them (Settings.from_env()); default: none
    set. DFLASH_LLAMA_LIB_DIR stands for the exact library only and is dropped for another one)."""

    def __init__(self, *, settings: Settings | None = None, **session: Any):
        flags = {k: v for k, v in (settings.env if settings is not None else {}).items() if k in ENV_FLAGS}
        if session.get("lib", "exact") != "exact":
            flags.pop(ENV_LIB_DIR, None)
        child_env = {k: v for k, v in os.environ.items() if k not in ENV_FLAGS and k != "LLAMA_CPP_LIB_PATH"}
        read_end, write_end = os.pipe()
        try:
            self._child = Child([sys.executable, "-m", "dflash.worker"], child_env, out_fd=write_end,
                                stdin=subprocess.PIPE)
        except BaseException:
            os.close(read_end)
            raise
        self._answers = os.fdopen(read_end, "r", encoding="utf-8")
        self._closed = False
        try:
            self.info: Json = self._call("open", {"session": session, "env": flags})
        except BaseException:
            self.close()
            raise

    def _call(self, op: str, args: Mapping[str, Any]) -> Any:
        stdin = self._child.proc.stdin
        assert stdin is not None  # a pipe
        try:
            stdin.write(json.dumps({"op": op, "args": dict(args)}).encode() + b"\n")
            stdin.flush()
            line = self._answers.readline()
        except OSError:
            line = ""
        if not line:
            raise LlamaError(self._child.died())
        answer = json.loads(line)
        if "error" in answer:
            e = answer["error"]
            raise _ERRORS.get(e["type"], DflashError)(e["message"], exit_code=e["exit_code"])
        return answer["ok"]

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self._call("tokenize", {"text": text})]

    def prefill(self, prompt: str | Sequence[int] | None = None, **options: Any) -> PrefillResult:
        """Session.prefill in the child (options as it takes them, without progress)."""
        p = prompt if prompt is None or isinstance(prompt, str) else [int(t) for t in prompt]
        return PrefillResult.from_json(self._call("prefill", {"prompt": p, **options}), "the worker's prefill")

    def provenance(self, text: str, tokens: Sequence[int]) -> dict[str, dict[str, Any]]:
        return dict(self._call("provenance", {"text": text, "tokens": list(tokens)}))

    def close(self) -> None:
        """Ask the child to free its Session and exit; kill it if it does not within 30 s."""
        if self._closed:
            return
        self._closed = True
        proc = self._child.proc
        try:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(b'{"op": "close", "args": {}}\n')
                    proc.stdin.close()
                except OSError:
                    pass
                proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            self._answers.close()
            self._child.cleanup()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# the child


def _error(e: DflashError) -> Json:
    return {"error": {"type": type(e).__name__ if type(e).__name__ in _ERRORS else "DflashError",
                      "message": e.template.splitlines()[0] if e.template else type(e).__name__,
                      "exit_code": e.exit_code}}


def _say(kind: str) -> Any:
    return lambda msg: print(f"dflash: {kind}: {msg}", file=sys.stderr, flush=True)


def serve(lines: Any, send: Any) -> int:
    """Answer requests until close or end of input; 0, or the exit code of a failed open."""
    from dflash.session import Session

    session: Session | None = None
    try:
        for line in lines:
            msg = json.loads(line)
            op, args = msg["op"], msg.get("args", {})
            if op == "close":
                break
            try:
                if op == "open":
                    session = Session(settings=Settings.from_env(args["env"]), **args["session"],
                                      warn=_say("warning"), log=_say("note"))
                    send({"ok": session.info()})
                    continue
                if session is None:
                    raise DflashError(f"the worker has no session for {op!r} (open first)")
                if op == "tokenize":
                    send({"ok": session.tokenize(args["text"])})
                elif op == "prefill":
                    send({"ok": session.prefill(args.pop("prompt"), **args).to_json()})
                elif op == "provenance":
                    send({"ok": session.provenance(args["text"], args["tokens"])})
                else:
                    raise DflashError(f"unknown worker request {op!r}")
            except DflashError as e:
                send(_error(e))
                if session is None:
                    return e.exit_code
        return 0
    finally:
        if session is not None:
            session.close()


def main() -> int:
    if not stage.become_worker():
        print("dflash.worker runs as the child of dflash.worker.Worker", file=sys.stderr)
        return 2
    channel = sys.stdout

    def send(obj: Json) -> None:
        channel.write(json.dumps(obj, allow_nan=False) + "\n")
        channel.flush()
    try:
        code = serve(sys.stdin, send)
    except stage.Interrupted:
        code = 130
    except Exception as e:  # noqa: BLE001 -- one line to the parent, never a traceback
        send({"error": {"type": "DflashError", "message": f"internal error: {type(e).__name__}: {e}".splitlines()[0],
                        "exit_code": 1}})
        code = 1
    stage.exiting(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
