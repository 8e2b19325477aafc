"""Evidence directories: the sealed record of a run, written atomically and verified byte for byte.

A directory holds data files (at most one level of subfolders) and `manifest.json`:

    {"schema": "dflash.evidence", "schema_version": 1, "kind": "bench", "created_utc": "...Z",
     "files": {"requests.json": {"sha256": "<hex>", "bytes": 1234}, ...},
     "hash_checks": [{"file": "requests.json", "pointer": "requests",
                      "field": "response_sha256", "expect": "identical"}],
     "self_sha256": "<hex>"}

`self_sha256` is the SHA-256 of the canonical JSON (sorted keys, no spaces) of the manifest
without that key. The file itself is `render_manifest()` of that object, byte for byte, so the
reader can insist on exactly what the writer wrote. "The manifest SHA-256" shown to people is
the SHA-256 of manifest.json's bytes.

One writer (EvidenceWriter) and one reader (read_manifest); verify() builds on the reader.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from dflash.core import stage
from dflash.core.errors import DflashError, UsageError
from dflash.core.fileio import fsync_dir, write_atomic

SCHEMA = "dflash.evidence"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
EXPECTS = ("identical",)
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_KEYS = {"schema", "schema_version", "kind", "created_utc", "files", "hash_checks", "self_sha256"}
_CHECK_KEYS = {"file", "pointer", "field", "expect"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_JSON_BYTES = 8 << 20  # the most verify reads of manifest.json or of a file it runs hash checks on
# no symlink is followed, and a FIFO or device swapped in after the lstat check cannot block the open
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_TMP = re.compile(r"\.tmp-.+-([0-9]{1,10})-[0-9a-f]{8}")  # EvidenceWriter's temp dirs: .tmp-<name>-<pid>-<hex>


class EvidenceError(DflashError, ValueError):
    """An evidence directory or manifest is missing, malformed or does not match its content."""


def canonical_sha256(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def render_manifest(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def _rel_problem(rel: object) -> str | None:
    if not isinstance(rel, str) or not rel:
        return "must be a non-empty string"
    if ("\\" in rel or "\x00" in rel or rel.startswith("/") or posixpath.normpath(rel) != rel
            or any(p in ("", ".", "..") for p in rel.split("/"))):
        return "must be relative and normalized, without '..'"
    if rel.count("/") > 1:
        return "is nested too deep (one subfolder at most)"
    return "is reserved for the manifest" if rel == MANIFEST else None


def check_rel(rel: str) -> str:
    """A data file's path inside the directory: relative, normalized, at most one subfolder."""
    problem = _rel_problem(rel)
    if problem:
        raise ValueError(f"evidence path {rel!r} {problem}")
    return rel


def _load_json(raw: bytes) -> Any:  # a JSON value
    """Strict JSON: UTF-8, no NaN or Infinity; ValueError otherwise."""
    def no_constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({e})") from None


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise EvidenceError(msg)


def _is_kind(kind: object) -> bool:
    return isinstance(kind, str) and _KIND.fullmatch(kind) is not None


def _is_time(text: object) -> bool:
    try:
        return isinstance(text, str) and datetime.strptime(text, TIME_FORMAT) is not None
    except ValueError:
        return False


