"""Qualification records: which band widths one library, model and device are proven exact at,
for prompts of how many tokens, under which run-time conditions.

`dflash qualify` writes one record per identity (below) into the user cache,
<cache_root()>/qualifications/<key>.json, merged with what that file already held (a width run
again replaces its old verdict), and this run's verdicts into its evidence directory as
qualification.json. `--chunk auto` and `--chunk N` (N > 4) read it:

    {"schema": "dflash.qualification", "schema_version": 2, "key": "<24 hex>",
     "library": {"flavor": "exact", "source": "build", "key": "<build key>", "cpu": "native"},
     "model": {"sha256": "<64 hex>", "path": "/path/model.gguf"},
     "device": "cpu",
     "runtime": {"cpu_buffer_types": ["AMX", "CPU_REPACK"], "amx": true, "kernel_switches": {},
                 "host": null, "kv_cache": "full"},
     "updated_utc": "2025-01-01T00:00:00Z",
     "widths": [{"width": 8, "planner_exact": true, "planner_widest_band": 4, "fixed_exact": true,
                 "fixed_widest_band": 8, "positions": 389, "evidence_dir": "/path/ev"}, ...]}

The identity, and `key` derived from all of it:
  library   the flavor, the CPU build variant (`cpu`: native, avx512, avx512-noamx, avx2), and
            source "build" (key: dflash.native.build.build_key of flavor, GPU backend and variant, which
            hashes the host's CPU flags) or "dir" (key: SHA-256 over the libllama*/libggml* files of
            DFLASH_LLAMA_LIB_DIR). On HIP and CUDA the key also covers the routing flags
            DFLASH_NARROW_MMVQ and LUCE_MMVQ_MAX_NCOLS; on every device DFLASH_DS4_INDEXER_SHORTCUT
            when it is not on; plain CPU buffers (--no-repack) and the RPC servers' builds enter it too.
  model     the GGUF's SHA-256.  device  the canonical --device.
  runtime   cpu_buffer_types: the extra buffer types the library's CPU device offered the run
            (llama.cpu_extra_buffer_types; null when the CPU holds no weights in them: plain
            buffers, --no-repack and RPC runs, or every layer on GPUs), so "AMX" only where the kernel
            granted AMX to the process: a record made with AMX does not vouch for a run without it,
            whose weights go to other kernels; `amx` says which. kernel_switches: every switch of
            dflash.native.graph_switches.ENV_SWITCHES set in the process environment (which llama.cpp
            reads), e.g. GGML_CPU_TILED_MM=0. host: a fingerprint of the CPU (model, flags) for a
            "dir" library, whose files say nothing about the host. kv_cache: "full" (swa_full, what
            dflash pins on every context) or "window" (a window-sized cache, never vouched for by
            a "full" record).

Per width: the planner run at that cap and the fixed-width run (bands of exactly that width across
compressor boundaries) matched q1 or not, the widest band each really decoded (width 1: both are
the q1 repeat), and `positions`, the length of the prompt those runs prefilled.

A record proves width N in a mode (fixed or planner) when that mode's run is exact at N and at
every narrower width the record holds; fixed is preferred (it is what decodes N-wide bands on
DeepSeek V4). For a prompt of n tokens, N's own verdict must come from a prompt of at least n
tokens (`covered`: the length a proof holds for); a narrower width found inexact stops the proof
at every length. `auto` takes the widest width proven in either mode, 1 (q1) when none is. A
request whose prompt is longer than its proof covers falls back (`for_prompt`): auto to the
widest wide width the record proves for that length, else to at most 4 (the narrow bands, which
need no record), with one warning line; an explicit N > 4 is refused.

One writer (`write`) and one reader (`read`); the reader is strict, and `load` turns a corrupt
record into no record with one warning line.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from dflash.core import paths
from dflash.core.cpu_isa import CPU_VARIANTS, NATIVE
from dflash.core.errors import DflashError, UsageError, arg
from dflash.core.fileio import write_atomic
from dflash.core.settings import (
    AUTO,
    ENV_SHORTCUT,
    ENV_WINDOW,
    FIXED,
    LIBS,
    MAX_BAND,
    MAX_CHUNK,
    PLANNER,
    Chunk,
    Qualified,
    Settings,
    tile_text,
)
from dflash.core.sha_cache import file_sha256
from dflash.model import gguf_meta, tiny_model
from dflash.native import devices, graph_switches, library_id
from dflash.native.rpc import Remote

SCHEMA = "dflash.qualification"
SCHEMA_VERSION = 2
FILE_NAME = "qualification.json"  # its name in an evidence directory
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
SOURCES = ("build", "dir")
KV_CACHES = ("full", "window")  # swa_full true (dflash's contexts), or a window-sized cache
MAX_POSITIONS = 2**32 - 1       # llama_context_params.n_ctx is 32 bits
_KEYS = {"schema", "schema_version", "key", "library", "model", "device", "runtime", "updated_utc", "widths"}
_RUNTIME_KEYS = {"cpu_buffer_types", "amx", "kernel_switches", "host", "kv_cache"}
_WIDTH_KEYS = {"width", "planner_exact", "planner_widest_band", "fixed_exact", "fixed_widest_band", "positions",
               "evidence_dir"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{16,64}")
_DEVICE = re.compile(r"(cpu|hip:\d+|cuda:\d+|vulkan:\d+|rpc:\d+)(,(cpu|hip:\d+|cuda:\d+|vulkan:\d+|rpc:\d+))*")
_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")  # a buffer type's or a switch's name

Warn = Callable[[str], None]
BufferTypes = tuple[str, ...] | None  # the CPU's extra buffer types; None: the CPU holds no weights in them


class RecordError(ValueError):
    """A qualification record is unreadable, malformed or not the one asked for."""


@dataclass(frozen=True)
class Identity:
    """What a record is about: the library, the model, the device and the run-time conditions
    (see the module doc)."""
    flavor: str
    library_source: str  # "build" or "dir"
    library_key: str
    model_sha256: str
    device: str          # "cpu", "hip:N" or "hip:N,hip:M"
    cpu: str = NATIVE    # the CPU build variant
    cpu_buffer_types: BufferTypes = ()
    kernel_switches: tuple[tuple[str, str], ...] = ()
    host: str | None = None
    kv_cache: str = "full"

    @property
    def amx(self) -> bool | None:
        """Whether the run had AMX (the CPU offered its AMX buffer type); None with plain buffers."""
        return None if self.cpu_buffer_types is None else "AMX" in self.cpu_buffer_types

    @property
    def key(self) -> str:
        bufts = "plain" if self.cpu_buffer_types is None else ",".join(self.cpu_buffer_types)
        switches = ";".join(f"{k}={v}" for k, v in self.kernel_switches)
        text = "|".join((self.flavor, self.library_source, self.library_key, self.model_sha256, self.device,
                         f"cpu={self.cpu}", f"bufts={bufts}", f"switches={switches}", f"host={self.host or ''}",
                         f"kv={self.kv_cache}"))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Verdict:
    width: int
    planner_exact: bool
    planner_widest_band: int
    fixed_exact: bool
    fixed_widest_band: int
    evidence_dir: str | None = None
    positions: int = 0  # the prompt's length (tokens) the runs prefilled; 0: covers nothing


@dataclass(frozen=True)
class Record:
    identity: Identity
    model_path: str
    updated_utc: str
    widths: tuple[Verdict, ...]  # sorted by width, one per width


@dataclass(frozen=True)
class Covered(Qualified):
    """The Qualified a lookup returns: also the longest prompt the proof covers, and the record's
    verdicts (for_prompt picks from them for a longer prompt)."""
    positions: int = 0
    verdicts: tuple[Verdict, ...] = ()

    def to_json(self) -> dict:
        return {"path": self.path, "key": self.key, "width": self.width, "mode": self.mode,
                "positions": self.positions}


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime(TIME_FORMAT)


# ---------------------------------------------------------------------------------------------
# What a record proves (pure)

def proven_mode(verdicts: Iterable[Verdict], width: int, n_tokens: int | None = None) -> str | None:
    """FIXED or PLANNER when the record proves `width` in that mode (see the module doc), for
    prompts of `n_tokens` when given: the width's own verdict must come from a prompt at least that
    long; a narrower width found inexact at any length stops the proof."""
    vs = list(verdicts)
    at = [v for v in vs if v.width == width and (n_tokens is None or v.positions >= n_tokens)]
    narrower = [v for v in vs if v.width < width]
    if at and at[0].fixed_exact and all(v.fixed_exact for v in narrower):
        return FIXED
    if at and at[0].planner_exact and all(v.planner_exact for v in narrower):
        return PLANNER
    return None


def widest_proven(verdicts: Iterable[Verdict], fits: Callable[[int], bool] | None = None,
                  n_tokens: int | None = None) -> tuple[int, str]:
    """(width, mode) that `--chunk auto` runs: the widest proven width (that `fits`, with
    --memory-budget; for prompts of `n_tokens` when given); (1, planner) = q1 if none."""
    vs = list(verdicts)
    for v in sorted(vs, key=lambda v: v.width, reverse=True):
        mode = proven_mode(vs, v.width, n_tokens)
        if mode and (fits is None or v.width == 1 or fits(v.width)):
            return v.width, mode
    return 1, PLANNER


def covered(verdicts: Iterable[Verdict], width: int, mode: str) -> int:
    """The longest prompt (tokens) for which the record proves `width` in `mode`: the length its
    verdict was qualified on; 0 when it does not prove it."""
    vs = list(verdicts)
    if proven_mode(vs, width) != mode:
        return 0
    return max(v.positions for v in vs if v.width == width)


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
    bufts = None if i.cpu_buffer_types is None else list(i.cpu_buffer_types)
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "key": i.key,
            "library": {"flavor": i.flavor, "source": i.library_source, "key": i.library_key, "cpu": i.cpu},
            "model": {"sha256": i.model_sha256, "path": r.model_path},
            "device": i.device,
            "runtime": {"cpu_buffer_types": bufts, "amx": i.amx, "kernel_switches": dict(i.kernel_switches),
                        "host": i.host, "kv_cache": i.kv_cache},
            "updated_utc": r.updated_utc,
            "widths": [{"width": v.width, "planner_exact": v.planner_exact,
                        "planner_widest_band": v.planner_widest_band, "fixed_exact": v.fixed_exact,
                        "fixed_widest_band": v.fixed_widest_band, "positions": v.positions,
                        "evidence_dir": v.evidence_dir} for v in r.widths]}


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
    _need(_is_int(d["positions"], 1, MAX_POSITIONS), f"widths[{i}].positions is not in 1..{MAX_POSITIONS}")
    _need(d["evidence_dir"] is None or isinstance(d["evidence_dir"], str),
          f"widths[{i}].evidence_dir is not a string or null")
    return Verdict(**d)


def _runtime(rt: Any) -> dict[str, Any]:
    _need(isinstance(rt, dict) and set(rt) == _RUNTIME_KEYS,
          f"runtime must have exactly the keys {sorted(_RUNTIME_KEYS)}")
    b = rt["cpu_buffer_types"]
    _need(b is None or (isinstance(b, list) and all(isinstance(x, str) and _NAME.fullmatch(x) for x in b)),
          "runtime.cpu_buffer_types is not a list of names or null")
    bufts = None if b is None else tuple(b)
    _need(rt["amx"] is (None if bufts is None else "AMX" in bufts),
          "runtime.amx does not say whether cpu_buffer_types holds AMX")
    sw = rt["kernel_switches"]
    _need(isinstance(sw, dict) and all(_NAME.fullmatch(k) and isinstance(v, str) for k, v in sw.items()),
          "runtime.kernel_switches is not an object of names and strings")
    _need(rt["host"] is None or (isinstance(rt["host"], str) and _HEX.fullmatch(rt["host"]) is not None),
          "runtime.host is not hex or null")
    _need(rt["kv_cache"] in KV_CACHES, f"runtime.kv_cache is not one of {', '.join(KV_CACHES)}")
    return {"cpu_buffer_types": bufts, "kernel_switches": tuple(sw.items()), "host": rt["host"],
            "kv_cache": rt["kv_cache"]}


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
    _need(isinstance(lib, dict) and set(lib) == {"flavor", "source", "key", "cpu"} and lib["flavor"] in LIBS
          and lib["source"] in SOURCES and isinstance(lib["key"], str) and _HEX.fullmatch(lib["key"]) is not None
          and lib["cpu"] in CPU_VARIANTS,
          "library is not {\"flavor\": exact|stock, \"source\": build|dir, \"key\": <hex>, \"cpu\": <variant>}")
    _need(isinstance(model, dict) and set(model) == {"sha256", "path"} and isinstance(model["sha256"], str)
          and _HEX64.fullmatch(model["sha256"]) is not None and isinstance(model["path"], str),
          "model is not {\"sha256\": <64 lowercase hex>, \"path\": <string>}")
    _need(isinstance(d["device"], str) and _DEVICE.fullmatch(d["device"]) is not None,
          f"device {d['device']!r} is not a --device (cpu, hip:N, cuda:N, vulkan:N, rpc:N, joined by commas)")
    rt = _runtime(d["runtime"])
    _need(_is_time(d["updated_utc"]), f"updated_utc {d['updated_utc']!r} is not {TIME_FORMAT}")
    _need(isinstance(d["widths"], list) and len(d["widths"]) > 0, "widths is not a non-empty list")
    widths = tuple(_verdict(i, x) for i, x in enumerate(d["widths"]))
    _need([v.width for v in widths] == sorted({v.width for v in widths}), "widths are not sorted and unique")
    ident = Identity(lib["flavor"], lib["source"], lib["key"], model["sha256"], d["device"], lib["cpu"], **rt)
    _need(d["key"] == ident.key, "key does not match the library, model, device and runtime it names")
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


def records_dir() -> Path:
    """Where qualification records (<key>.json) and serve records (serve-<key>.json) live."""
    return paths.cache_root() / "qualifications"


def record_path(identity: Identity) -> Path:
    return records_dir() / f"{identity.key}.json"


def load(identity: Identity, warn: Warn) -> Record | None:
    """The stored record for `identity`; None when there is none, or (with one warning line) when
    it is corrupt or names another identity."""
    path = record_path(identity)
    if not path.exists():
        return None
    try:
        r = read(path)
        if r.identity != identity:
            raise RecordError(f"{path}: names another library, model, device or runtime")
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
# Identities

def device_name(device: str) -> str:
    """The canonical form of --device (e.g. cpu, hip:0,hip:1, cpu,rpc:0)."""
    return str(devices.parse_spec(device))


_ASK = object()  # identity(): ask the library which CPU buffer types it offers


def identity(settings: Settings, model_path: str | os.PathLike[str], device: str = "cpu",
             remote: Remote | None = None, repack: bool = True, *, cpu_buffer_types: Any = _ASK,
             env: Mapping[str, str] | None = None, kv_cache: str = "full") -> Identity:
    """What a record is about (see the module doc). Plain CPU buffers (--no-repack, and every run
    with RPC devices) run other kernels than AMX and repacked ones, and what RPC servers run is part
    of the run: both enter the library key. `cpu_buffer_types`: what the CPU offers (default: ask the
    library, library_id.offered_buffer_types); not asked, and None in the identity, when the CPU holds no
    weights in them (plain buffers, or no layer on the CPU). `env`: the process environment
    llama.cpp reads its kernel switches from (default os.environ)."""
    kind = devices.device_kind(device, [sv.device for sv in remote.servers] if remote is not None else ())
    source, key = library_id.library_key(settings, kind)
    # the CPU's extra buffer types serve its layers' weights: none with plain buffers, none when
    # every layer is on other devices (hip:N, a GPU split, rpc:N)
    plain = remote is not None or not repack or "cpu" not in devices.parse_spec(device).entries
    if remote is not None:
        key = hashlib.sha256(f"{key}|rpc={remote.identity}".encode()).hexdigest()[:16]
    elif not repack:
        key = hashlib.sha256(f"{key}|no-repack".encode()).hexdigest()[:16]
    if plain:
        bufts: BufferTypes = None
    else:
        bufts = tuple(library_id.offered_buffer_types(settings, kind) if cpu_buffer_types is _ASK else cpu_buffer_types)
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache {kv_cache!r} is not one of {', '.join(KV_CACHES)}")
    switches = graph_switches.kernel_switches(os.environ if env is None else env, gpu=kind != "cpu")
    return Identity(settings.lib, source, key, file_sha256(str(model_path)), device_name(device),
                    library_id.cpu_variant(settings, kind), bufts, switches,
                    graph_switches.host_fingerprint() if source == "dir" else None, kv_cache)


def model_file(model: str | None, weights: str) -> Path | None:
    """The model file a run will load, when it exists: a given --model is checked (exit 1 when it
    is not a GGUF); the built-in model is written on first use, and no record can name it before."""
    if model:
        gguf_meta.read(Path(model))
        return Path(model)
    p = tiny_model.default_path(tiny_model.TinyConfig(weights=weights))
    return p if p.is_file() else None


def graph_options(settings: Settings) -> list[str]:
    """What the run sets beyond the defaults that enters the library key (library_id.library_key):
    flags as they are given on the command line, environment flags as VAR=value prefixes."""
    out = []
    if settings.indexer_shortcut != "on":
        out.append(f"{ENV_SHORTCUT}={settings.indexer_shortcut}")
    window = getattr(settings, "raw_window", "on")
    if window != "on":
        out.append(f"{ENV_WINDOW}={window}")
    cpu = getattr(settings, "cpu", NATIVE)
    if cpu != NATIVE and not settings.lib_dir:
        out.append(f"--cpu {cpu}")
    tile = getattr(settings, "indexer_tile", 0)
    if tile:
        out.append(f"--indexer-tile {tile_text(tile, getattr(settings, 'indexer_tile_plant', False))}")
    return out


def qualify_command(model: str | None, weights: str, lib: str, device: str, widths: str,
                    remote: Remote | None = None, repack: bool = True, settings: Settings | None = None) -> str:
    """The `dflash qualify` command that would qualify `widths` for this run's library/model/device
    and the options of `settings` that enter the record's key (--cpu, --indexer-tile, flags)."""
    opts = graph_options(settings) if settings is not None else []
    env = [o for o in opts if "=" in o]
    parts = [*env, "dflash qualify"]
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
    return " ".join(parts + [o for o in opts if "=" not in o] + [f"--widths {widths}"])


