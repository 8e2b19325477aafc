"""ggml's RPC backend, seen from dflash: endpoints, the handshake, and which build a server serves.

llama.cpp's RPC backend is the distributed engine: `dflash rpc-server` serves one machine's
devices through `ggml_backend_rpc_start_server`, and a client registers servers with
`ggml_backend_rpc_add_server` and places layers on their devices (dflash/native/llama.py does both).
ggml's client aborts the process when it cannot connect or when a server is lost, so before
llama.cpp touches a server this module speaks the protocol's first messages itself, over a plain
socket with a timeout: HELLO (the protocol version), DEVICE_COUNT, and the command the project's
RPC patch adds (rpc/patches), which answers the library build the server runs. A server that is
not listening, does not answer, speaks another protocol or runs another build is then one line of
error before the model loads. Nothing here loads llama.cpp.

Wire format (ggml-rpc.cpp at the pinned commit, little-endian): a request is the command (1 byte),
the payload size (8 bytes) and the payload; a response is the size (8 bytes) and the payload.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import struct
from dataclasses import dataclass
from typing import Any

from dflash.core.errors import DflashError, UsageError, arg

PROTOCOL = (7, 0, 0)        # RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of the pinned ggml-rpc.h
CMD_HELLO = 14              # fixed across versions (static_assert in ggml-rpc.cpp)
CMD_DEVICE_COUNT = 15
CMD_DFLASH_BUILD_ID = 18    # added by rpc/patches/0001 (after RPC_CMD_MEMSET_TENSOR)
CONN_CAPS_SIZE = 24         # RPC_CONN_CAPS_SIZE (transport.h): the transport upgrade offer, all 0 = TCP
BUILD_ID_SIZE = 256         # rpc_msg_dflash_build_id_rsp
ENV_BUILD_ID = "DFLASH_RPC_BUILD_ID"  # what a patched server answers, set by `dflash rpc-server`
DEFAULT_PORT = 50052
HANDSHAKE_TIMEOUT = 10.0    # seconds for connect and each answer of the handshake


class RpcError(DflashError):
    """An RPC server cannot be used (exit 1)."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str, what: str = "--rpc") -> Endpoint:
    """HOST:PORT (an IPv4 address or a host name; port 1..65535)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in host):
        raise UsageError(f"{what} {text!r} is not HOST:PORT (port 1..65535)")
    if host.startswith("[") or ":" in host:
        raise UsageError(f"{what} {text!r}: ggml's RPC backend speaks IPv4 only")
    return Endpoint(host, int(port))


def parse_endpoints(text: str | None) -> tuple[Endpoint, ...]:
    """--rpc HOST:PORT[,HOST:PORT...]: each once, at most 16 (GGML_RPC_MAX_SERVERS)."""
    if text is None:
        return ()
    eps = tuple(parse_endpoint(part) for part in text.split(","))
    if len(set(eps)) != len(eps):
        raise UsageError(f"{arg('rpc')} {text!r} names a server twice")
    if len(eps) > 16:
        raise UsageError(f"{arg('rpc')} names {len(eps)} servers; ggml's RPC backend takes at most 16")
    return eps


def bind_address(host: str, allow_remote: bool) -> tuple[str, str | None]:
    """(host, warning) for `dflash rpc-server --host`: an IPv4 address (the server binds no host
    names); anything but a loopback address needs --allow-remote and carries a warning (None:
    loopback)."""
    try:
        addr = ipaddress.ip_address(host.strip())
    except ValueError:
        addr = None
    if addr is None or addr.version != 4:
        raise UsageError(f"{arg('host')} {host!r} is not an IPv4 address (ggml's RPC server binds IPv4 addresses only)")
    if addr.is_loopback:
        return str(addr), None
    if not allow_remote:
        raise UsageError(f"{arg('host')} {host} is not a loopback address: the RPC protocol has no authentication, "
                         f"and anyone who reaches the port can use this machine's device and read and write its "
                         f"memory; pass --allow-remote to serve a trusted, isolated network")
    return str(addr), (f"serving on {addr}, not a loopback address: the RPC protocol has no authentication or "
                       f"encryption; anyone who reaches this port can use this machine's device and read and "
                       f"write its memory. Serve a trusted, isolated network only, behind a firewall.")


@dataclass(frozen=True)
class ServerInfo:
    """What a server answered in the handshake."""
    endpoint: str
    protocol: str                 # "7.0.0"
    n_devices: int
    build: str | None             # the library build id it serves; None: not a dflash rpc-server
    flavor: str | None            # "exact" / "stock" (from the build id)
    device: str | None            # the server's --device (cpu, hip:N, ...)

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "protocol": self.protocol, "n_devices": self.n_devices,
                "build": self.build, "flavor": self.flavor, "device": self.device}


def build_id_text(build: str, flavor: str, device: str) -> str:
    """What `dflash rpc-server` puts in DFLASH_RPC_BUILD_ID: compact JSON, under 256 bytes."""
    text = json.dumps({"build": build, "flavor": flavor, "device": device}, separators=(",", ":"))
    if len(text.encode()) >= BUILD_ID_SIZE:
        raise DflashError(f"RPC build id too long ({len(text)} bytes)")
    return text


def _recv_exact(sock: socket.socket, n: int, ep: Endpoint, step: str) -> bytes:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise RpcError(f"RPC server {ep} did not answer {step} within {sock.gettimeout():g} s "
                           f"(busy with another client, or not a ggml RPC server)") from None
        except ConnectionResetError:
            raise EOFError(step) from None
        except OSError as e:
            raise RpcError(f"RPC server {ep} failed during {step}: {e.strerror or e}") from None
        if not chunk:
            raise EOFError(step)
        data += chunk
    return data


def _call(sock: socket.socket, ep: Endpoint, cmd: int, payload: bytes, answer_size: int, step: str) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    size = struct.unpack("<Q", _recv_exact(sock, 8, ep, step))[0]
    if size != answer_size:
        raise RpcError(f"RPC server {ep} answered {step} with {size} bytes, expected {answer_size}: "
                       f"another RPC protocol version than this llama.cpp's {'.'.join(map(str, PROTOCOL))}")
    return _recv_exact(sock, size, ep, step)


def probe(ep: Endpoint, timeout: float = HANDSHAKE_TIMEOUT) -> ServerInfo:
    """Handshake with one server (see the module docstring); RpcError (exit 1) says what is wrong."""
    try:
        sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
    except ConnectionRefusedError:
        raise RpcError(f"RPC server {ep} is not listening (connection refused)") from None
    except TimeoutError:
        raise RpcError(f"RPC server {ep} did not accept a connection within {timeout:g} s") from None
    except socket.gaierror as e:
        raise RpcError(f"RPC server {ep}: cannot resolve {ep.host!r} ({e.strerror})") from None
    except OSError as e:
        raise RpcError(f"RPC server {ep} cannot be reached: {e.strerror or e}") from None
    proto = ".".join(map(str, PROTOCOL))
    with sock:
        sock.settimeout(timeout)
        try:
            hello = _call(sock, ep, CMD_HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE, "the handshake")
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != PROTOCOL[0] or minor > PROTOCOL[1]:
                raise RpcError(f"RPC server {ep} speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp "
                               f"speaks {proto}: run the same llama.cpp version on both sides")
            n_devices = struct.unpack("<I", _call(sock, ep, CMD_DEVICE_COUNT, b"", 4, "the device count"))[0]
        except EOFError:
            raise RpcError(f"RPC server {ep} closed the connection during the handshake: not a ggml RPC server "
                           f"speaking protocol {proto}") from None
        except (BrokenPipeError, ConnectionResetError):
            raise RpcError(f"RPC server {ep} reset the connection during the handshake") from None
        build = flavor = device = None
        try:
            raw = _call(sock, ep, CMD_DFLASH_BUILD_ID, b"", BUILD_ID_SIZE, "the build query")
            text = raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")
            if text:
                try:
                    d = json.loads(text)
                    build, flavor, device = str(d["build"]), str(d["flavor"]), str(d["device"])
                except (ValueError, KeyError, TypeError):
                    build = text
        except (EOFError, BrokenPipeError, ConnectionResetError, RpcError):
            pass  # a ggml RPC server without the project's patch: it serves an unknown build
    return ServerInfo(str(ep), f"{major}.{minor}.{patch}", n_devices, build, flavor, device)


@dataclass(frozen=True)
class RemoteDevice:
    """rpc:N: the N-th device over all servers, in --rpc order."""
    index: int
    server: ServerInfo
    server_device: int

    @property
    def id(self) -> str:
        return f"rpc:{self.index}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "endpoint": self.server.endpoint, "server_device": self.server_device,
                "build": self.server.build, "flavor": self.server.flavor, "served_device": self.server.device}


def remote_devices(servers: tuple[ServerInfo, ...]) -> list[RemoteDevice]:
    out: list[RemoteDevice] = []
    for s in servers:
        for i in range(s.n_devices):
            out.append(RemoteDevice(len(out), s, i))
    return out


@dataclass(frozen=True)
class Remote:
    """The --rpc servers of a run, as they answered the handshake."""
    servers: tuple[ServerInfo, ...]
    allow_mixed_builds: bool = False

    @property
    def devices(self) -> list[RemoteDevice]:
        return remote_devices(self.servers)

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.servers]

    @property
    def identity(self) -> str:
        """What the servers run, for keys of records (not where they are: a server may move)."""
        return ";".join(f"{s.build}@{s.device}x{s.n_devices}" for s in self.servers)

    @property
    def all_cpu(self) -> bool:
        """Every server serves a CPU (as dflash rpc-server reports it)."""
        return all(s.device == "cpu" for s in self.servers)


def connect(rpc: str | None, rpc_ids: list[int], allow_mixed_builds: bool = False) -> Remote | None:
    """The handshake with every --rpc server, before anything is built or loaded: None without
    --rpc; a usage error when --rpc and the rpc:N devices of --device do not go together."""
    endpoints = parse_endpoints(rpc)
    if not endpoints:
        if rpc_ids:
            raise UsageError(f"{arg('device')} rpc:{rpc_ids[0]} needs {arg('rpc')} HOST:PORT (the server serving it)")
        return None
    if not rpc_ids:
        raise UsageError(f"{arg('rpc')} registers servers whose devices {arg('device')} names as rpc:N; it names none "
                         f"(e.g. {arg('device')} rpc:0, or cpu,rpc:0 for a split)")
    remote = Remote(tuple(probe(ep) for ep in endpoints), allow_mixed_builds)
    n = len(remote.devices)
    missing = [i for i in rpc_ids if i >= n]
    if missing:
        raise UsageError(f"{arg('device')} rpc:{missing[0]}: the {arg('rpc')} servers offer {n} device(s) "
                         f"(rpc:0..rpc:{n - 1})")
    return remote


def check_builds(servers: tuple[ServerInfo, ...], client_build: str, allow_mixed: bool) -> list[str]:
    """Refuse a server that runs another library build than this client (exactness is claimed within
    one build), unless allow_mixed; then a warning per such server."""
    warnings = []
    for s in servers:
        if s.build == client_build:
            continue
        what = (f"runs library build {s.build}" if s.build else
                "does not report its library build (not a `dflash rpc-server`)")
        if not allow_mixed:
            raise RpcError(f"RPC server {s.endpoint} {what}, this client {client_build}: exactness is claimed "
                           f"within one build only (pass --allow-mixed-builds to run anyway, and qualify the setup)")
        warnings.append(f"RPC server {s.endpoint} {what}, this client {client_build} (--allow-mixed-builds): "
                        f"bands are exact only if every build is; `dflash qualify` this setup")
    return warnings
