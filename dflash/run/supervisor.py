"""The one way dflash runs llama.cpp in another process: a supervised worker.

A crash, abort or hang inside llama.cpp cannot be caught in the process it happens in, so the
`dflash` entry point (dflash/__main__.py) runs the commands that load llama.cpp as a child
`python -m dflash ...`, and dflash/worker.py's client runs a Session in a child that answers
typed requests (sweep, matrix); `supervise` and `Worker` watch such a child the same way:

* The worker's Python output (sys.stdout, sys.stderr) goes to the real stdout and stderr through
  duplicated descriptors; descriptors 1 and 2 themselves, where llama.cpp, ggml and the C runtime
  write (assert messages, a debugger's backtrace), go to a capture file. stdout therefore carries
  only what dflash prints: one JSON document or nothing under --json.
* The worker records what it is doing (its *stage*: "loading the model", "band at position 128
  (width 4)", ...) and the evidence temp directory it owns in a small state file.
* When the worker dies by a signal, or exits without passing through dflash's own exit path,
  the supervisor prints one line naming the signal and the stage (and llama.cpp's last line of
  output), removes the temp directory, and exits 1.
* SIGINT and SIGTERM reach the worker, which stops as after Ctrl-C (exit 130, temp files
  removed); a worker that does not stop within GRACE_SECONDS is killed.
* DFLASH_STALL_TIMEOUT=S (seconds, off by default) stops a worker whose stage has not changed
  for S seconds: a hang inside llama.cpp ends with one line and exit 1.

This module imports nothing heavy: the CLI's parent process is only this and dflash/core/stage.py.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.core.settings import ENV_STALL
from dflash.core.stage import DONE_AT, ENV_WORKER, SCRATCH_AT, STAGE_AT, STATE_SIZE

if TYPE_CHECKING:
    from types import FrameType

GRACE_SECONDS = 10.0                  # how long an interrupted worker may take to clean up

_SOURCE_PREFIX = re.compile(r"^\S+\.(?:c|cc|cpp|cu|h):\d+: ")  # GGML_ABORT's "file:line: " before its text


# ---------------------------------------------------------------------------------------------
# supervisor side


def signal_name(signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    what = signal.strsignal(signum) or ""
    return f"{name} ({what.lower()})" if what else name


def describe_exit(returncode: int) -> str:
    """'killed by SIGSEGV (segmentation fault)' or 'exited with code N'."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    if returncode > 128 and returncode - 128 < signal.NSIG:  # a shell's way of saying it
        return f"killed by {signal_name(returncode - 128)}"
    return f"exited with code {returncode}"


def _read_slot(data: bytes, offset: int, end: int) -> str:
    return data[offset:end].split(b"\0", 1)[0].decode("utf-8", errors="replace").strip()


