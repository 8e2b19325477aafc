"""Every environment flag and option, read in one place into one frozen Settings object.

Flags:
  DFLASH_DS4_EXACT_PREFILL_BANDS  1/0 (true/false, yes/no, on/off): opt in to q2..q4 bands
  LUCE_MMVQ_MAX_NCOLS             narrow-kernel ceiling; <= 0 means 8, above 8 means 8
  DFLASH_NARROW_MMVQ              boolean, default on: 0 turns every dflash hook of a HIP build off
                                  (ggml's stock routing, for A/B runs)
  DFLASH_DS4_INDEXER_SHORTCUT     boolean, default on (the exact library): skip DeepSeek-V4's indexer
                                  query, scoring and top-k while every pooled row fits in the top-k;
                                  `force` applies it always (wrong: a planted bug for negative controls)
  DFLASH_DS4_INDEXER_TILE         N > 0 (the exact library): DeepSeek-V4's indexer scores and top-k
                                  run over a ubatch's query rows N at a time (bit-identical; the score
                                  scratch follows N, not the width); 0 or unset: the whole ubatch;
                                  `N:plant` is a planted bug for negative controls (`--indexer-tile`)
  DFLASH_LLAMA_LIB_DIR            load libllama.so from this folder instead of the built one
  DFLASH_CPU_VARIANT              the CPU build variant: native (default), avx512, avx512-noamx or
                                  avx2 (`--cpu`, which sets it for the run and its workers)
  DFLASH_LLAMA_VERBOSE            boolean: pass llama.cpp's log through to stderr
  DFLASH_DEBUG                    boolean: tracebacks instead of one-line errors (read by the CLI
                                  edge through `debug_flag`, before any Settings exist)
The library reads no environment: `from_env()` is the explicit way to take these flags from
os.environ (the CLI does); `resolve(env, ...)` takes them from any mapping ({} for none).
Option chunk: 1..4 (narrow bands, as the flags above say), or 5..4096 and `auto`, which need a
qualification record (dflash/proof/records.py): dflash/proof/choice.py looks it up and passes what it proves
as `qualified`; both imply bands on unless bands=False.
The effective LUCE_MMVQ_MAX_NCOLS and DFLASH_NARROW_MMVQ are exported to the process before
llama.cpp loads (and never changed after), so a HIP build's narrow kernels route exactly the widths
dflash labels narrow (or, switched off, none).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from dflash.core.cpu_isa import CPU_VARIANTS, NATIVE
from dflash.core.errors import UsageError, arg
from dflash.core.paths import FLAVORS

ENV_BANDS = "DFLASH_DS4_EXACT_PREFILL_BANDS"
ENV_MMVQ = "LUCE_MMVQ_MAX_NCOLS"
ENV_NARROW = "DFLASH_NARROW_MMVQ"
ENV_SHORTCUT = "DFLASH_DS4_INDEXER_SHORTCUT"
ENV_TILE = "DFLASH_DS4_INDEXER_TILE"
ENV_WINDOW = "DFLASH_DS4_RAW_WINDOW"
ENV_LIB_DIR = "DFLASH_LLAMA_LIB_DIR"
ENV_VERBOSE = "DFLASH_LLAMA_VERBOSE"
ENV_DEBUG = "DFLASH_DEBUG"
ENV_CCACHE = "DFLASH_CCACHE"  # read by dflash.native.build: 0 compiles llama.cpp without ccache
ENV_CPU = "DFLASH_CPU_VARIANT"
ENV_STALL = "DFLASH_STALL_TIMEOUT"  # read by dflash.run.supervisor (the CLI's parent process)
ENV_FLAGS = (ENV_BANDS, ENV_MMVQ, ENV_NARROW, ENV_SHORTCUT, ENV_TILE, ENV_WINDOW, ENV_LIB_DIR, ENV_VERBOSE, ENV_CPU)
# One line each, for `dflash --help` (the module doc above says more)
ENV_DOCS = {
    ENV_BANDS: "1/0: opt in to q2..q4 bands (--bands/--no-bands override it)",
    ENV_MMVQ: "the narrow-kernel ceiling (columns); <= 0 or above 8 means 8",
    ENV_NARROW: "0 turns every dflash hook of a HIP or CUDA build off (ggml's stock routing, for A/B runs)",
    ENV_SHORTCUT: "on (default), off, or force (a planted bug): DeepSeek-V4's indexer shortcut",
    ENV_TILE: "N: DeepSeek-V4's indexer over N query rows at a time (--indexer-tile)",
    ENV_WINDOW: "on (default), off, or plant (a planted bug): DeepSeek-V4's raw sliding-window cache",
    ENV_LIB_DIR: "load libllama.so from this folder instead of the built library",
    ENV_CPU: "the CPU build variant: native, avx512, avx512-noamx or avx2 (--cpu)",
    ENV_VERBOSE: "1: pass llama.cpp's log through to stderr",
    ENV_DEBUG: "1: tracebacks instead of one-line errors (--debug)",
    ENV_CCACHE: "0: compile llama.cpp without ccache",
    ENV_STALL: "S: stop a command whose llama.cpp stage has made no progress for S seconds (off by default)",
}
SHORTCUT_MODES = ("on", "off", "force")  # DFLASH_DS4_INDEXER_SHORTCUT: a boolean, or force
WINDOW_MODES = ("on", "off", "plant")    # DFLASH_DS4_RAW_WINDOW: a boolean, or plant

MAX_BAND = 4               # widest band the narrow kernels serve (--chunk without a record)
MAX_CHUNK = 4096           # widest --chunk a qualification record can prove
MAX_TILE = MAX_CHUNK       # widest DeepSeek-V4 indexer tile (a tile >= the width is no tiling)
AUTO = "auto"              # --chunk auto: the widest width the record proves exact
PLANNER, FIXED = "planner", "fixed"  # how a record proved a width: the planner's bands, or bands
                                     # of exactly that width across compressor boundaries
UPSTREAM_MMVQ_DEFAULT = 3  # llama.cpp fork default ceiling
BANDS_MMVQ_DEFAULT = 4     # dflash's ceiling when bands are on
MMVQ_MAX = 8               # LUCE_MMVQ_MAX_NCOLS <= 0 or > 8 means this (the narrow path's limit)
LIBS = FLAVORS

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise UsageError(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def parse_int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None


Chunk = int | str  # 1..MAX_CHUNK or AUTO


def parse_chunk(value: Chunk | None) -> Chunk | None:
    """--chunk as given: None (the default), AUTO, or an int in 1..MAX_CHUNK."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{arg('chunk')} {value!r} is malformed (use 1..{MAX_CHUNK} or {AUTO})") from None
    if not 1 <= value <= MAX_CHUNK:
        raise UsageError(f"{arg('chunk')} {value} is out of range: use 1..{MAX_BAND}, or up to {MAX_CHUNK} "
                         f"or {AUTO} with a qualification record")
    return value


