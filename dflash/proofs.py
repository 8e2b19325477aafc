"""Qualification records: which band widths one library, model and device are proven exact at.

`dflash qualify` writes one record per (library build key, model SHA-256, device) into the user
cache, <cache_root()>/qualifications/<key>.json, merged with what that file already held (a width
run again replaces its old verdict), and this run's verdicts into its evidence directory as
qualification.json. `--chunk auto` and `--chunk N` (N > 4) read it:

    {"schema": "dflash.qualification", "schema_version": 1, "key": "<24 hex>",
     "library": {"flavor": "exact", "source": "build", "key": "<build key>"},
     "model": {"sha256": "<64 hex>", "path": "/path/model.gguf"},
     "device": "cpu", "updated_utc": "2025-01-01T00:00:00Z",
     "widths": [{"width": 8, "planner_exact": true, "planner_widest_band": 4,
                 "fixed_exact": true, "fixed_widest_band": 8, "evidence_dir": "/path/ev"}, ...]}

library.source is "build" (key: dflash.build.build_key of the flavor) or "dir" (key: SHA-256
over the libllama*/libggml* files of DFLASH_LLAMA_LIB_DIR); for a GPU device the library key also
covers the routing flags DFLASH_NARROW_MMVQ and LUCE_MMVQ_MAX_NCOLS (they decide which kernels
run there; on the CPU they change nothing). `key` is derived from the flavor,
library key, model SHA-256 and device. Per width: the planner run at that cap and the fixed-width
run (bands of exactly that width across compressor boundaries) matched q1 or not, and the widest
band each really decoded (width 1: both are the q1 repeat).

A record proves width N in a mode (fixed or planner) when that mode's run is exact at N and at
every narrower width the record holds; fixed is preferred (it is what decodes N-wide bands on
DeepSeek V4). `auto` takes the widest width proven in either mode, 1 (q1) when none is.

One writer (`write`) and one reader (`read`); the reader is strict, and `load` turns a corrupt
record into no record with one warning line.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from . import build, devices, gguf_meta, paths, tiny_model
from .errors import DflashError, UsageError, arg
from .fileio import sha256_file, write_atomic
from .rpc import Remote
from .settings import AUTO, ENV_LIB_DIR, FIXED, LIBS, MAX_BAND, MAX_CHUNK, PLANNER, Chunk, Qualified, Settings

SCHEMA = "dflash.qualification"
SCHEMA_VERSION = 1
FILE_NAME = "qualification.json"  # its name in an evidence directory
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
SOURCES = ("build", "dir")
_KEYS = {"schema", "schema_version", "key", "library", "model", "device", "updated_utc", "widths"}
_WIDTH_KEYS = {"width", "planner_exact", "planner_widest_band", "fixed_exact", "fixed_widest_band",
               "evidence_dir"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{16,64}")
_DEVICE = re.compile(r"(cpu|hip:\d+|cuda:\d+|rpc:\d+)(,(cpu|hip:\d+|cuda:\d+|rpc:\d+))*")

Warn = Callable[[str], None]


class RecordError(ValueError):
    """A qualification record is unreadable, malformed or not the one asked for."""


@dataclass(frozen=True)
class Identity:
    """What a record is about: the library, the model and the device."""
    flavor: str
    library_source: str  # "build" or "dir"
    library_key: str
    model_sha256: str
    device: str          # "cpu", "hip:N" or "hip:N,hip:M"

    @property
    def key(self) -> str:
        text = "|".join((self.flavor, self.library_source, self.library_key, self.model_sha256, self.device))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Verdict:
    width: int
    planner_exact: bool
    planner_widest_band: int
    fixed_exact: bool
    fixed_widest_band: int
    evidence_dir: str | None = None


@dataclass(frozen=True)
class Record:
    identity: Identity
    model_path: str
    updated_utc: str
    widths: tuple[Verdict, ...]  # sorted by width, one per width


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime(TIME_FORMAT)


# ---------------------------------------------------------------------------------------------
# What a record proves (pure)

def proven_mode(verdicts: Iterable[Verdict], width: int) -> str | None:
    """FIXED or PLANNER when the record proves `width` in that mode (see the module doc)."""
    vs = list(verdicts)
    at = [v for v in vs if v.width == width]
    narrower = [v for v in vs if v.width < width]
    if at and at[0].fixed_exact and all(v.fixed_exact for v in narrower):
        return FIXED
    if at and at[0].planner_exact and all(v.planner_exact for v in narrower):
        return PLANNER
    return None


def widest_proven(verdicts: Iterable[Verdict], fits: Callable[[int], bool] | None = None) -> tuple[int, str]:
    """(width, mode) that `--chunk auto` runs: the widest proven width (that `fits`, with
    --memory-budget); (1, planner) = q1 if none."""
    vs = list(verdicts)
    for v in sorted(vs, key=lambda v: v.width, reverse=True):
        mode = proven_mode(vs, v.width)
        if mode and (fits is None or v.width == 1 or fits(v.width)):
            return v.width, mode
    return 1, PLANNER


def merge(old: Record | None, new: Record) -> Record:
    """`new`'s verdicts over `old`'s: a width qualified again replaces its old verdict."""
    if old is None or old.identity != new.identity:
        return new
    by = {v.width: v for v in old.widths} | {v.width: v for v in new.widths}
    return replace(new, widths=tuple(by[w] for w in sorted(by)))


# ---------------------------------------------------------------------------------------------
# The one writer and the one reader

def to_json(r: Record) -> dict[str, Any]:
    i = r.identity
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "key": i.key,
            "library": {"flavor": i.flavor, "source": i.library_source, "key": i.library_key},
            "model": {"sha256": i.model_sha256, "path": r.model_path},
            "device": i.device, "updated_utc": r.updated_utc,
            "widths": [asdict(v) for v in r.widths]}


def render(r: Record) -> bytes:
    return (json.dumps(to_json(r), indent=2, allow_nan=False) + "\n").encode()


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise RecordError(msg)


def _is_int(x: object, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def _is_time(text: object) -> bool:
    try:
        return isinstance(text, str) and datetime.strptime(text, TIME_FORMAT) is not None
    except ValueError:
        return False


def _verdict(i: int, d: Any) -> Verdict:  # d: a JSON value, checked here
    _need(isinstance(d, dict) and set(d) == _WIDTH_KEYS,
          f"widths[{i}] must have exactly the keys {sorted(_WIDTH_KEYS)}")
    w = d["width"]
    _need(_is_int(w, 1, MAX_CHUNK), f"widths[{i}].width {w!r} is not in 1..{MAX_CHUNK}")
    for mode in ("planner", "fixed"):
        _need(type(d[f"{mode}_exact"]) is bool, f"widths[{i}].{mode}_exact is not true or false")
        _need(_is_int(d[f"{mode}_widest_band"], 1, w), f"widths[{i}].{mode}_widest_band is not in 1..{w}")
    _need(d["evidence_dir"] is None or isinstance(d["evidence_dir"], str),
          f"widths[{i}].evidence_dir is not a string or null")
    return Verdict(**d)


def parse(raw: bytes) -> Record:
    """Strict reader; RecordError says what is wrong."""
    def no_constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")
    try:
        d = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RecordError(f"not valid JSON ({e})") from None
    _need(isinstance(d, dict), "not a JSON object")
    _need(d.get("schema") == SCHEMA, f"schema is {d.get('schema')!r}, expected {SCHEMA!r}")
    v = d.get("schema_version")
    _need(type(v) is int and v == SCHEMA_VERSION, f"schema_version is {v!r}, this dflash reads {SCHEMA_VERSION}")
    _need(set(d) == _KEYS, f"keys missing {sorted(_KEYS - set(d))} or unknown {sorted(set(d) - _KEYS)}")
    lib, model = d["library"], d["model"]
    _need(isinstance(lib, dict) and set(lib) == {"flavor", "source", "key"} and lib["flavor"] in LIBS
          and lib["source"] in SOURCES and isinstance(lib["key"], str) and _HEX.fullmatch(lib["key"]) is not None,
          "library is not {\"flavor\": exact|stock, \"source\": build|dir, \"key\": <hex>}")
    _need(isinstance(model, dict) and set(model) == {"sha256", "path"} and isinstance(model["sha256"], str)
          and _HEX64.fullmatch(model["sha256"]) is not None and isinstance(model["path"], str),
          "model is not {\"sha256\": <64 lowercase hex>, \"path\": <string>}")
    _need(isinstance(d["device"], str) and _DEVICE.fullmatch(d["device"]) is not None,
          f"device {d['device']!r} is not a --device (cpu, hip:N, cuda:N, rpc:N, joined by commas)")
    _need(_is_time(d["updated_utc"]), f"updated_utc {d['updated_utc']!r} is not {TIME_FORMAT}")
    _need(isinstance(d["widths"], list) and len(d["widths"]) > 0, "widths is not a non-empty list")
    widths = tuple(_verdict(i, x) for i, x in enumerate(d["widths"]))
    _need([v.width for v in widths] == sorted({v.width for v in widths}), "widths are not sorted and unique")
    ident = Identity(lib["flavor"], lib["source"], lib["key"], model["sha256"], d["device"])
    _need(d["key"] == ident.key, "key does not match the library, model and device it names")
    return Record(ident, model["path"], d["updated_utc"], widths)


def read(path: str | os.PathLike[str]) -> Record:
    """The record at `path`; RecordError (naming the path) when missing, unreadable or malformed."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise RecordError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return parse(raw)
    except RecordError as e:
        raise RecordError(f"{path}: {e}") from None


