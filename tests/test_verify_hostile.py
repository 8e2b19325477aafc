"""`dflash verify` on hostile directories: FIFOs, devices, sockets, symlinks, huge files. Each one
fails (exit 1) within seconds with one line naming the file; a bad DIR argument is a usage error."""
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.core.settings import ENV_DEBUG, ENV_FLAGS
from dflash.proof import evidence as ev

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "evidence" / "example-bench-tiny"
SWEEP = ROOT / "evidence" / "example-sweep-tiny-q4_k_m"  # has subfolders (exact/, stock/)
ENV = {k: v for k, v in os.environ.items() if k not in (*ENV_FLAGS, ENV_DEBUG)}


def verify(*args) -> subprocess.CompletedProcess:
    """`python -m dflash verify ARGS` that must end within 5 s (subprocess.TimeoutExpired otherwise)."""
    return subprocess.run([sys.executable, "-m", "dflash", "verify", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=ENV, timeout=5, stdin=subprocess.DEVNULL)


def assert_fails_naming(r: subprocess.CompletedProcess, name: str, needle: str = "") -> None:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("dflash: error:") and name in r.stderr and needle in r.stderr, r.stderr


@pytest.fixture(autouse=True)
def no_hang():
    """The in-process checks fail instead of hanging the test run."""
    def too_slow(*_):
        pytest.fail("blocked for 10 s")  # not an OSError, which verify might catch
    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def good(tmp_path) -> Path:
    d = tmp_path / "ev"
    shutil.copytree(EXAMPLE, d)
    return d


def replace_with_fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def test_the_copy_verifies(good):
    r = verify(good)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("rel", ["manifest.json", "requests.json", "machine.json"])
def test_fifo_does_not_hang(good, rel):
    replace_with_fifo(good / rel)
    assert_fails_naming(verify(good), rel, "FIFO")
    r = verify(good, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False


def test_unlisted_fifo_is_named(good):
    os.mkfifo(good / "extra")
    assert_fails_naming(verify(good), "extra", "not listed")


def test_manifest_symlink_to_dev_zero(good):
    (good / "manifest.json").unlink()
    (good / "manifest.json").symlink_to("/dev/zero")
    assert_fails_naming(verify(good), "manifest.json", "symlink")


def test_manifest_symlink_to_a_valid_manifest_outside(good, tmp_path):
    outside = tmp_path / "outside.json"
    shutil.copy(good / "manifest.json", outside)
    (good / "manifest.json").unlink()
    (good / "manifest.json").symlink_to(outside)
    assert_fails_naming(verify(good), "manifest.json", "symlink")


def test_data_file_symlink_outside(good, tmp_path):
    shutil.copy(good / "summary.json", tmp_path / "summary.json")
    (good / "summary.json").unlink()
    (good / "summary.json").symlink_to(tmp_path / "summary.json")
    assert_fails_naming(verify(good), "summary.json", "symlink")


def test_subfolder_symlink_outside(tmp_path):
    d = tmp_path / "sweep"
    shutil.copytree(SWEEP, d)
    shutil.move(d / "exact", tmp_path / "exact")
    (d / "exact").symlink_to(tmp_path / "exact", target_is_directory=True)
    assert_fails_naming(verify(d), "exact/", "symlink")


def test_huge_manifest_is_not_read_whole(good):
    with open(good / "manifest.json", "r+b") as f:
        f.truncate(64 << 20)  # sparse: cheap to make, 64 MiB to read
    assert_fails_naming(verify(good), "manifest.json", "larger than")


def test_huge_data_file_is_not_read(good):
    with open(good / "requests.json", "r+b") as f:
        f.truncate(1 << 40)  # sparse 1 TiB: the size is wrong, so nothing is hashed or parsed
    assert_fails_naming(verify(good), "requests.json", "bytes")


def test_device_node(good):
    (good / "manifest.json").unlink()
    try:
        os.mknod(good / "manifest.json", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except OSError:
        pytest.skip("cannot make a device node here")
    assert_fails_naming(verify(good), "manifest.json", "device")


def test_socket(good, monkeypatch):
    monkeypatch.chdir(good)  # a relative name keeps the socket path short
    (good / "requests.json").unlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind("requests.json")
        assert_fails_naming(verify(good), "requests.json", "socket")


def test_swap_to_fifo_between_check_and_open_cannot_hang(good, monkeypatch):
    """A file that passes the lstat check and then becomes a FIFO: the open must not block."""
    real_stat = os.stat

    def stat_then_swap(path, *args, dir_fd=None, follow_symlinks=True):
        st = real_stat(path, *args, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        if os.fspath(path) == "requests.json" and stat.S_ISREG(st.st_mode):
            os.unlink(path, dir_fd=dir_fd)
            os.mkfifo(path, dir_fd=dir_fd)
        return st

    monkeypatch.setattr(os, "stat", stat_then_swap)
    r = ev.verify(good)  # no_hang stops it if the open blocks
    assert not r.ok and r.problems[0].startswith("requests.json:"), r.problems


# --- DIR itself ------------------------------------------------------------------------------

def test_dir_through_a_symlink_verifies(good, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(good, target_is_directory=True)
    r = verify(link)
    assert r.returncode == 0, r.stderr
    r = verify(link, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True


@pytest.mark.parametrize("make", ["missing", "file", "fifo", "dangling", "dev"])
def test_bad_dir_is_a_usage_error(tmp_path, make):
    p = tmp_path / "arg"
    if make == "file":
        p.write_text("x")
    elif make == "fifo":
        os.mkfifo(p)
    elif make == "dangling":
        p.symlink_to(tmp_path / "nowhere")
    elif make == "dev":
        p = Path("/dev/zero")
    r = verify(p)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("dflash: usage error:") and r.stderr.count("\n") == 1 and str(p) in r.stderr


# --- truthful JSON ---------------------------------------------------------------------------

def test_json_lists_every_check_with_its_real_status(good):
    data = bytearray((good / "summary.json").read_bytes())
    data[0] ^= 0x01
    (good / "summary.json").write_bytes(bytes(data))
    (good / "extra.txt").write_text("x")
    r = verify(good, "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False
    by_name = {c["check"]: c for c in doc["checks"]}
    assert by_name["10 files: size and SHA-256"] == {
        "check": "10 files: size and SHA-256", "ok": False,
        "problems": ["summary.json: SHA-256 differs from the manifest"]}
    assert by_name["no unlisted files"]["ok"] is False
    assert [c["ok"] for c in doc["checks"]].count(True) == 3  # the manifest and both hash checks
    assert all(c["ok"] == (c["problems"] == []) for c in doc["checks"])
    assert doc["problems"] == [p for c in doc["checks"] for p in c["problems"]]


def test_json_on_a_good_directory(good):
    r = verify(good, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"] is True and doc["problems"] == []
    assert len(doc["checks"]) == 5 and all(c["ok"] and c["problems"] == [] for c in doc["checks"])


def test_report_is_not_ok_when_a_check_fails(good):
    replace_with_fifo(good / "requests.json")
    r = ev.verify(good)
    assert not r.ok
    assert "10 files: size and SHA-256" not in r.checks  # only passed checks are listed as passed
    assert any(not c["ok"] for c in r.to_json()["checks"])
