"""Exact bands across machines through llama.cpp's RPC backend, on loopback only (127.0.0.1).

Every server and client runs with --threads 1 (two llama.cpp processes with 2 threads each on a
2-core machine slow down about 100x). The handshake and endpoint rules are tested against fake
servers in this process; everything else runs the real `dflash rpc-server` and real clients.
"""
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash.core.errors import UsageError
from dflash.native import devices, rpc

from .conftest import CLEAN_ENV, ROOT, run_dflash

LOOPBACK = "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# endpoints, bind addresses, device specs (pure)

@pytest.mark.parametrize("text,host,port", [("127.0.0.1:50052", "127.0.0.1", 50052), (" box-a:1 ", "box-a", 1),
                                            ("10.0.0.2:65535", "10.0.0.2", 65535)])
def test_endpoints_parse(text, host, port):
    assert rpc.parse_endpoint(text) == rpc.Endpoint(host, port)


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1:", ":50052", "127.0.0.1:0", "127.0.0.1:65536",
                                  "127.0.0.1:x", "[::1]:50052", "::1:50052", "a b:1"])
def test_bad_endpoints_are_usage_errors(text):
    with pytest.raises(UsageError):
        rpc.parse_endpoint(text)


def test_endpoint_lists():
    assert rpc.parse_endpoints(None) == ()
    assert [str(e) for e in rpc.parse_endpoints("127.0.0.1:1,127.0.0.1:2")] == ["127.0.0.1:1", "127.0.0.1:2"]
    with pytest.raises(UsageError, match="twice"):
        rpc.parse_endpoints("127.0.0.1:1,127.0.0.1:1")
    with pytest.raises(UsageError, match="at most 16"):
        rpc.parse_endpoints(",".join(f"127.0.0.1:{p}" for p in range(1, 18)))


def test_bind_addresses():
    assert rpc.bind_address("127.0.0.1", False) == ("127.0.0.1", None)
    assert rpc.bind_address("127.0.0.2", False) == ("127.0.0.2", None)  # all of 127/8 is loopback
    for host in ("0.0.0.0", "192.168.1.10"):
        with pytest.raises(UsageError, match="--allow-remote"):
            rpc.bind_address(host, False)
        addr, warning = rpc.bind_address(host, True)  # only parsed here: tests never bind it
        assert addr == host and warning and "no authentication" in warning
    for host in ("localhost", "::1", "0.0.0.0.0", ""):
        with pytest.raises(UsageError, match="IPv4"):
            rpc.bind_address(host, True)


@pytest.mark.parametrize("spec,entries,kind,rpc_ids,listed", [
    ("rpc:0", ("rpc:0",), "cpu", [0], True),
    ("CPU, rpc:1", ("cpu", "rpc:1"), "cpu", [1], True),
    ("rpc:0,rpc:1", ("rpc:0", "rpc:1"), "cpu", [0, 1], True),
    ("hip:0,rpc:0", ("hip:0", "rpc:0"), "hip", [0], True),
    ("cpu,hip:0", ("cpu", "hip:0"), "hip", [], True),
    ("hip:0,hip:1", ("hip:0", "hip:1"), "hip", [], False),
    ("cpu", ("cpu",), "cpu", [], False)])
def test_device_specs_with_rpc(spec, entries, kind, rpc_ids, listed):
    s = devices.parse_spec(spec)
    assert (s.entries, s.kind, s.rpc_ids, s.by_device_list) == (entries, kind, rpc_ids, listed)


@pytest.mark.parametrize("spec", ["rpc", "rpc:", "rpc:-1", "rpc:0,rpc:0", "hip:0,cuda:0", "cpu,cpu"])
def test_bad_rpc_device_specs(spec):
    with pytest.raises(UsageError):
        devices.parse_spec(spec)


def test_rpc_devices_and_servers_go_together():
    with pytest.raises(UsageError, match="needs rpc HOST:PORT"):
        rpc.connect(None, [0])
    with pytest.raises(UsageError, match="names none"):
        rpc.connect("127.0.0.1:1", [])
    assert rpc.connect(None, []) is None


def test_builds_must_match_unless_allowed():
    same = rpc.ServerInfo("127.0.0.1:1", "7.0.0", 1, "exact-aaaa", "exact", "cpu")
    other = rpc.ServerInfo("127.0.0.1:2", "7.0.0", 1, "stock-bbbb", "stock", "cpu")
    unknown = rpc.ServerInfo("127.0.0.1:3", "7.0.0", 1, None, None, None)
    assert rpc.check_builds((same,), "exact-aaaa", False) == []
    for s in (other, unknown):
        with pytest.raises(rpc.RpcError, match="--allow-mixed-builds"):
            rpc.check_builds((same, s), "exact-aaaa", False)
        (w,) = rpc.check_builds((same, s), "exact-aaaa", True)
        assert s.endpoint in w
    devs = rpc.remote_devices((same, rpc.ServerInfo("127.0.0.1:4", "7.0.0", 2, "x", "exact", "hip:0")))
    assert [(d.id, d.server.endpoint, d.server_device) for d in devs] == [
        ("rpc:0", "127.0.0.1:1", 0), ("rpc:1", "127.0.0.1:4", 0), ("rpc:2", "127.0.0.1:4", 1)]