def needs_record(chunk: Chunk | None) -> bool:
    """--chunk auto and --chunk N > 4 run only what a qualification record proves."""
    return chunk == AUTO or (isinstance(chunk, int) and chunk > MAX_BAND)


@dataclass(frozen=True)
class Qualified:
    """The qualification record that justified the width of a run."""
    path: str
    key: str
    width: int
    mode: str  # PLANNER or FIXED

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Settings:
    bands: bool
    chunk: int
    mmvq_max_ncols: int
    lib: str = "exact"
    lib_dir: str | None = None        # explicit library folder (DFLASH_LLAMA_LIB_DIR)
    verbose: bool = False             # DFLASH_LLAMA_VERBOSE
    bands_from: str = "default"       # where `bands` came from: default, env, option, chunk
    mmvq_from: str = "default"
    env_raw: tuple[tuple[str, str], ...] = ()  # (name, value) of every dflash flag set, as given
    chunk_requested: Chunk = MAX_BAND  # --chunk as given (AUTO or an int)
    qualified: Qualified | None = None  # the record behind a width > 4 or auto
    narrow: bool = True               # DFLASH_NARROW_MMVQ: the HIP build's dflash hooks on
    indexer_shortcut: str = "on"      # DFLASH_DS4_INDEXER_SHORTCUT: on, off, or force (a planted bug)
    cpu: str = NATIVE                 # the CPU build variant (--cpu, DFLASH_CPU_VARIANT)
    indexer_tile: int = 0             # DFLASH_DS4_INDEXER_TILE: query rows per indexer tile (0: none)
    indexer_tile_plant: bool = False  # `N:plant`: the planted tile bug (negative controls only)
    raw_window: str = "on"            # DFLASH_DS4_RAW_WINDOW: on, off, or plant (a planted bug)

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None, *, bands: bool | None = None, chunk: Chunk | None = None,
                 lib: str = "exact", cpu: str | None = None) -> Settings:
        """Settings from dflash's environment flags (os.environ unless `env`) and these options;
        `cpu` (--cpu) sets DFLASH_CPU_VARIANT among them, so sessions and workers resolved from
        these settings' flags load the same variant."""
        return from_env(env, bands=bands, chunk=chunk, lib=lib, cpu=cpu)

    @property
    def fixed(self) -> bool:
        """Bands of exactly `chunk` tokens that ignore compressor boundaries (record-backed only)."""
        return self.bands and self.qualified is not None and self.qualified.mode == FIXED

    @property
    def cap(self) -> int:
        """The widest band the planner may use."""
        return self.chunk if self.bands else 1

    @property
    def leaves_narrow_path(self) -> bool:
        """Bands wider than the narrow ceiling go to batched kernels."""
        return self.cap > self.mmvq_max_ncols

    def library_env(self) -> dict[str, str]:
        """What llama.cpp's process must see: the effective narrow ceiling and whether the narrow
        hooks are on (a HIP build reads both, once), and DeepSeek-V4's graph switches (the indexer
        shortcut, the indexer tile and the raw window; the exact library reads each once)."""
        return {ENV_MMVQ: str(self.mmvq_max_ncols), ENV_NARROW: "1" if self.narrow else "0",
                ENV_SHORTCUT: {"on": "1", "off": "0", "force": "force"}[self.indexer_shortcut],
                ENV_TILE: tile_text(self.indexer_tile, self.indexer_tile_plant),
                ENV_WINDOW: {"on": "1", "off": "0", "plant": "plant"}[self.raw_window]}

    @property
    def env(self) -> dict[str, str]:
        """The dflash flags these settings were resolved from, as given (a mapping for `resolve`)."""
        return dict(self.env_raw)

    def warnings(self) -> list[str]:
        if self.leaves_narrow_path and self.qualified is None:  # a record proves what it runs
            return [f"bands wider than {ENV_MMVQ}={self.mmvq_max_ncols} run batched kernels and "
                    f"leave the narrow exact path (--chunk {self.chunk})"]
        return []