def write(path: str | os.PathLike[str], record: Record) -> Path:
    """Write atomically and durably (fileio.write_atomic)."""
    path = Path(path)
    try:
        return write_atomic(path, render(record))
    except OSError as e:
        raise DflashError(f"cannot write qualification record {path}: {e.strerror}") from None


def record_path(identity: Identity) -> Path:
    return paths.cache_root() / "qualifications" / f"{identity.key}.json"


def load(identity: Identity, warn: Warn) -> Record | None:
    """The stored record for `identity`; None when there is none, or (with one warning line) when
    it is corrupt or names another library, model or device."""
    path = record_path(identity)
    if not path.exists():
        return None
    try:
        r = read(path)
        if r.identity != identity:
            raise RecordError(f"{path}: names another library, model or device")
        return r
    except RecordError as e:
        warn(f"ignoring qualification record {e}")
        return None


def save(record: Record, warn: Warn) -> Record:
    """Merge `record` into the stored one for its identity; returns what is stored now."""
    merged = merge(load(record.identity, warn), record)
    write(record_path(record.identity), merged)
    return merged


# ---------------------------------------------------------------------------------------------
# Identities (hashing, no llama.cpp loaded)

def library_files(d: Path) -> list[Path]:
    """libllama*/libggml* shared libraries of a folder (as dflash.llama.library_files picks them)."""
    return sorted(p for p in d.iterdir() if p.name.startswith(("libllama", "libggml")) and ".so" in p.name
                  and p.is_file() and not p.is_symlink())


