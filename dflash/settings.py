"""Every environment flag and option, read in one place into one frozen Settings object.

Flags:
  DFLASH_DS4_EXACT_PREFILL_BANDS  1/0 (true/false, yes/no, on/off): opt in to q2..q4 bands
  LUCE_MMVQ_MAX_NCOLS             narrow-kernel ceiling; <= 0 means 8, above 8 means 8
  DFLASH_LLAMA_LIB_DIR            load libllama.so from this folder instead of the built one
  DFLASH_LLAMA_VERBOSE            boolean: pass llama.cpp's log through to stderr
  DFLASH_DEBUG                    boolean: tracebacks instead of one-line errors (read by the CLI
                                  edge through `debug_flag`, before any Settings exist)
The effective LUCE_MMVQ_MAX_NCOLS is exported to the process before llama.cpp loads, so a HIP
build's narrow kernels route exactly the widths dflash labels narrow.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .build import FLAVORS
from .errors import UsageError

ENV_BANDS = "DFLASH_DS4_EXACT_PREFILL_BANDS"
ENV_MMVQ = "LUCE_MMVQ_MAX_NCOLS"
ENV_LIB_DIR = "DFLASH_LLAMA_LIB_DIR"
ENV_VERBOSE = "DFLASH_LLAMA_VERBOSE"
ENV_DEBUG = "DFLASH_DEBUG"
ENV_FLAGS = (ENV_BANDS, ENV_MMVQ, ENV_LIB_DIR, ENV_VERBOSE)

MAX_BAND = 4               # widest band the narrow kernels serve (--chunk range in band mode)
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


@dataclass(frozen=True)
class Settings:
    bands: bool
    chunk: int
    mmvq_max_ncols: int
    lib: str = "exact"
    lib_dir: str | None = None        # explicit library folder (DFLASH_LLAMA_LIB_DIR)
    verbose: bool = False             # DFLASH_LLAMA_VERBOSE
    bands_from: str = "default"       # where `bands` came from: default, env, option
    mmvq_from: str = "default"
    env_raw: tuple = ()               # (name, value) of every dflash flag set, as given

    @property
    def cap(self) -> int:
        """The widest band the planner may use."""
        return self.chunk if self.bands else 1

    @property
    def leaves_narrow_path(self) -> bool:
        """Bands wider than the narrow ceiling go to batched kernels."""
        return self.cap > self.mmvq_max_ncols

    def library_env(self) -> dict[str, str]:
        """What llama.cpp's process must see: the effective narrow ceiling (a HIP build reads it)."""
        return {ENV_MMVQ: str(self.mmvq_max_ncols)}

    def warnings(self) -> list[str]:
        if self.leaves_narrow_path:
            return [f"bands wider than {ENV_MMVQ}={self.mmvq_max_ncols} run batched kernels and "
                    f"leave the narrow exact path (--chunk {self.chunk})"]
        return []


def debug_flag(env: Mapping[str, str] | None = None) -> bool:
    """DFLASH_DEBUG; a malformed value counts as on (it only adds tracebacks)."""
    v = (os.environ if env is None else env).get(ENV_DEBUG, "").strip().lower()
    return v != "" and v not in _FALSE


def resolve(env: Mapping[str, str] | None = None, *, bands: bool | None = None,
            chunk: int | None = None, lib: str = "exact") -> Settings:
    """Combine environment and options; options win over the environment."""
    env = os.environ if env is None else env
    bands_from = "default"
    bands_on = False
    if bands is not None:
        bands_on, bands_from = bool(bands), "option"
    elif env.get(ENV_BANDS, "").strip() != "":
        bands_on, bands_from = parse_bool(ENV_BANDS, env[ENV_BANDS]), "env"

    if chunk is None:
        chunk = MAX_BAND
    if not 1 <= chunk <= MAX_BAND:
        raise UsageError(f"--chunk {chunk} is out of range: band mode accepts 1..{MAX_BAND}")

    mmvq_from = "default"
    if env.get(ENV_MMVQ, "").strip() != "":
        n = parse_int(ENV_MMVQ, env[ENV_MMVQ])
        mmvq, mmvq_from = (n if 0 < n <= MMVQ_MAX else MMVQ_MAX), "env"
    else:
        mmvq = BANDS_MMVQ_DEFAULT if bands_on else UPSTREAM_MMVQ_DEFAULT

    if lib not in LIBS:
        raise UsageError(f"--lib {lib!r} is unknown (use one of {', '.join(LIBS)})")
    lib_dir = env.get(ENV_LIB_DIR, "").strip() or None
    if lib_dir and lib != "exact":
        raise UsageError(f"{ENV_LIB_DIR} replaces the exact library; unset it to run --lib {lib}")
    verbose = env.get(ENV_VERBOSE, "").strip() != "" and parse_bool(ENV_VERBOSE, env[ENV_VERBOSE])
    return Settings(bands=bands_on, chunk=chunk, mmvq_max_ncols=mmvq, lib=lib, lib_dir=lib_dir,
                    verbose=verbose, bands_from=bands_from, mmvq_from=mmvq_from,
                    env_raw=tuple((k, env[k]) for k in ENV_FLAGS if k in env))
