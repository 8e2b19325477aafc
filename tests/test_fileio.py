"""dflash.core.fileio: the one atomic writer (write, fsync the file, rename, fsync the folder) and the one file hash."""
import errno
import hashlib
import os
import stat
from pathlib import Path

import pytest

from dflash.core import fileio


def test_write_atomic_makes_the_parent_folders_and_the_file(tmp_path):
    target = tmp_path / "a" / "b" / "out.bin"
    assert fileio.write_atomic(target, b"hello\0world") == target
    assert target.read_bytes() == b"hello\0world"
    assert os.listdir(target.parent) == ["out.bin"]  # no temporary file left beside it


def test_write_atomic_replaces_an_existing_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_bytes(b"old and longer than the new bytes")
    fileio.write_atomic(str(target), b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["out.json"]


def test_write_text_atomic_is_utf8(tmp_path):
    target = fileio.write_text_atomic(tmp_path / "t.txt", "ümlaut ✓\n")
    assert target.read_bytes() == "ümlaut ✓\n".encode()


def test_order_is_write_fsync_file_replace_fsync_folder(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "out.bin"
    data = os.urandom(10_000)
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            # the folder holding the target, and the target already holds the new bytes
            events.append(("fsync-dir", st.st_ino == target.parent.stat().st_ino, target.read_bytes() == data))
        else:
            # the bytes were written (and flushed) before the file is fsynced; the target is not there yet
            events.append(("fsync-file", st.st_size == len(data), target.exists()))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src).parent == target.parent and Path(src).name.startswith("."),
                       Path(dst) == target))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fileio.write_atomic(target, data)
    assert events == [("fsync-file", True, False), ("replace", True, True), ("fsync-dir", True, True)]
    assert target.read_bytes() == data


@pytest.mark.parametrize("where", ["fsync", "replace"])
@pytest.mark.parametrize("exc", [OSError(errno.EIO, "Input/output error"), KeyboardInterrupt()])
def test_a_failure_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch, where, exc):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def fail(*_):
        raise exc
    monkeypatch.setattr(os, where, fail)
    with pytest.raises(type(exc)):
        fileio.write_atomic(target, b"new bytes")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_failure_without_an_old_file_leaves_nothing(tmp_path, monkeypatch):
    def fail(*_):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        fileio.write_atomic(tmp_path / "out.bin", b"x" * 100)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_folder_fsync_ignores_only_einval(tmp_path, monkeypatch):
    real = os.fsync

    def fsync_with(err):
        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(err, os.strerror(err))
            real(fd)
        return fsync

    monkeypatch.setattr(os, "fsync", fsync_with(errno.EINVAL))  # a filesystem that cannot: let be
    fileio.write_atomic(tmp_path / "a", b"1")
    fileio.fsync_dir(tmp_path)
    monkeypatch.setattr(os, "fsync", fsync_with(errno.EIO))  # a real error: raised
    with pytest.raises(OSError) as e:
        fileio.write_atomic(tmp_path / "b", b"2")
    assert e.value.errno == errno.EIO
    with pytest.raises(OSError):
        fileio.fsync_dir(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "a").read_bytes() == b"1"
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # b was renamed into place before the folder fsync


def test_written_file_has_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        p = fileio.write_atomic(tmp_path / "m.json", b"{}")
        q = fileio.temp_path(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert stat.S_IMODE(q.stat().st_mode) == 0o644 and q.name.startswith(".") and q.stat().st_size == 0


def test_a_long_name_still_fits_its_temporary_name(tmp_path):
    target = tmp_path / ("n" * 250)
    fileio.write_atomic(target, b"ok")
    assert target.read_bytes() == b"ok"


def test_temp_path_is_a_new_file_each_time(tmp_path):
    a, b = fileio.temp_path(tmp_path, ".x-", ".gguf"), fileio.temp_path(tmp_path, ".x-", ".gguf")
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith(".x-") and a.name.endswith(".gguf")


@pytest.mark.parametrize("chunk", [1 << 20, 4096, 1000])
def test_sha256_file_matches_hashlib_over_many_chunks(tmp_path, chunk):
    p = tmp_path / "big"
    data = os.urandom((3 << 20) + 12345)  # several chunks and a partial last one
    p.write_bytes(data)
    assert fileio.sha256_file(p, chunk) == hashlib.sha256(data).hexdigest()
    assert fileio.sha256_file(str(p)) == hashlib.sha256(data).hexdigest()


def test_sha256_file_of_an_empty_file(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert fileio.sha256_file(p) == hashlib.sha256(b"").hexdigest()