def dir_key(d: Path) -> str:
    """SHA-256 over the names and bytes of a library folder's libllama*/libggml* files."""
    if not (d / "libllama.so").is_file():
        raise UsageError(f"{ENV_LIB_DIR}={d} has no libllama.so")
    h = hashlib.sha256()
    for p in library_files(d):
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def device_name(device: str) -> str:
    """The canonical form of --device (e.g. cpu, hip:0,hip:1, cpu,rpc:0)."""
    return str(devices.parse_spec(device))


def library_key(settings: Settings, kind: str = "cpu") -> tuple[str, str]:
    """(source, key) of the library a run loads: "build" and dflash.build.build_key of the flavor
    (and GPU backend), or "dir" and dir_key of DFLASH_LLAMA_LIB_DIR. On a GPU the key also covers
    the routing flags (they decide which kernels run there)."""
    if settings.lib_dir:
        source, key = "dir", dir_key(Path(settings.lib_dir))
    else:  # a GPU run loads that backend's build of the flavor
        source, key = "build", build.build_key(settings.lib, "none" if kind == "cpu" else kind)
    if kind != "cpu":  # on a GPU the library's routing flags decide which kernels run: part of the key
        routing = f"{key}|narrow={int(settings.narrow)}|ncols={settings.mmvq_max_ncols}"
        key = hashlib.sha256(routing.encode()).hexdigest()[:16]
    if settings.indexer_shortcut != "on":  # another graph (off), or a planted bug (force): not vouched for
        key = hashlib.sha256(f"{key}|indexer_shortcut={settings.indexer_shortcut}".encode()).hexdigest()[:16]
    return source, key


