"""What a worker process is doing now: the one leaf every layer may call (`stage`).

A supervised worker (dflash/run/supervisor.py starts it) records its *stage* ("loading the model",
"band at position 128 (width 4)", ...) and the evidence temp directory it owns in a small state
file the supervisor reads after a crash. Outside a worker every call here is a no-op, so library
code calls `stage()` freely; a program that embeds dflash never sees a state file.

The worker side also turns SIGINT and SIGTERM into one `Interrupted` exception, so temp files are
removed on the way out and the exit code is 130.
"""
from __future__ import annotations

import os
import signal
import sys
from types import FrameType

ENV_WORKER = "DFLASH_WORKER"  # set by the supervisor in the worker: "OUT_FD,ERR_FD,STATE_PATH"

# state file layout: fixed slots rewritten in place (pwrite), read by the supervisor after exit
STAGE_AT, SCRATCH_AT, DONE_AT, STATE_SIZE = 0, 1024, 8192, 8200
_state_fd: int | None = None


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
    _put(STAGE_AT, text, SCRATCH_AT - STAGE_AT)


def owns_scratch(path: str | os.PathLike[str] | None) -> None:
    """Record a temp directory the supervisor removes if the worker dies (None: nothing owned)."""
    _put(SCRATCH_AT, "" if path is None else str(path), DONE_AT - SCRATCH_AT)


def exiting(code: int) -> None:
    """Record that the worker leaves through dflash's own exit path (its message is printed)."""
    _put(DONE_AT, f"{code:>3}", STATE_SIZE - DONE_AT)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind (temp files are removed on the way) and exit 130. Not a
    KeyboardInterrupt, which click would turn into a bare 'Aborted!'."""


def _first_interrupt_only(signum: int, frame: FrameType | None) -> None:
    """SIGINT/SIGTERM raise Interrupted once; a repeat (the terminal's and the supervisor's copy
    of one Ctrl-C) must not break the cleanup the first one started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def become_worker() -> bool:
    """In a supervised worker: point Python's stdout/stderr at the descriptors the supervisor
    passed, keep descriptors 1 and 2 (llama.cpp's) on its capture file, open the state file.
    False outside a worker (SIGTERM then stops like Ctrl-C)."""
    global _state_fd
    spec = os.environ.pop(ENV_WORKER, None)
    if not spec:
        signal.signal(signal.SIGTERM, _first_interrupt_only)
        return False
    out_fd, err_fd, state = spec.split(",", 2)
    sys.stdout = os.fdopen(int(out_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    sys.stderr = os.fdopen(int(err_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    _state_fd = os.open(state, os.O_WRONLY)
    signal.signal(signal.SIGINT, _first_interrupt_only)
    signal.signal(signal.SIGTERM, _first_interrupt_only)
    stage("start-up")
    return True