AUTO_WIDTHS = "4,8,16,32,64"  # what the note for `--chunk auto` without a record suggests


def describe_runtime(i: Identity) -> str:
    """The run-time part of an identity in words, for messages."""
    bufts = "plain buffers" if i.cpu_buffer_types is None else \
        f"CPU buffer types {','.join(i.cpu_buffer_types) or 'none'} ({'with' if i.amx else 'without'} AMX)"
    switches = " ".join(f"{k}={v}" for k, v in i.kernel_switches) or "none"
    return f"{i.cpu} build, {bufts}, kernel switches {switches}"


def lookup(settings: Settings, chunk: Chunk, model: str | None, weights: str, device: str,
           warn: Warn, note: Warn, remote: Remote | None = None, repack: bool = True,
           fits: Callable[[int], bool] | None = None) -> Qualified | None:
    """What the record of this library, model, device and run-time conditions (and RPC servers'
    builds) proves for --chunk `chunk` (auto or N > 4): a Covered, which also says the longest
    prompt the proof covers. No proof: N > 4 is a UsageError naming the qualify command; auto notes
    that it runs 4."""
    path = model_file(model, weights)
    rec, ident, unknown = None, None, ""
    if path:
        try:
            ident = identity(settings, path, device, remote, repack)
        except library_id.RuntimeUnknown as e:
            unknown = f" ({e})"
        rec = load(ident, warn) if ident is not None else None
    if rec is not None:
        if isinstance(chunk, int):
            width, mode = chunk, proven_mode(rec.widths, chunk)
        else:
            width, mode = widest_proven(rec.widths, fits)
        if mode:
            return Covered(str(record_path(rec.identity)), rec.identity.key, width, mode,
                           covered(rec.widths, width, mode), rec.widths)
    cmd = qualify_command(model, weights, settings.lib, device, AUTO_WIDTHS if chunk == AUTO else str(chunk), remote,
                          repack, settings)
    graph = ", ".join(graph_options(settings))
    what = f"library, model and device ({graph})" if ident is None and graph else "library, model and device" \
        if ident is None else f"library, model, device and run-time conditions ({describe_runtime(ident)}" + \
        (f"; {graph}" if graph else "") + ")"
    if chunk != AUTO:
        raise UsageError(f"{arg('chunk')} {chunk}: no qualification record proves width {chunk} exact for this "
                         f"{what}{unknown}: run `{cmd}`")
    note(f"--chunk auto: no qualification record for this {what}{unknown}, running "
         f"{MAX_BAND} (to qualify wider bands run `{cmd}`)")
    return None


