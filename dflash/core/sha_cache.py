"""The SHA-256 of model files, remembered in the user cache (<cache_root()>/sha256-cache.json) so
that repeated runs do not re-read tens of gigabytes; records and evidence name models by it."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from dflash.core import paths
from dflash.core.errors import DflashError
from dflash.core.fileio import sha256_file, write_atomic

_SHA_CACHE = "sha256-cache.json"  # {realpath: {"sha256": hex, **_file_identity(stat)}}


def _file_identity(st: os.stat_result) -> dict[str, int]:
    """What must be unchanged for a remembered hash to still be the file's: an edit changes ctime
    even when size and mtime are restored (utime cannot set ctime), a replacement changes the inode."""
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev}


def _read_sha_cache(store: Path) -> dict[str, dict[str, Any]]:
    """The cache's entries; a missing, unreadable or corrupt cache (or entry) is simply absent."""
    try:
        known = json.loads(store.read_bytes()) if store.is_file() else {}  # is_file: never open a FIFO
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {path: e for path, e in known.items() if isinstance(e, dict) and isinstance(e.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])}


def file_sha256(path: str) -> str:
    """SHA-256 of a (possibly very large) model file, remembered in the user cache so repeated runs
    do not re-read tens of gigabytes. The hash is reused only while the file's path, size, mtime,
    ctime, inode and device are all unchanged, and a file that changes while it is hashed is an error:
    evidence never names a hash of other bytes."""
    real = os.path.realpath(path)
    identity = _file_identity(os.stat(real))
    store = paths.cache_root() / _SHA_CACHE
    known = _read_sha_cache(store)
    entry = known.get(real)
    if entry is not None and entry == {**identity, "sha256": entry["sha256"]}:
        return entry["sha256"]
    sha = sha256_file(real)
    if _file_identity(os.stat(real)) != identity:
        raise DflashError(f"{path}: changed while it was being hashed")
    known[real] = {**identity, "sha256": sha}
    try:
        write_atomic(store, json.dumps(known, sort_keys=True).encode())
    except OSError:
        pass  # a read-only cache only costs the re-hash next time
    return sha
