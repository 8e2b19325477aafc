"""sha_cache.file_sha256: the model hash is remembered, but never for bytes the file no longer holds."""
import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from dflash.core import sha_cache
from dflash.core.errors import DflashError
from dflash.native import build


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return build.cache_root() / "sha256-cache.json"


@pytest.fixture
def model(tmp_path) -> Path:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"A" * 4096)
    return p


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def count_hashing(monkeypatch) -> list:
    calls = []
    real = sha_cache.sha256_file

    def counting(path, *args):
        calls.append(path)
        return real(path, *args)
    monkeypatch.setattr(sha_cache, "sha256_file", counting)
    return calls


def test_cache_follows_cache_root_and_is_reused(model, cache, tmp_path, monkeypatch):
    calls = count_hashing(monkeypatch)
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    assert cache.is_file() and cache.parent == tmp_path / "cache" / "dflash"
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    assert len(calls) == 1  # the second answer came from the cache
    assert [p.name for p in cache.parent.iterdir()] == ["sha256-cache.json"]  # no temp file left


def test_same_size_edit_with_mtime_restored_is_rehashed(model):
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    st = model.stat()
    with open(model, "r+b") as f:  # same inode, same size, other bytes
        f.write(b"B" * 4096)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model.stat().st_mtime_ns == st.st_mtime_ns and model.stat().st_size == st.st_size
    assert sha_cache.file_sha256(str(model)) == sha(b"B" * 4096)


def test_replaced_file_with_same_size_and_mtime_is_rehashed(model, tmp_path):
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    st = model.stat()
    other = tmp_path / "other"
    other.write_bytes(b"C" * 4096)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, model)
    assert sha_cache.file_sha256(str(model)) == sha(b"C" * 4096)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b"null", b'"text"',
                                     b"[" * 100000, b'{"x": 1, "y": [], "z": {"sha256": 5}}'])
def test_corrupt_cache_is_ignored_and_replaced(model, cache, content, monkeypatch):
    cache.parent.mkdir(parents=True)
    cache.write_bytes(content)
    calls = count_hashing(monkeypatch)
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    assert len(calls) == 1  # the corrupt cache was replaced by a working one


def test_poisoned_entry_is_not_trusted(model, cache):
    sha_cache.file_sha256(str(model))
    entries = json.loads(cache.read_bytes())
    entries[os.path.realpath(model)]["sha256"] = "not a hash"
    cache.write_text(json.dumps(entries))
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)


def test_cache_that_is_a_directory_or_fifo_is_no_error(model, cache):
    cache.mkdir(parents=True)
    assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    cache.rmdir()
    os.mkfifo(cache)

    def blocked(*_):
        pytest.fail("blocked on the FIFO")
    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(10)
    try:
        assert sha_cache.file_sha256(str(model)) == sha(b"A" * 4096)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_failed_cache_write_leaves_no_temp_file_and_the_old_cache(model, cache, tmp_path, monkeypatch):
    sha_cache.file_sha256(str(model))
    before = cache.read_bytes()
    second = tmp_path / "second.gguf"
    second.write_bytes(b"D")

    def fail(*_):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)
    assert sha_cache.file_sha256(str(second)) == sha(b"D")
    assert cache.read_bytes() == before
    assert [p.name for p in cache.parent.iterdir()] == ["sha256-cache.json"]


def test_file_changed_while_hashing_is_an_error(model, monkeypatch):
    real = sha_cache.sha256_file

    def hash_then_edit(path, *args):
        h = real(path, *args)
        Path(path).write_bytes(b"E" * 4096)
        return h
    monkeypatch.setattr(sha_cache, "sha256_file", hash_then_edit)
    with pytest.raises(DflashError, match="changed while"):
        sha_cache.file_sha256(str(model))