def tile_text(tile: int, plant: bool = False) -> str:
    """DFLASH_DS4_INDEXER_TILE's value for a tile (0: none) and the planted bug."""
    return f"{tile}:plant" if plant and tile > 0 else str(tile)


def parse_tile(value: str, name: str = ENV_TILE) -> tuple[int, bool]:
    """(tile, planted) from `N`, `N:plant` or empty (0, no tiles)."""
    text = value.strip().lower()
    if not text:
        return 0, False
    number, plant = (text[:-len(":plant")], True) if text.endswith(":plant") else (text, False)
    try:
        tile = int(number)
    except ValueError:
        raise UsageError(f"{name} {value!r} is malformed (use 0..{MAX_TILE}, 0 for no tiles)") from None
    if not 0 <= tile <= MAX_TILE or (plant and tile == 0):
        raise UsageError(f"{name} {value!r} is out of range: use 0..{MAX_TILE} (0: no tiles)")
    return tile, plant


def env_bool(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    """A boolean flag from the environment: None when unset or empty, else parse_bool (a
    malformed value is a usage error, for every flag and every command alike)."""
    value = (os.environ if env is None else env).get(name, "")
    return parse_bool(name, value) if value.strip() else None


def debug_flag(env: Mapping[str, str] | None = None) -> bool:
    """DFLASH_DEBUG (read by the CLI edge before any Settings exist)."""
    return bool(env_bool(ENV_DEBUG, env))


def from_env(env: Mapping[str, str] | None = None, *, bands: bool | None = None, chunk: Chunk | None = None,
             lib: str = "exact", qualified: Qualified | None = None, cpu: str | None = None) -> Settings:
    """The explicit way to read dflash's environment flags (os.environ unless `env` is given):
    what the CLI runs with. The library itself reads no environment."""
    return resolve(with_cpu(os.environ if env is None else env, cpu), bands=bands, chunk=chunk, lib=lib,
                   qualified=qualified)


def with_cpu(env: Mapping[str, str], cpu: str | None) -> Mapping[str, str]:
    """`env` with DFLASH_CPU_VARIANT set to `cpu` (an option wins over the flag); None: as it is."""
    return env if cpu is None else {**env, ENV_CPU: cpu}


def resolve(env: Mapping[str, str], *, bands: bool | None = None, chunk: Chunk | None = None, lib: str = "exact",
            qualified: Qualified | None = None) -> Settings:
    """Combine the flags in `env` (a mapping: {} for none; see from_env) and options; options win.

    chunk auto or N > 4 implies bands on (unless bands=False) and needs `qualified`, what the
    caller's qualification record proves (auto without one runs 4, as the caller says)."""
    requested = parse_chunk(chunk)
    requested = MAX_BAND if requested is None else requested
    env_bands = env_bool(ENV_BANDS, env)
    bands_from = "default"
    bands_on = False
    if bands is not None:
        bands_on, bands_from = bool(bands), "option"
    elif needs_record(requested):  # an explicit, record-backed opt-in
        bands_on, bands_from = True, "chunk"
    elif env_bands is not None:
        bands_on, bands_from = env_bands, "env"

    chunk = requested if isinstance(requested, int) else MAX_BAND
    if not bands_on or not needs_record(requested):
        qualified = None
    elif qualified is not None and (requested in (AUTO, qualified.width)):
        chunk = qualified.width
    elif requested != AUTO:
        raise UsageError(f"{arg('chunk')} {requested} needs a qualification record proving width {requested} "
                         f"exact (run `dflash qualify --widths {requested}`)")

    mmvq_from = "default"
    if env.get(ENV_MMVQ, "").strip() != "":
        n = parse_int(ENV_MMVQ, env[ENV_MMVQ])
        mmvq, mmvq_from = (n if 0 < n <= MMVQ_MAX else MMVQ_MAX), "env"
    else:
        mmvq = BANDS_MMVQ_DEFAULT if bands_on else UPSTREAM_MMVQ_DEFAULT

    if lib not in LIBS:
        raise UsageError(f"{arg('lib')} {lib!r} is unknown (use one of {', '.join(LIBS)})")
    lib_dir = env.get(ENV_LIB_DIR, "").strip() or None
    if lib_dir and lib != "exact":
        raise UsageError(f"{ENV_LIB_DIR} replaces the exact library; unset it to run {arg('lib')} {lib}")
    cpu = env.get(ENV_CPU, "").strip() or NATIVE
    if cpu not in CPU_VARIANTS:
        raise UsageError(f"{arg('cpu')} / {ENV_CPU} {cpu!r} is unknown (use one of {', '.join(CPU_VARIANTS)})")
    if lib_dir and cpu != NATIVE:
        raise UsageError(f"{ENV_LIB_DIR} names the library to load; unset it to run {arg('cpu')} {cpu}")
    verbose = bool(env_bool(ENV_VERBOSE, env))
    narrow = env_bool(ENV_NARROW, env) is not False  # unset or empty: on
    raw_shortcut = env.get(ENV_SHORTCUT, "").strip().lower()
    shortcut = ("force" if raw_shortcut == "force" else
                "off" if env_bool(ENV_SHORTCUT, env) is False else "on")  # unset or empty: on
    tile, plant = parse_tile(env.get(ENV_TILE, ""), f"{arg('indexer_tile')} / {ENV_TILE}")
    raw_window = env.get(ENV_WINDOW, "").strip().lower()
    window = "plant" if raw_window == "plant" else "off" if env_bool(ENV_WINDOW, env) is False else "on"
    return Settings(bands=bands_on, chunk=chunk, mmvq_max_ncols=mmvq, lib=lib, lib_dir=lib_dir,
                    verbose=verbose, bands_from=bands_from, mmvq_from=mmvq_from,
                    env_raw=tuple((k, env[k]) for k in ENV_FLAGS if k in env),
                    chunk_requested=requested, qualified=qualified, narrow=narrow, indexer_shortcut=shortcut,
                    cpu=cpu, indexer_tile=tile, indexer_tile_plant=plant, raw_window=window)


def ccache_flag(env: Mapping[str, str] | None = None) -> bool:
    """DFLASH_CCACHE (read by the build, default on)."""
    value = env_bool(ENV_CCACHE, env)
    return True if value is None else value
