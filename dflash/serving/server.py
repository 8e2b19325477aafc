"""llama-server as a supervised child process.

`Server` starts one llama-server (a binary from `dflash build --server`), relays its log line by
line, waits until /health answers 200, and stops it (SIGTERM, then SIGKILL after GRACE_SECONDS).
`serve_forever` is `dflash serve`'s loop: it restarts a server that died (the requests in flight
fail; the next ones are served) and gives up after MAX_CRASHES crashes within CRASH_WINDOW seconds.
Requests go through dflash.serving.client.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dflash.core.errors import DflashError
from dflash.run.supervisor import describe_exit, die_with_parent
from dflash.serving.client import request

GRACE_SECONDS = 10.0      # a stopping server's time to finish before SIGKILL
START_SECONDS = 300.0     # loading a model and warming up
MAX_CRASHES, CRASH_WINDOW = 5, 60.0

Say = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(host: str, port: int) -> None:
    """A one-line error when another process already listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise DflashError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def check_libraries(pid: int, lib_dir: str) -> None:
    """The llama.cpp libraries a process mapped (libllama, libggml*) all come from `lib_dir`: the
    server computes with the very files dflash prefill loads."""
    want = Path(lib_dir).resolve()
    seen: dict[str, Path] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        name = Path(path).name
        if name.startswith(("libllama.so", "libggml")):
            seen[name] = Path(path).resolve().parent
    wrong = sorted(f"{n} from {d}" for n, d in seen.items() if d != want)
    if not any(n.startswith("libllama.so") for n in seen) or wrong:
        raise DflashError(f"llama-server did not load its llama.cpp from {want}: "
                          + (", ".join(wrong) if wrong else "no libllama mapped"))


class Server:
    """One llama-server child: `start()` returns once /health answers 200 (or raises DflashError
    with the reason and the server's last log line); `stop()` ends it. Its stdout and stderr are
    relayed to `log_line` line by line from a thread."""

    def __init__(self, argv: Sequence[str], host: str, port: int, env: Mapping[str, str] | None = None,
                 log_line: Say = _quiet, api_key: str | None = None, lib_dir: str | None = None):
        self.argv, self.host, self.port, self.lib_dir = list(argv), host, port, lib_dir
        self.env = dict(os.environ if env is None else env)
        self.log_line, self.api_key = log_line, api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.last_lines: list[str] = []
        self._relay: threading.Thread | None = None
        self._key_dir: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        if not self.api_key:
            return self.argv
        if self._key_dir is None:  # the key travels in a private file, not on the command line
            self._key_dir = tempfile.mkdtemp(prefix="dflash-serve-")
            key_file = Path(self._key_dir) / "api-key"
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.api_key + "\n")
        return [*self.argv, "--api-key-file", str(Path(self._key_dir) / "api-key")]

    def start(self, timeout: float = START_SECONDS) -> None:
        self.last_lines = []
        self.proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=self.env, preexec_fn=die_with_parent)
        self._relay = threading.Thread(target=self._pump, args=(self.proc,), daemon=True, name="llama-server-log")
        self._relay.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._relay.join(2.0)
                raise DflashError(f"llama-server {describe_exit(self.proc.returncode)} while starting"
                                  + (f": {self.last_line()}" if self.last_line() else ""))
            try:
                ready = request(self.url + "/health", method="GET", timeout=2.0).status == 200
            except OSError:
                ready = False
            if ready:
                try:
                    if self.lib_dir is not None:
                        check_libraries(self.proc.pid, self.lib_dir)
                except BaseException:
                    self.stop()
                    raise
                return
            time.sleep(0.1)
        self.stop()
        raise DflashError(f"llama-server did not answer /health within {timeout:g} s")

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.last_lines = (self.last_lines + [line])[-20:]
            self.log_line(line)

    def last_line(self) -> str:
        for line in reversed(self.last_lines):
            if line.strip():
                return line.strip()
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once it ended (negative: a signal), None while it runs after `timeout`."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = GRACE_SECONDS) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._relay is not None:
            self._relay.join(2.0)
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        if self._key_dir is not None:
            for p in Path(self._key_dir).iterdir():
                p.unlink()
            os.rmdir(self._key_dir)
            self._key_dir = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_forever(server: Server, stop: threading.Event, note: Say, on_ready: Callable[[int], None]) -> int:
    """Run `server` until `stop` is set (then stop it: exit 0); restart it whenever it dies on its
    own, saying how; give up (exit 1) after MAX_CRASHES crashes within CRASH_WINDOW seconds or a
    restart that fails. `on_ready(n)` runs after start n (0 = the first)."""
    crashes: list[float] = []
    starts = 0
    try:
        while True:
            server.start()
            on_ready(starts)
            starts += 1
            while not stop.is_set():
                status = server.wait(0.2)
                if status is not None:
                    break
            if stop.is_set():
                status = server.stop()
                note(f"llama-server stopped ({describe_exit(status if status is not None else 0)})")
                return 0
            now = time.monotonic()
            crashes = [t for t in crashes if now - t < CRASH_WINDOW] + [now]
            last = server.last_line()
            assert status is not None
            note(f"llama-server {describe_exit(status)}" + (f" ({last})" if last else "")
                 + f"; requests in flight failed; restart {len(crashes)} of at most {MAX_CRASHES} a minute")
            if len(crashes) >= MAX_CRASHES:
                raise DflashError(f"llama-server crashed {len(crashes)} times within {CRASH_WINDOW:g} s; giving up")
    finally:
        server.close()
