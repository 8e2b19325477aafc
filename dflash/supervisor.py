"""Commands that load llama.cpp run in a supervised worker process.

A crash, abort or hang inside llama.cpp cannot be caught in the process it happens in, so the
`dflash` entry point runs those commands (see SUPERVISED) as a child `python -m dflash ...` and
watches it:

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

This module imports nothing heavy: the parent process is only this.
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
from pathlib import Path

SUPERVISED = frozenset({"prefill", "bench", "qualify", "diff", "tiny-model", "devices", "kernels", "rpc-server",
                        "memory"})
LIVE_NATIVE_OUTPUT = frozenset({"rpc-server"})  # a server's log is passed on as it is written, not at exit
ENV_WORKER = "DFLASH_WORKER"          # set by the supervisor in the worker: "OUT_FD,ERR_FD,STATE_PATH"
ENV_STALL = "DFLASH_STALL_TIMEOUT"    # seconds without a stage change before a worker is stopped
GRACE_SECONDS = 10.0                  # how long an interrupted worker may take to clean up

# state file layout: fixed slots rewritten in place (pwrite), read by the supervisor after exit
_STAGE_AT, _SCRATCH_AT, _DONE_AT, _STATE_SIZE = 0, 1024, 8192, 8200
_state_fd: int | None = None
_SOURCE_PREFIX = re.compile(r"^\S+\.(?:c|cc|cpp|cu|h):\d+: ")  # GGML_ABORT's "file:line: " before its text


# ---------------------------------------------------------------------------------------------
# worker side


def _put(offset: int, text: str, size: int) -> None:
    if _state_fd is None:
        return
    data = text.encode("utf-8", errors="replace")[: size - 1]
    try:
        os.pwrite(_state_fd, data + b"\0" * (size - len(data)), offset)
    except OSError:
        pass  # the supervisor is gone or the file was removed: nothing to report to


def stage(text: str) -> None:
    """Record what the worker is doing now (no-op outside a supervised worker)."""
    _put(_STAGE_AT, text, _SCRATCH_AT - _STAGE_AT)


def owns_scratch(path: str | os.PathLike | None) -> None:
    """Record a temp directory the supervisor removes if the worker dies (None: nothing owned)."""
    _put(_SCRATCH_AT, "" if path is None else str(path), _DONE_AT - _SCRATCH_AT)


def exiting(code: int) -> None:
    """Record that the worker leaves through dflash's own exit path (its message is printed)."""
    _put(_DONE_AT, f"{code:>3}", _STATE_SIZE - _DONE_AT)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind (temp files are removed on the way) and exit 130. Not a
    KeyboardInterrupt, which click would turn into a bare 'Aborted!'."""


def _first_interrupt_only(signum, frame):
    """SIGINT/SIGTERM raise Interrupted once; a repeat (the terminal's and the supervisor's copy
    of one Ctrl-C) must not break the cleanup the first one started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def become_worker() -> bool:
    """In a supervised worker: point Python's stdout/stderr at the real ones, keep descriptors 1
    and 2 (llama.cpp's) on the capture file, open the state file. False outside a worker."""
    global _state_fd
    spec = os.environ.pop(ENV_WORKER, None)
    if not spec:
        signal.signal(signal.SIGTERM, _first_interrupt_only)  # SIGTERM stops like Ctrl-C
        return False
    out_fd, err_fd, state = spec.split(",", 2)
    sys.stdout = os.fdopen(int(out_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    sys.stderr = os.fdopen(int(err_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    _state_fd = os.open(state, os.O_WRONLY)
    signal.signal(signal.SIGINT, _first_interrupt_only)
    signal.signal(signal.SIGTERM, _first_interrupt_only)
    stage("start-up")
    return True


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


def supervise(cmd: list[str], env: dict[str, str] | None = None, live: bool = False) -> int:
    """Run `cmd` (a dflash worker) under supervision; returns the exit code to use. `live` passes
    llama.cpp's output on while the worker runs (a server's log) instead of after it ends."""
    stall = _stall_timeout()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-worker-"))
    try:
        state, capture = workdir / "state", workdir / "native-output"
        state.write_bytes(b"\0" * _STATE_SIZE)
        out_fd, err_fd = os.dup(1), os.dup(2)
        child_env = dict(os.environ if env is None else env)
        child_env[ENV_WORKER] = f"{out_fd},{err_fd},{state}"
        child_env.setdefault("GGML_NO_BACKTRACE", "1")  # no debugger attached to a dying worker
        with open(capture, "wb") as cap:
            proc = subprocess.Popen(cmd, stdout=cap, stderr=cap, pass_fds=(out_fd, err_fd), env=child_env,
                                    preexec_fn=_die_with_parent)
        os.close(out_fd)
        os.close(err_fd)
        tail = _Tail(capture) if live else None
        outcome = _watch(proc, state, stall, tail)
        if tail is not None:
            tail()
        data = state.read_bytes()
        stage_text = _read_slot(data, _STAGE_AT, _SCRATCH_AT) or "start-up"
        scratch = _read_slot(data, _SCRATCH_AT, _DONE_AT)
        done = _read_slot(data, _DONE_AT, _STATE_SIZE)
        rc = proc.returncode
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
                _relay(capture)
            return rc
        _remove(scratch)
        native = _last_native_line(capture)
        _say("error", f"llama.cpp worker {describe_exit(rc)} during {stage_text}"
                      + (f": {native}" if native else ""))
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _die_with_parent() -> None:
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


def _watch(proc: subprocess.Popen, state: Path, stall: float | None, tick: _Tail | None = None) -> str:
    """Wait for the worker: 'exited', 'interrupted' (and stopped), or 'stalled' (and killed);
    `tick` runs between polls."""
    stop_at: list[float] = []

    def forward(signum, frame):
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
                current = state.read_bytes()[:_SCRATCH_AT]
                if current != last_state:
                    last_state, last_change = current, now
                elif now - last_change > stall:
                    proc.kill()
                    proc.wait()
                    return "stalled"
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def worker_command(argv: list[str]) -> str | None:
    """The subcommand named in argv when it loads llama.cpp, else None."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a if a in SUPERVISED else None
    return None


def run_cli(argv: list[str]) -> None:
    """Run the CLI in this process (a worker, or a command that loads no llama.cpp)."""
    from .cli import main as cli_main
    try:
        cli_main(argv)
    except SystemExit as e:
        exiting(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
        raise


def main() -> None:
    """The `dflash` entry point."""
    argv = sys.argv[1:]
    command = worker_command(argv)
    if not become_worker() and command is not None and "--help" not in argv and "-h" not in argv:
        sys.exit(supervise([sys.executable, "-m", "dflash", *argv], live=command in LIVE_NATIVE_OUTPUT))
    run_cli(argv)