def _parse_manifest(raw: bytes) -> dict[str, Any]:
    """Strict reader; raises EvidenceError saying what is wrong (the caller says where)."""
    try:
        m = _load_json(raw)
    except ValueError as e:
        raise EvidenceError(str(e)) from None
    _need(isinstance(m, dict), "not a JSON object")
    _need(m.get("schema") == SCHEMA, f"schema is {m.get('schema')!r}, expected {SCHEMA!r}")
    v = m.get("schema_version")
    _need(type(v) is int and v == SCHEMA_VERSION, f"schema_version is {v!r}, this dflash reads {SCHEMA_VERSION}")
    _need(set(m) == _KEYS, f"keys missing {sorted(_KEYS - set(m))} or unknown {sorted(set(m) - _KEYS)}")
    _need(_is_kind(m["kind"]), f"kind {m['kind']!r} is not a plain name")
    _need(_is_time(m["created_utc"]), f"created_utc {m['created_utc']!r} is not {TIME_FORMAT}")
    _need(isinstance(m["files"], dict), "files is not an object")
    for rel, entry in m["files"].items():
        _need(_rel_problem(rel) is None, f"files: path {rel!r} {_rel_problem(rel)}")
        _need(isinstance(entry, dict) and set(entry) == {"sha256", "bytes"} and isinstance(entry["sha256"], str)
              and _HEX64.fullmatch(entry["sha256"]) is not None and type(entry["bytes"]) is int and entry["bytes"] >= 0,
              f"files[{rel!r}] is not {{\"sha256\": <64 lowercase hex>, \"bytes\": <int >= 0>}}")
    _need(isinstance(m["hash_checks"], list), "hash_checks is not a list")
    for i, c in enumerate(m["hash_checks"]):
        _need(isinstance(c, dict) and set(c) == _CHECK_KEYS and all(isinstance(x, str) for x in c.values()),
              f"hash_checks[{i}] must have exactly the string keys {sorted(_CHECK_KEYS)}")
        _need(c["file"] in m["files"] and c["field"] != "" and c["expect"] in EXPECTS,
              f"hash_checks[{i}] names an unlisted file, an empty field or an unknown expect")
    body = {k: x for k, x in m.items() if k != "self_sha256"}
    _need(m["self_sha256"] == canonical_sha256(body),
          "self_sha256 does not match the manifest's content (edited after sealing)")
    _need(raw == render_manifest(m), "bytes differ from the canonical rendering (edited after sealing)")
    return m