def build_id(settings: Settings, kind: str = "cpu") -> str:
    """The library build a process runs, as `dflash rpc-server` reports it and an RPC client compares
    it: "exact-<build key>" (the folder name under ~/.cache/dflash/llama/ on the CPU), or
    "exact-dir-<16 hex>" for DFLASH_LLAMA_LIB_DIR."""
    source, key = library_key(settings, kind)
    return f"{settings.lib}-{key}" if source == "build" else f"{settings.lib}-dir-{key[:16]}"


def identity(settings: Settings, model_path: str | os.PathLike[str], device: str = "cpu",
             remote: Remote | None = None, repack: bool = True) -> Identity:
    """What a record is about. Plain CPU buffers (--no-repack, and every run with RPC devices) run
    other kernels than AMX and repacked ones, and what RPC servers run is part of the run: both
    enter the library key."""
    from .provenance import file_sha256  # records imports the engine; keep this module light
    source, key = library_key(settings, devices.device_kind(device))
    if remote is not None:
        key = hashlib.sha256(f"{key}|rpc={remote.identity}".encode()).hexdigest()[:16]
    elif not repack:
        key = hashlib.sha256(f"{key}|no-repack".encode()).hexdigest()[:16]
    return Identity(settings.lib, source, key, file_sha256(str(model_path)), device_name(device))


def model_file(model: str | None, weights: str) -> Path | None:
    """The model file a run will load, when it exists: a given --model is checked (exit 1 when it
    is not a GGUF); the built-in model is written on first use, and no record can name it before."""
    if model:
        gguf_meta.read(Path(model))
        return Path(model)
    p = tiny_model.default_path(tiny_model.TinyConfig(weights=weights))
    return p if p.is_file() else None


def qualify_command(model: str | None, weights: str, lib: str, device: str, widths: str,
                    remote: Remote | None = None, repack: bool = True) -> str:
    """The `dflash qualify` command that would qualify `widths` for this run's library/model/device."""
    parts = ["dflash qualify"]
    if model:
        parts.append(f"--model {shlex.quote(model)}")
    elif weights != tiny_model.DEFAULT_WEIGHTS:
        parts.append(f"--weights {weights}")
    if lib != "exact":
        parts.append(f"--lib {lib}")
    if device_name(device) != "cpu":
        parts.append(f"--device {shlex.quote(device)}")
    if not repack and remote is None:
        parts.append("--no-repack")
    if remote is not None:
        parts.append(f"--rpc {','.join(remote.endpoints)}")
        if remote.allow_mixed_builds:
            parts.append("--allow-mixed-builds")
    return " ".join(parts + [f"--widths {widths}"])


AUTO_WIDTHS = "4,8,16,32,64"  # what the note for `--chunk auto` without a record suggests


def lookup(settings: Settings, chunk: Chunk, model: str | None, weights: str, device: str,
           warn: Warn, note: Warn, remote: Remote | None = None, repack: bool = True,
           fits: Callable[[int], bool] | None = None) -> Qualified | None:
    """What the record of this library, model and device (and RPC servers' builds) proves for
    --chunk `chunk` (auto or N > 4). No proof: N > 4 is a UsageError naming the qualify command;
    auto notes that it runs 4."""
    path = model_file(model, weights)
    rec = load(identity(settings, path, device, remote, repack), warn) if path else None
    if rec is not None:
        if isinstance(chunk, int):
            width, mode = chunk, proven_mode(rec.widths, chunk)
        else:
            width, mode = widest_proven(rec.widths, fits)
        if mode:
            return Qualified(str(record_path(rec.identity)), rec.identity.key, width, mode)
    cmd = qualify_command(model, weights, settings.lib, device, AUTO_WIDTHS if chunk == AUTO else str(chunk), remote,
                          repack)
    if chunk != AUTO:
        raise UsageError(f"{arg('chunk')} {chunk}: no qualification record proves width {chunk} exact for this "
                         f"library, model and device: run `{cmd}`")
    note(f"--chunk auto: no qualification record for this library, model and device, running "
         f"{MAX_BAND} (to qualify wider bands run `{cmd}`)")
    return None