# ---------------------------------------------------------------------------------------------
# the handshake against fake servers (this process, loopback)

class FakeServer:
    """A loopback TCP server that answers one connection at a time with `behave(conn)`."""

    def __init__(self, behave):
        self.sock = socket.socket()
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(4)
        self.endpoint = rpc.Endpoint(LOOPBACK, self.sock.getsockname()[1])
        self.behave = behave
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self.behave(conn)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def _read_request(conn):
    head = b""
    while len(head) < 9:
        chunk = conn.recv(9 - len(head))
        if not chunk:
            raise OSError("closed")
        head += chunk
    cmd, size = struct.unpack("<BQ", head)
    while size:
        size -= len(conn.recv(size))
    return cmd


def _answer(conn, payload: bytes):
    conn.sendall(struct.pack("<Q", len(payload)) + payload)


def serving(version=(7, 0, 0), devices_n=1, build: bytes | None = b'{"build":"exact-x","flavor":"exact",'
                                                                     b'"device":"cpu"}'):
    def behave(conn):
        while True:
            cmd = _read_request(conn)
            if cmd == rpc.CMD_HELLO:
                _answer(conn, bytes(version) + b"\0" + bytes(rpc.CONN_CAPS_SIZE))
            elif cmd == rpc.CMD_DEVICE_COUNT:
                _answer(conn, struct.pack("<I", devices_n))
            elif cmd == rpc.CMD_DFLASH_BUILD_ID and build is not None:
                _answer(conn, build.ljust(rpc.BUILD_ID_SIZE, b"\0"))
            else:
                return  # as an unpatched ggml server does with a command it does not know
    return behave


@pytest.fixture
def fake():
    servers = []

    def make(behave):
        servers.append(FakeServer(behave))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


def test_probe_reads_version_devices_and_build(fake):
    s = fake(serving(devices_n=2))
    info = rpc.probe(s.endpoint)
    assert (info.protocol, info.n_devices, info.build, info.flavor, info.device) == ("7.0.0", 2, "exact-x",
                                                                                     "exact", "cpu")


def test_an_unpatched_server_reports_no_build(fake):
    info = rpc.probe(fake(serving(build=None)).endpoint)
    assert info.build is None and info.n_devices == 1


def test_a_closed_port_is_not_listening():
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]  # nothing listens once it is closed
    with pytest.raises(rpc.RpcError, match="not listening"):
        rpc.probe(rpc.Endpoint(LOOPBACK, port))


def test_protocol_mismatches_are_named(fake):
    with pytest.raises(rpc.RpcError, match="speaks RPC protocol 6.1.0"):
        rpc.probe(fake(serving(version=(6, 1, 0))).endpoint)
    with pytest.raises(rpc.RpcError, match="closed the connection during the handshake"):
        rpc.probe(fake(lambda conn: None).endpoint)
    with pytest.raises(rpc.RpcError, match="expected 28"):
        rpc.probe(fake(lambda conn: (_read_request(conn), _answer(conn, b"\1\2\3"))).endpoint)


def test_a_server_that_never_answers_times_out(fake):
    s = fake(lambda conn: time.sleep(3))
    t0 = time.monotonic()
    with pytest.raises(rpc.RpcError, match="did not answer"):
        rpc.probe(s.endpoint, timeout=0.5)
    assert time.monotonic() - t0 < 2.5


def test_a_client_names_a_protocol_mismatch_in_one_line(fake):
    """End to end: `dflash prefill --rpc` against a server of another protocol version fails with one
    line, exit 1, before the model loads."""
    s = fake(serving(version=(6, 0, 0)))
    r = run_dflash("prefill", "--rpc", s.endpoint, "--device", "rpc:0", "--threads", "1")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"dflash: error: RPC server {s.endpoint} speaks RPC protocol 6.0.0, "
                                             f"this llama.cpp speaks 7.0.0: run the same llama.cpp version on "
                                             f"both sides"]