def _what(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _open_at(dir_fd: int, name: str, directory: bool = False) -> int:
    """Open `name` in the directory dir_fd only if it is a real regular file (or directory), not a
    symlink, FIFO, device or socket; the check is lstat before the open and the same inode after."""
    want, noun = (stat.S_ISDIR, "directory") if directory else (stat.S_ISREG, "regular file")
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not want(st.st_mode):
            raise EvidenceError(f"not a {noun} ({_what(st.st_mode)})")
        fd = os.open(name, _OPEN | (os.O_DIRECTORY if directory else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise EvidenceError("not found") from None
    except OSError as e:
        raise EvidenceError(f"cannot open ({e.strerror})") from None
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise EvidenceError("replaced while being verified")
    return fd


def _open_file(dir_fd: int, rel: str) -> int:
    """_open_at for a checked relative path (at most one subfolder, itself a real directory)."""
    if "/" not in rel:
        return _open_at(dir_fd, rel)
    sub, name = rel.split("/")
    try:
        sub_fd = _open_at(dir_fd, sub, directory=True)
    except EvidenceError as e:
        raise EvidenceError(f"folder {sub}: {e}") from None
    try:
        return _open_at(sub_fd, name)
    finally:
        os.close(sub_fd)


def _read_json_bytes(dir_fd: int, rel: str) -> bytes:
    """The bytes of a JSON file verify reads, at most MAX_JSON_BYTES; EvidenceError otherwise."""
    with open(_open_file(dir_fd, rel), "rb") as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise EvidenceError(f"larger than {MAX_JSON_BYTES >> 20} MiB")
    return raw


def _open_dir(directory: Path) -> int:
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise EvidenceError(f"{directory}: cannot open ({e.strerror})") from None


def resolve_dir(directory: str | os.PathLike[str]) -> Path:
    """An evidence directory argument with its symlinks resolved; UsageError if it is missing or
    not a directory."""
    try:
        d = Path(directory).resolve(strict=True)
    except FileNotFoundError:
        raise UsageError(f"{directory}: not found") from None
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop before Python 3.13
        raise UsageError(f"{directory}: cannot resolve ({getattr(e, 'strerror', None) or e})") from None
    if not d.is_dir():
        raise UsageError(f"{directory}: not a directory")
    return d


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of an evidence directory, checked; EvidenceError names the path otherwise."""
    path = Path(directory) / MANIFEST
    try:
        dir_fd = _open_dir(Path(directory))
        try:
            return _parse_manifest(_read_json_bytes(dir_fd, MANIFEST))
        finally:
            os.close(dir_fd)
    except EvidenceError as e:
        raise EvidenceError(f"{path}: {e}") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: alive, another user's; anything else: do not guess
        return True
    return True


def clean_stale_temp(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove EvidenceWriter temp dirs in `parent` whose owner process is gone (killed before it
    could clean up); returns those removed. A live owner's dir, or a name that does not parse, stays."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(Path(parent)))
    except OSError:
        return removed
    for entry in entries:
        m = _TMP.fullmatch(entry.name)
        if m and entry.is_dir(follow_symlinks=False) and int(m[1]) > 0 and not _pid_alive(int(m[1])):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(Path(entry.path))
    return removed


class EvidenceWriter:
    """Write files into a hidden sibling temp dir; commit() seals them and renames it into place.

    Leaving the `with` block without commit() (any exception, Ctrl-C, SystemExit) removes the
    temp dir, so an evidence directory either exists complete or not at all. A process killed
    outright leaves its temp dir behind; the next writer in the same folder removes it (its name
    holds the owner's pid: .tmp-<name>-<pid>-<hex>).
    """

    def __init__(self, final_dir: str | os.PathLike[str], kind: str) -> None:
        if not _is_kind(kind):
            raise ValueError(f"evidence kind {kind!r} is not a plain name")
        self.final_dir = Path(final_dir).absolute()
        self.kind = kind
        if os.path.lexists(self.final_dir):
            raise EvidenceError(f"evidence directory already exists: {self.final_dir}")
        # the owner's pid in the name lets a later writer remove it if this process is killed
        self.tmp_dir = self.final_dir.parent / f".tmp-{self.final_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.final_dir.parent.mkdir(parents=True, exist_ok=True)
            clean_stale_temp(self.final_dir.parent)
            self.tmp_dir.mkdir()
            stage.owns_scratch(self.tmp_dir)  # removed by the supervisor if this worker crashes
        except OSError as e:
            raise EvidenceError(f"cannot create evidence directory {self.final_dir}: {e.strerror}") from None
        self._files: dict[str, dict[str, Any]] = {}
        self._checks: list[dict[str, str]] = []
        self._state = "open"  # -> "committed" | "aborted"

    def __enter__(self) -> EvidenceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state == "open":
            self.abort()

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"evidence writer for {self.final_dir} is already {self._state}")

    def write_bytes(self, rel: str, data: bytes) -> Path:
        self._require_open()
        check_rel(rel)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"evidence file {rel!r}: data is {type(data).__name__}, not bytes")
        top = rel.split("/")[0]
        if rel in self._files or top in self._files or any(f.startswith(rel + "/") for f in self._files):
            raise ValueError(f"evidence path {rel!r} was already written or clashes with one that was")
        path = self.tmp_dir / rel
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, data)  # on failure nothing is left at `path` or beside it
        self._files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        return path

    def write_text(self, rel: str, text: str) -> Path:
        return self.write_bytes(rel, text.encode("utf-8"))

    def write_json(self, rel: str, obj: object) -> Path:
        return self.write_text(rel, json.dumps(obj, indent=2, allow_nan=False) + "\n")

    def add_hash_check(self, file: str, pointer: str, field: str, expect: str = "identical") -> None:
        """At verify time, every item of the list at `pointer` in `file` must carry the same `field`."""
        self._require_open()
        check_rel(file)
        if not isinstance(pointer, str) or not isinstance(field, str) or not field:
            raise ValueError("hash check pointer must be a string and field a non-empty string")
        if expect not in EXPECTS:
            raise ValueError(f"hash check expect {expect!r} is not one of {EXPECTS}")
        self._checks.append({"file": file, "pointer": pointer, "field": field, "expect": expect})

    def commit(self) -> tuple[Path, str]:
        """Write manifest.json last, fsync, rename into place; returns (final_dir, manifest sha256)."""
        try:
            return self._commit()
        except OSError as e:
            self.abort()
            raise EvidenceError(f"cannot write evidence directory {self.final_dir}: {e.strerror}") from None

    def _commit(self) -> tuple[Path, str]:
        self._require_open()
        for c in self._checks:
            if c["file"] not in self._files:
                raise ValueError(f"hash check names {c['file']!r}, which was not written")
        body = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": self.kind,
                "created_utc": datetime.now(timezone.utc).strftime(TIME_FORMAT),
                "files": dict(sorted(self._files.items())), "hash_checks": list(self._checks)}
        raw = render_manifest({**body, "self_sha256": canonical_sha256(body)})
        write_atomic(self.tmp_dir / MANIFEST, raw)
        for sub in {rel.split("/")[0] for rel in self._files if "/" in rel}:
            fsync_dir(self.tmp_dir / sub)
        fsync_dir(self.tmp_dir)
        if os.path.lexists(self.final_dir):  # os.rename would replace an empty directory
            raise EvidenceError(f"evidence directory appeared while writing: {self.final_dir}")
        os.rename(self.tmp_dir, self.final_dir)
        stage.owns_scratch(None)
        self._state = "committed"
        fsync_dir(self.final_dir.parent)
        return self.final_dir, hashlib.sha256(raw).hexdigest()

    def abort(self) -> None:
        """Remove the temp dir; nothing is left behind. A no-op after commit() or a first abort()."""
        if self._state == "open":
            self._state = "aborted"
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            stage.owns_scratch(None)


@dataclass
class VerifyReport:
    """Every check verify ran, in order, each with its problems (none: it passed)."""
    directory: Path
    manifest_sha256: str | None = None
    n_files: int = 0
    n_hash_checks: int = 0
    results: list[tuple[str, list[str]]] = field(default_factory=list)

    def record(self, check: str, problems: list[str] | tuple[str, ...] = ()) -> None:
        self.results.append((check, list(problems)))

    @property
    def problems(self) -> list[str]:
        return [p for _, problems in self.results for p in problems]

    @property
    def checks(self) -> list[str]:
        """The checks that passed."""
        return [check for check, problems in self.results if not problems]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": self.problems, "manifest_sha256": self.manifest_sha256,
                "n_files": self.n_files, "n_hash_checks": self.n_hash_checks,
                "checks": [{"check": check, "ok": not problems, "problems": problems}
                           for check, problems in self.results]}


def _follow(doc: object, pointer: str) -> object:
    node = doc
    for key in pointer.split(".") if pointer else []:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise KeyError(key)
    return node


def _hash_check(dir_fd: int, c: dict[str, str]) -> str | None:
    """One problem line, or None when every item carries the same non-empty value."""
    where = f"{c['file']}: {c['pointer'] or '<root>'}"
    try:
        doc = _load_json(_read_json_bytes(dir_fd, c["file"]))
    except ValueError as e:  # EvidenceError is a ValueError too
        return f"{c['file']}: cannot load for its hash check ({e})"
    try:
        items = _follow(doc, c["pointer"])
    except KeyError as e:
        return f"{where}: no key {e.args[0]!r} on the path"
    if not isinstance(items, list):
        return f"{where}: is {type(items).__name__}, expected a list"
    if not items:
        return f"{where}: is an empty list, nothing to compare"
    values = []
    for i, item in enumerate(items):
        v = item.get(c["field"]) if isinstance(item, dict) else None
        if v in (None, "", [], {}):
            return f"{where}[{i}]: has no {c['field']}"
        values.append(v)
        if v != values[0]:
            return f"{where}[{i}]: {c['field']} {v!r} differs from [0] {values[0]!r}"
    return None


def _file_problem(dir_fd: int, rel: str, entry: dict[str, Any]) -> str | None:
    """Size first (from fstat), then the SHA-256 of at most entry['bytes'] + 1 bytes, in chunks."""
    try:
        fd = _open_file(dir_fd, rel)
    except EvidenceError as e:
        return f"{rel}: {e}"
    h, n = hashlib.sha256(), 0
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            return f"{rel}: {size} bytes, the manifest says {entry['bytes']}"
        try:
            while n <= size and (block := f.read(min(1 << 20, size + 1 - n))):
                h.update(block)
                n += len(block)
        except OSError as e:
            return f"{rel}: cannot read ({e.strerror})"
    if n != size:
        return f"{rel}: changed size while being verified"
    return f"{rel}: SHA-256 differs from the manifest" if h.hexdigest() != entry["sha256"] else None


def _unlisted(dir_fd: int, files: dict[str, Any]) -> list[str]:
    """Every file or folder that the manifest does not account for (listed folders are searched)."""
    subdirs = {rel.split("/")[0] for rel in files if "/" in rel}
    problems = []

    def scan(fd: int, prefix: str) -> None:
        for name in sorted(os.listdir(fd)):
            rel = prefix + name
            if rel in subdirs:
                try:
                    sub_fd = _open_at(fd, name, directory=True)
                except EvidenceError:
                    continue  # a listed folder that is not a real directory: its files' checks say so
                try:
                    scan(sub_fd, rel + "/")
                finally:
                    os.close(sub_fd)
            elif rel != MANIFEST and rel not in files:
                problems.append(f"{rel if rel.isprintable() else repr(rel)}: not listed in the manifest")

    try:
        scan(dir_fd, "")
    except OSError as e:
        problems.append(f"cannot list the directory ({e.strerror})")
    return problems


def verify(directory: str | os.PathLike[str], expected_manifest_sha256: str | None = None) -> VerifyReport:
    """Check an evidence directory byte for byte; report.problems[0] is the first thing wrong.

    Only real regular files inside the directory are read (symlinks, FIFOs, devices and sockets
    are problems), JSON at most MAX_JSON_BYTES, data files in chunks: a hostile directory fails
    quickly instead of hanging or filling memory."""
    r = VerifyReport(directory=Path(directory))
    try:
        r.directory = resolve_dir(directory)
        dir_fd = _open_dir(r.directory)
    except DflashError as e:
        r.record("the evidence directory can be opened", [str(e)])
        return r
    try:
        _verify(dir_fd, r, expected_manifest_sha256)
    finally:
        os.close(dir_fd)
    return r


def _verify(dir_fd: int, r: VerifyReport, expected: str | None) -> None:
    check = f"{MANIFEST}: schema {SCHEMA} v{SCHEMA_VERSION}, self_sha256 matches"
    try:
        raw = _read_json_bytes(dir_fd, MANIFEST)
        r.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        m = _parse_manifest(raw)
    except EvidenceError as e:
        r.record(check, [f"{MANIFEST}: {e}"])
        return
    r.record(f"{check}, kind {m['kind']}")
    if expected is not None:
        ok = r.manifest_sha256 == expected.strip().lower()
        r.record(f"{MANIFEST}: SHA-256 is the expected one",
                 [] if ok else [f"{MANIFEST}: SHA-256 {r.manifest_sha256} is not the expected {expected}"])
    r.n_files, r.n_hash_checks = len(m["files"]), len(m["hash_checks"])
    r.record(f"{r.n_files} files: size and SHA-256",
             [p for rel, entry in m["files"].items() if (p := _file_problem(dir_fd, rel, entry))])
    r.record("no unlisted files", _unlisted(dir_fd, m["files"]))
    for c in m["hash_checks"]:
        problem = _hash_check(dir_fd, c)
        r.record(f"{c['file']}: every {c['pointer'] or '<root>'} item has the same {c['field']}",
                 [problem] if problem else [])


def default_dir(root: str | os.PathLike[str], kind: str) -> Path:
    """root/<kind>-<UTC YYYYmmdd-HHMMSS>-<4 hex>: a fresh name for EvidenceWriter."""
    if not _is_kind(kind):
        raise ValueError(f"evidence kind {kind!r} is not a plain name")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(root) / f"{kind}-{stamp}-{secrets.token_hex(2)}"
