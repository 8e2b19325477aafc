"""Writing and hashing files: the one atomic writer and the one file hash of the package.

`write_atomic` replaces a file all at once and durably: the bytes go to a new temporary file in
the same folder (a dot-name, so no reader takes it for the real thing), are flushed and fsynced,
the temporary file is renamed over the target (os.replace), and the folder is fsynced so the
rename itself survives a crash. A reader sees the old file or the new one, never half of one,
and a failure at any step (Ctrl-C included) removes the temporary file and leaves the old file.

The temporary file is created exclusively with mode 0o666 less the umask, like any file `open()`
makes, not tempfile.mkstemp's 0600: the file lands at its name with the mode users expect.

A leaf module: the standard library only.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from pathlib import Path

StrPath = str | os.PathLike[str]

_NAME_KEEP = 100  # of the target's name in its temporary file's name (NAME_MAX is 255)


def _open_temp(directory: Path, prefix: str, suffix: str) -> tuple[int, Path]:
    """A new empty file in `directory`, created exclusively, open for writing: (fd, path)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    while True:
        tmp = directory / f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def temp_path(directory: StrPath, prefix: str = ".tmp-", suffix: str = ".tmp") -> Path:
    """A new empty file in `directory` (created exclusively, mode 0o666 less the umask), for a
    writer that fills a file by name (then `fsync_file` it and os.replace it into place)."""
    fd, tmp = _open_temp(Path(directory), prefix, suffix)
    os.close(fd)
    return tmp


def fsync_file(path: StrPath) -> None:
    """fsync a file by path: its bytes are on disk before a name points at them."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: StrPath) -> None:
    """fsync a folder, so a file created, renamed or removed in it stays so after a crash. A
    filesystem that cannot fsync a folder (EINVAL) is let be; any other error is raised."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def write_atomic(path: StrPath, data: bytes | bytearray | memoryview) -> Path:
    """Replace `path` with `data` all at once and durably (see the module doc); returns the path.
    The parent folder is made if it is missing. On any failure the temporary file is removed, the
    old file (if any) is unchanged, and the error is raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _open_temp(path.parent, f".{path.name[:_NAME_KEEP]}.", ".tmp")
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text_atomic(path: StrPath, text: str) -> Path:
    """`write_atomic` of `text` encoded as UTF-8."""
    return write_atomic(path, text.encode("utf-8"))


def sha256_file(path: StrPath, chunk: int = 1 << 20) -> str:
    """The SHA-256 (hex) of a file's bytes, read `chunk` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