def _last_native_line(capture: Path) -> str:
    """The last meaningful line llama.cpp or the C runtime wrote (e.g. a GGML_ASSERT)."""
    try:
        with open(capture, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    lines = [ln.strip() for ln in lines if ln.strip()]
    for ln in reversed(lines):  # an assert or error line beats a trailing backtrace frame
        if "GGML_ASSERT" in ln or "error" in ln.lower() or "abort" in ln.lower() or " lost: " in ln:
            return _SOURCE_PREFIX.sub("", ln)
    return _SOURCE_PREFIX.sub("", lines[-1]) if lines else ""


def _relay(capture: Path, offset: int = 0) -> int:
    """Pass what llama.cpp wrote to descriptors 1 and 2 from `offset` on to stderr; returns the new
    offset (a run that ended normally, or a server's log as it grows)."""
    try:
        with open(capture, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    if data:
        sys.stderr.buffer.write(data)
        sys.stderr.flush()
    return offset + len(data)


class _Tail:
    """Relays what a file gained since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def __call__(self) -> None:
        self.offset = _relay(self.path, self.offset)


def _stall_timeout() -> float | None:
    raw = os.environ.get(ENV_STALL, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        _say("usage error", f"{ENV_STALL}={raw!r} is not a number of seconds > 0")
        sys.exit(2)
    return value


def _say(kind: str, msg: str) -> None:
    sys.stderr.write(f"dflash: {kind}: {msg}".splitlines()[0] + "\n")
    sys.stderr.flush()


class Child:
    """A dflash worker process started under watch: its state file and the capture of what
    llama.cpp writes to descriptors 1 and 2. `out_fd` is where the worker's Python stdout goes (the
    real stdout by default; a pipe for a protocol worker), `stdin` as subprocess.Popen takes it."""

    def __init__(self, cmd: list[str], env: Mapping[str, str] | None = None, *, out_fd: int | None = None,
                 stdin: int | None = None):
        self.workdir = Path(tempfile.mkdtemp(prefix="dflash-worker-"))
        self.state, self.capture = self.workdir / "state", self.workdir / "native-output"
        try:
            self.state.write_bytes(b"\0" * STATE_SIZE)
            out = os.dup(1) if out_fd is None else out_fd
            err = os.dup(2)
            child_env = dict(os.environ if env is None else env)
            child_env[ENV_WORKER] = f"{out},{err},{self.state}"
            child_env.setdefault("GGML_NO_BACKTRACE", "1")  # no debugger attached to a dying worker
            try:
                with open(self.capture, "wb") as cap:
                    self.proc = subprocess.Popen(cmd, stdin=stdin, stdout=cap, stderr=cap, pass_fds=(out, err),
                                                 env=child_env, preexec_fn=die_with_parent)
            finally:
                os.close(out)
                os.close(err)
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def slots(self) -> tuple[str, str, str]:
        """(stage, scratch directory, done code) as the worker last wrote them."""
        data = self.state.read_bytes()
        return (_read_slot(data, STAGE_AT, SCRATCH_AT) or "start-up", _read_slot(data, SCRATCH_AT, DONE_AT),
                _read_slot(data, DONE_AT, STATE_SIZE))

    def died(self) -> str:
        """After the worker ended outside dflash's own exit path: remove the temp directory it owned
        and say how it ended, in which stage, with llama.cpp's last line."""
        stage_text, scratch, _ = self.slots()
        _remove(scratch)
        native = _last_native_line(self.capture)
        return (f"llama.cpp worker {describe_exit(self.proc.wait())} during {stage_text}"
                + (f": {native}" if native else ""))

    def relay(self) -> None:
        """Pass what llama.cpp wrote on to stderr (a run that ended normally)."""
        _relay(self.capture)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def supervise(cmd: list[str], env: dict[str, str] | None = None, live: bool = False) -> int:
    """Run `cmd` (a dflash worker) under supervision; returns the exit code to use. `live` passes
    llama.cpp's output on while the worker runs (a server's log) instead of after it ends."""
    stall = _stall_timeout()
    child = Child(cmd, env)
    try:
        tail = _Tail(child.capture) if live else None
        outcome = _watch(child.proc, child.state, stall, tail)
        if tail is not None:
            tail()
        stage_text, scratch, done = child.slots()
        rc = child.proc.returncode
        if outcome == "interrupted" and done == "":
            _remove(scratch)
            _say("error", f"interrupted during {stage_text}"
                          + ("" if rc == 130 else f"; the worker {describe_exit(rc)}"))
            return 130
        if outcome == "stalled":
            _remove(scratch)
            _say("error", f"llama.cpp made no progress for {stall:g} s ({ENV_STALL}) during {stage_text}; "
                          "the worker was stopped")
            return 1
        if done != "" and rc >= 0:  # dflash's own exit path ran and printed whatever it had to say
            if not live:
                child.relay()
            return rc
        _say("error", child.died())
        return 1
    finally:
        child.cleanup()


def die_with_parent() -> None:
    """In the forked child before exec: SIGTERM when the supervisor dies (even by SIGKILL), so the
    worker stops and removes its temp files instead of running on as an orphan."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _remove(path: str) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _watch(proc: subprocess.Popen[bytes], state: Path, stall: float | None, tick: _Tail | None = None) -> str:
    """Wait for the worker: 'exited', 'interrupted' (and stopped), or 'stalled' (and killed);
    `tick` runs between polls."""
    stop_at: list[float] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + GRACE_SECONDS)
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        last_state, last_change = b"", time.monotonic()
        while True:
            try:
                proc.wait(timeout=0.2)
                return "interrupted" if stop_at else "exited"
            except subprocess.TimeoutExpired:
                pass
            if tick is not None:
                tick()
            now = time.monotonic()
            if stop_at and now > stop_at[0]:
                proc.kill()
                proc.wait()
                return "interrupted"
            if stall is not None and not stop_at:
                current = state.read_bytes()[:SCRATCH_AT]
                if current != last_state:
                    last_state, last_change = current, now
                elif now - last_change > stall:
                    proc.kill()
                    proc.wait()
                    return "stalled"
    finally:
        for s, h in old.items():
            signal.signal(s, h)
