"""`dflash rpc-server`: serve this machine's device to dflash clients through ggml's RPC backend."""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time

import click

from dflash.cli import output
from dflash.cli.options import Command, lib_option, threads_option
from dflash.core import settings, stage
from dflash.core.errors import DflashError, UsageError
from dflash.core.results import Library, RpcServerResult
from dflash.native import devices, library_id, llama, rpc
from dflash.run import engine

START_SECONDS = 30.0  # how long the server may take to answer its own handshake


def _port_free(host: str, port: int) -> None:
    """A clear error for a port already taken (ggml's server would only say it failed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml's server binds
        try:
            s.bind((host, port))
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise DflashError(f"cannot listen on {host}:{port}: {why}") from None


@click.command("rpc-server", cls=Command)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="IPv4 address to listen on; anything but loopback needs --allow-remote.")
@click.option("--port", type=click.IntRange(1, 65535), default=rpc.DEFAULT_PORT, show_default=True)
@threads_option
@lib_option
@click.option("--device", default="cpu", show_default=True, help="The device to serve: cpu, hip:N, cuda:N or vulkan:N.")
@click.option("--allow-remote", is_flag=True,
              help="Listen on a non-loopback address. The RPC protocol has no authentication: trusted networks only.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object once the server answers.")
def command(host: str, port: int, threads: int | None, lib: str, device: str, allow_remote: bool,
            as_json: bool) -> None:
    """Serve a device of this machine's llama.cpp build over ggml's RPC protocol until Ctrl-C or
    SIGTERM (then exit 0). Clients run `dflash prefill --rpc HOST:PORT --device rpc:0 ...`; they
    refuse a server whose library build differs from theirs unless --allow-mixed-builds."""
    host, warning = rpc.bind_address(host, allow_remote)
    spec = devices.parse_spec(device)
    if len(spec.entries) != 1 or spec.rpc_ids:
        raise UsageError(f"--device {device!r}: a server serves one local device (cpu, hip:N, cuda:N or vulkan:N)")
    s = settings.Settings.from_env(lib=lib)
    for w in s.warnings():
        output.warn(w)
    if warning:
        output.warn(warning)
    devices.require_gpu(device)  # exit 3 before any build
    _port_free(host, port)
    kind = spec.kind
    build = library_id.build_id(s, kind)
    os.environ[rpc.ENV_BUILD_ID] = rpc.build_id_text(build, s.lib, str(spec))  # before llama.cpp loads
    index = engine.gpu_index(spec)
    lib_dir = engine.load_library(s, output.note, gpu="none" if kind == "cpu" else kind, build_missing=True)
    n_threads = threads or min(os.cpu_count() or 1, 8)
    endpoint = rpc.Endpoint(host, port)
    served = "cpu" if kind == "cpu" else f"gpu:{index[spec.gpu_ids[0]]}"
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            llama.rpc_serve(str(endpoint), n_threads, served)
        except BaseException as e:  # reported by the main thread
            failure.append(e)

    thread = threading.Thread(target=serve, name="rpc-server", daemon=True)
    thread.start()
    info = _await_ready(endpoint, thread, failure)
    result = RpcServerResult(str(endpoint), build, str(spec), info.protocol, n_threads,
                             Library(s.lib, str(lib_dir), s.cpu), warning is not None, os.getpid())
    if as_json:  # one line, so a script can read it as soon as the server answers
        click.echo(json.dumps(result.to_json(), separators=(", ", ": ")))
    else:
        output.out.print(f"dflash rpc-server: serving {result.device} at {result.endpoint} (library build {build}, "
                         f"RPC protocol {result.protocol}, {n_threads} threads); stop with Ctrl-C", highlight=False,
                         markup=False)
    sys.stdout.flush()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except stage.Interrupted:
        output.note(f"dflash rpc-server at {endpoint}: stopped")
        stage.exiting(0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # ggml's accept loop has no stop call: end the process, which closes its sockets
    raise DflashError(f"ggml's RPC server at {endpoint} stopped" + (f": {failure[0]}" if failure else ""))


def _await_ready(endpoint: rpc.Endpoint, thread: threading.Thread, failure: list[BaseException]) -> rpc.ServerInfo:
    """The server's answer to its own handshake (it listens and speaks the protocol), or an error
    once the serving thread ended or START_SECONDS passed."""
    deadline = time.monotonic() + START_SECONDS
    last = ""
    while time.monotonic() < deadline:
        if not thread.is_alive():
            why = str(failure[0]) if failure else "address not available, or the device failed to start"
            raise DflashError(f"ggml's RPC server did not start at {endpoint}: {why}")
        try:
            return rpc.probe(endpoint, timeout=2.0)
        except rpc.RpcError as e:
            last = str(e)
            time.sleep(0.1)
    raise DflashError(f"ggml's RPC server at {endpoint} did not answer within {START_SECONDS:g} s ({last})")


commands = [command]
