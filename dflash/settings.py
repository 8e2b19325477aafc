"""Every environment flag and option, read in one place into one frozen Settings object.

Flags:
  DFLASH_DS4_EXACT_PREFILL_BANDS  1/0 (true/false, yes/no, on/off): opt in to q2..q4 bands
  LUCE_MMVQ_MAX_NCOLS             narrow-kernel ceiling; <= 0 means 8
  DFLASH_LLAMA_LIB_DIR            load libllama.so from this folder instead of the built one
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .errors import UsageError

ENV_BANDS = "DFLASH_DS4_EXACT_PREFILL_BANDS"
ENV_MMVQ = "LUCE_MMVQ_MAX_NCOLS"
ENV_LIB_DIR = "DFLASH_LLAMA_LIB_DIR"

MAX_BAND = 4               # widest band the narrow kernels serve (--chunk range in band mode)
UPSTREAM_MMVQ_DEFAULT = 3  # llama.cpp fork default ceiling
BANDS_MMVQ_DEFAULT = 4     # dflash's ceiling when bands are on
MMVQ_NONPOSITIVE = 8       # LUCE_MMVQ_MAX_NCOLS <= 0 means this
LIBS = ("exact", "stock")

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
    bands_from: str = "default"       # where `bands` came from: default, env, option
    mmvq_from: str = "default"

    @property
    def cap(self) -> int:
        """The widest band the planner may use."""
        return self.chunk if self.bands else 1

    @property
    def leaves_narrow_path(self) -> bool:
        """Bands wider than the narrow ceiling go to batched kernels."""
        return self.cap > self.mmvq_max_ncols

    def env_flags(self) -> dict[str, str]:
        """The flags as they would be exported, for evidence and child processes."""
        return {ENV_BANDS: "1" if self.bands else "0", ENV_MMVQ: str(self.mmvq_max_ncols)}

    def warnings(self) -> list[str]:
        if self.leaves_narrow_path:
            return [f"bands wider than {ENV_MMVQ}={self.mmvq_max_ncols} run batched kernels and "
                    f"leave the narrow exact path (--chunk {self.chunk})"]
        return []


def resolve(env: Mapping[str, str] | None = None, *, bands: bool | None = None,
            chunk: int | None = None, lib: str = "exact", max_chunk: int = MAX_BAND) -> Settings:
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
    if bands_on and not 1 <= chunk <= max_chunk:
        raise UsageError(f"--chunk {chunk} is out of range: band mode accepts 1..{max_chunk}")
    if chunk < 1:
        raise UsageError(f"--chunk {chunk} is out of range: it must be >= 1")

    mmvq_from = "default"
    if env.get(ENV_MMVQ, "").strip() != "":
        n = parse_int(ENV_MMVQ, env[ENV_MMVQ])
        mmvq, mmvq_from = (n if n > 0 else MMVQ_NONPOSITIVE), "env"
    else:
        mmvq = BANDS_MMVQ_DEFAULT if bands_on else UPSTREAM_MMVQ_DEFAULT

    if lib not in LIBS:
        raise UsageError(f"--lib {lib!r} is unknown (use one of {', '.join(LIBS)})")
    lib_dir = env.get(ENV_LIB_DIR, "").strip() or None
    return Settings(bands=bands_on, chunk=chunk, mmvq_max_ncols=mmvq, lib=lib, lib_dir=lib_dir,
                    bands_from=bands_from, mmvq_from=mmvq_from)