# ---------------------------------------------------------------------------------------------
# real servers (dflash rpc-server, loopback, one thread)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class Server:
    """A `dflash rpc-server` process on loopback (its own session: a test can kill it outright)."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None):
        self.port = _free_port()
        self.endpoint = f"{LOOPBACK}:{self.port}"
        self.log = tmp / f"rpc-server-{self.port}.log"
        env = {**{k: v for k, v in os.environ.items() if k not in CLEAN_ENV}, **(env or {})}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dflash", "rpc-server", "--host", LOOPBACK, "--port", str(self.port),
                 "--threads", "1", "--json", *args],
                stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT, start_new_session=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.kill()
            raise AssertionError(f"rpc-server did not start: {self.log.read_text(errors='replace')[-2000:]}")
        self.info = json.loads(line)

    def stop(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL the server and its worker at once: a crashed server."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two exact-library servers and one stock-library server, shared by the module."""
    tmp = tmp_path_factory.mktemp("rpc")
    made = {}
    try:
        made["a"] = Server(tmp)
        made["b"] = Server(tmp)
        made["stock"] = Server(tmp, "--lib", "stock")
        yield made
    finally:
        for s in made.values():
            s.kill()


def prefill(*args):
    r = run_dflash("prefill", "--threads", "1", "--n-predict", "8", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_servers_report_their_build(servers):
    a, stock = servers["a"].info, servers["stock"].info
    assert a["endpoint"] == servers["a"].endpoint and a["device"] == "cpu" and a["protocol"] == "7.0.0"
    assert a["build"].startswith("exact-") and stock["build"].startswith("stock-")
    assert a["build"] == Path(a["library"]["dir"]).parent.name  # the built library's cache folder
    info = rpc.probe(rpc.parse_endpoint(servers["a"].endpoint))
    assert (info.build, info.flavor, info.device) == (a["build"], "exact", "cpu")


def test_bands_over_rpc_equal_local_q1(servers):
    """The done-when of the RPC issue: all layers remote and a local + remote split, bands of 4, give
    the logits and response SHA-256 of a local q1 run (on plain CPU buffers, as a CPU served over
    RPC runs), and so does a split across two servers."""
    ref = prefill("--no-bands", "--no-repack")
    a, b = servers["a"].endpoint, servers["b"].endpoint
    runs = {"rpc:0": prefill("--rpc", a, "--device", "rpc:0", "--bands", "--chunk", "4"),
            "cpu,rpc:0": prefill("--rpc", a, "--device", "cpu,rpc:0", "--bands", "--chunk", "4"),
            "rpc:0,rpc:1": prefill("--rpc", f"{a},{b}", "--device", "rpc:0,rpc:1", "--bands", "--chunk", "4")}
    assert ref["repack"] is False and ref["widths"] == [1] * ref["n_prompt_tokens"]
    for device, r in runs.items():
        assert max(r["widths"]) == 4 and r["repack"] is False, device
        assert (r["logits_sha256"], r["response_sha256"]) == (ref["logits_sha256"], ref["response_sha256"]), device
        assert [d["id"] for d in r["devices"]] == device.split(",")
    remote = [d for d in runs["rpc:0,rpc:1"]["devices"]]
    assert [(d["endpoint"], d["build"]) for d in remote] == [(a, servers["a"].info["build"]),
                                                            (b, servers["b"].info["build"])]


def test_a_stock_server_is_refused_and_shown_to_differ(servers):
    """Negative control: a stock-library server is refused by an exact client; let in with
    --allow-mixed-builds, its bands differ from q1 and from the local reference."""
    st = servers["stock"].endpoint
    r = run_dflash("prefill", "--threads", "1", "--rpc", st, "--device", "rpc:0", "--bands", "--chunk", "4")
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert f"RPC server {st} runs library build stock-" in line and "--allow-mixed-builds" in line
    ref = prefill("--no-bands", "--no-repack")
    mixed = prefill("--rpc", st, "--device", "rpc:0", "--bands", "--chunk", "4", "--allow-mixed-builds")
    assert mixed["logits_sha256"] != ref["logits_sha256"]
    assert any("--allow-mixed-builds" in w for w in mixed["warnings"]) or mixed["devices"][0]["flavor"] == "stock"
    r = run_dflash("prefill", "--threads", "1", "--rpc", st, "--device", "rpc:0", "--bands", "--chunk", "4",
                   "--allow-mixed-builds", "--compare-q1")
    assert r.returncode == 4 and "differ from q1" in r.stderr


def test_matrix_adds_rpc_rows(servers):
    a, b = servers["a"].endpoint, servers["b"].endpoint
    r = run_dflash("matrix", "--rpc", f"{a},{b}", "--n-predict", "4", "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    rows = {row["device"]: row for row in m["rows"] if row["reference"] == "cpu t1 exact no-repack"}
    assert set(rows) == {"cpu", "rpc:0", "cpu,rpc:0", "rpc:0,rpc:1"}
    assert all(row["logits_equal_reference"] and row["response_equal_reference"] and row["q1_equals_bands"]
               for row in rows.values())
    assert m["exact_all_equal"]


def test_server_not_listening_fails_before_the_model_loads():
    port = _free_port()
    t0 = time.monotonic()
    r = run_dflash("prefill", "--threads", "1", "--rpc", f"{LOOPBACK}:{port}", "--device", "rpc:0")
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    assert r.stderr.strip().splitlines() == [f"dflash: error: RPC server {LOOPBACK}:{port} is not listening "
                                             f"(connection refused)"]


def test_rpc_server_refuses_a_non_loopback_bind_without_allow_remote():
    for host in ("0.0.0.0", "10.1.2.3"):
        r = run_dflash("rpc-server", "--host", host, "--threads", "1")
        assert r.returncode == 2
        (line,) = r.stderr.strip().splitlines()
        assert "--allow-remote" in line and "no authentication" in line


def test_rpc_server_stops_cleanly_on_sigint_and_sigterm(tmp_path):
    for sig in (signal.SIGINT, signal.SIGTERM):
        s = Server(tmp_path)
        assert s.stop(sig) == 0
        assert "stopped" in s.log.read_text()
        with pytest.raises(rpc.RpcError, match="not listening"):
            rpc.probe(rpc.parse_endpoint(s.endpoint))


def test_a_port_in_use_is_one_line(tmp_path, servers):
    port = servers["a"].port
    r = run_dflash("rpc-server", "--port", port, "--threads", "1")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == f"dflash: error: cannot listen on {LOOPBACK}:{port}: in use"


def test_a_server_dying_mid_request_ends_the_client_in_one_line(tmp_path):
    """Kill the server while a bench runs on it: the client ends with exit 1 within 30 s, one line
    naming the endpoint and the band, and no evidence directory (nor a temp one) is left."""
    s = Server(tmp_path)
    prompt = tmp_path / "long.txt"
    prompt.write_text(" ".join(f"The band planner keeps emission {i} at a band end." for i in range(200)))
    evidence = tmp_path / "ev" / "bench-run"
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    client = subprocess.Popen(
        [sys.executable, "-m", "dflash", "bench", "--threads", "1", "--rpc", s.endpoint, "--device", "rpc:0",
         "--chunk", "4", "--prompt-file", str(prompt), "--warmup", "0", "--runs", "50", "--evidence", str(evidence)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while s.log.read_text(errors="replace").count("Accepted client connection") < 3:  # model loaded, running
        assert client.poll() is None and time.monotonic() < deadline, client.communicate()
        time.sleep(0.2)
    time.sleep(1.0)
    s.kill()
    t0 = time.monotonic()
    out, err = client.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert client.returncode == 1 and out == ""
    (line,) = err.strip().splitlines()[-1:]
    assert f"RPC server {s.endpoint} lost" in line, err
    assert re.search(r"during (band at position \d+ \(width \d+\)|decode of response token)", line), line
    assert len([ln for ln in err.strip().splitlines() if ln.startswith("dflash:")]) == 1
    assert not evidence.exists()
    assert not evidence.parent.exists() or list(evidence.parent.iterdir()) == []  # no temp directory either


def test_rpc_server_serves_one_local_device():
    r = run_dflash("rpc-server", "--device", "cpu,rpc:0", "--threads", "1")
    assert r.returncode == 2 and "serves one local device" in r.stderr
    found, _ = devices.hip_devices()
    if not found:  # the missing-device path (exit 3) before any build or bind
        r = run_dflash("rpc-server", "--device", "hip:0", "--threads", "1")
        assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1 and "no HIP device" in r.stderr


def test_the_committed_rpc_bench_evidence_verifies():
    ev = ROOT / "evidence" / "example-bench-rpc-w64"
    r = run_dflash("verify", ev, "--manifest-sha256",
                   "6ef7d33a835deee667d4ced9a48f9631e7a58a4e393c25603fde50ce67909ad8")
    assert r.returncode == 0, r.stderr
    d = json.loads((ev / "devices.json").read_text())
    (remote,) = d["devices"]
    assert remote["id"] == "rpc:0" and remote["endpoint"] == d["rpc_servers"][0]["endpoint"]
    assert remote["build"] == Path(json.loads((ev / "library.json").read_text())["dir"]).parent.name
    assert json.loads((ev / "summary.json").read_text())["hashes_identical"] is True


def test_a_memory_budget_over_rpc(servers):
    """--memory-budget sizes the run with a no_alloc engine on the same servers before the real one
    loads: both register the servers in one process, and the run is still the reference."""
    ref = prefill("--no-bands", "--no-repack")
    r = prefill("--rpc", servers["a"].endpoint, "--device", "rpc:0", "--bands", "--chunk", "4",
                "--memory-budget", "1GiB")
    assert r["memory_budget"]["width"] == 4 and r["memory_budget"]["total_bytes"] > 0
    assert (r["logits_sha256"], r["response_sha256"]) == (ref["logits_sha256"], ref["response_sha256"])