def for_prompt(settings: Settings, n_tokens: int) -> tuple[Settings, str | None]:
    """The settings a request of `n_tokens` prompt tokens runs with, and the warning line when they
    are not `settings`: a record-backed width whose proof covers shorter prompts only falls back,
    for --chunk auto, to the widest wide width the record proves for that length (among the
    narrower ones), else to at most 4 (the narrow bands, which need no record; narrower than a
    width the record found inexact); an explicit --chunk N > 4 is a UsageError. A Qualified that
    states no coverage (not a Covered) covers nothing."""
    q = settings.qualified
    if q is None or not settings.bands:
        return settings, None
    pos = q.positions if isinstance(q, Covered) else 0
    if n_tokens <= pos:
        return settings, None
    vs = q.verdicts if isinstance(q, Covered) else ()
    beyond = (f"the prompt has {n_tokens} tokens, more than the {pos} that the qualification record "
              f"{q.path} covers at width {q.width}")
    longer = f"run `dflash qualify` with a prompt of at least {n_tokens} tokens (--prompt-file)"
    if settings.chunk_requested != AUTO:
        mode = proven_mode(vs, q.width, n_tokens)
        if mode is None:
            raise UsageError(f"{arg('chunk')} {q.width}: {beyond}: {longer} to prove width {q.width} for it")
        return replace(settings, qualified=Covered(q.path, q.key, q.width, mode, covered(vs, q.width, mode), vs)), None
    narrower = [v for v in vs if v.width <= q.width]
    width, mode = widest_proven(narrower, n_tokens=n_tokens)
    if width > MAX_BAND:
        new = Covered(q.path, q.key, width, mode, covered(narrower, width, mode), vs)
        return (replace(settings, chunk=width, qualified=new),
                f"--chunk auto: {beyond}: running width {width}, which it proves for up to {new.positions} tokens")
    # the narrow bands need no record, unless the record found one of them inexact (at any length)
    width = max(1, min([MAX_BAND, q.width] + [v.width - 1 for v in vs if not v.planner_exact]))
    return (replace(settings, chunk=width, qualified=None),
            f"--chunk auto: {beyond}: running {width} (narrow bands, no record needed); to vouch for wider "
            f"bands on it, {longer}")
