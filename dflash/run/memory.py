"""What llama.cpp allocates for a context of N tokens at each band width, from llama.cpp itself.

`estimate` loads the model with llama.cpp's no_alloc (metadata and tensor shapes: nothing is read
or allocated, the sizes are computed as llama.cpp's own fit-params does) and creates one context
per width, with n_batch = n_ubatch = width, the compute graph reserved for that width;
llama_dflash_memory (cpu_kernels/patches/common) reports weights, caches (for DeepSeek-V4: the raw
sliding-window KV, the compressed KV, the indexer key cache, the compressor states) and compute
buffers, summed over every device. `measured=True` allocates for real instead: the check of the
estimate. Beside them: DeepSeek-V4's indexer-score term, rows x width x 4 bytes, computed here
(analytic), with rows the indexer mask's width at the end of the context: n_ctx/4 pooled rows,
padded to 256 as llama.cpp pads the mask.

DeepSeek-V4's raw cache is llama.cpp's interleaved-SWA cache with every layer in its window half;
with llama.cpp's default `swa_full` (which dflash keeps) that half holds the whole context, not
only the 128-token window: kv_bytes grows with n_ctx.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash.core.errors import UsageError, arg
from dflash.native import llama
from dflash.run.engine import Engine

SCORE_BYTES = 4        # one float32 score per pooled row and token
MASK_PAD = 256         # llama.cpp pads compressed-attention masks to this many rows
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, what: str = arg('memory_budget')) -> int:
    """'96GiB', '512MiB', '1.5TB', '1000000' -> bytes (binary KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(f"{what} {text!r} is not a size (e.g. 96GiB, 512MiB, 64GB)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"{what} {text!r} must be more than 0 bytes")
    return value


def human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def indexer_rows(compress_ratios: tuple[int, ...], n_ctx: int) -> int | None:
    """Pooled rows an indexer scores per token at the end of an n_ctx context (None: no indexer,
    i.e. no ratio-4 layer)."""
    if 4 not in compress_ratios:
        return None
    rows = max(n_ctx // 4, 1)
    return -(-rows // MASK_PAD) * MASK_PAD


@dataclass(frozen=True)
class MemoryRow:
    width: int
    weights_bytes: int
    context_bytes: int                 # every cache and state
    kv_bytes: int                      # DeepSeek-V4: the raw sliding-window KV cache; else every cache
    compressed_kv_bytes: int           # DeepSeek-V4's compressed KV caches (0 otherwise)
    indexer_cache_bytes: int
    compressor_state_bytes: int
    compute_bytes: int
    indexer_scores_bytes: int | None   # analytic: rows x width x 4 (None without an indexer)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.context_bytes + self.compute_bytes

    def to_json(self) -> dict[str, Any]:
        return {"width": self.width, "total_bytes": self.total_bytes, "weights_bytes": self.weights_bytes,
                "context_bytes": self.context_bytes, "kv_bytes": self.kv_bytes,
                "compressed_kv_bytes": self.compressed_kv_bytes, "indexer_cache_bytes": self.indexer_cache_bytes,
                "compressor_state_bytes": self.compressor_state_bytes, "compute_bytes": self.compute_bytes,
                "indexer_scores_bytes": self.indexer_scores_bytes}


def scored_rows(width: int, tile: int) -> int:
    """Query rows whose indexer scores one ubatch holds at once: the width, or the tile when smaller."""
    return min(width, tile) if tile > 0 else width


def row(width: int, sizes: dict[str, int], rows: int | None, tile: int = 0) -> MemoryRow:
    dsv4 = sizes["kv"] + sizes["compressed_kv"] + sizes["indexer_cache"] + sizes["compressor_states"] \
        + sizes["kv_unused_base"] > 0
    return MemoryRow(
        width=width, weights_bytes=sizes["weights"], context_bytes=sizes["context"],
        kv_bytes=sizes["kv"] + sizes["kv_unused_base"] if dsv4 else sizes["context"],
        compressed_kv_bytes=sizes["compressed_kv"],
        indexer_cache_bytes=sizes["indexer_cache"], compressor_state_bytes=sizes["compressor_states"],
        compute_bytes=sizes["compute"], indexer_scores_bytes=None if rows is None
        else rows * scored_rows(width, tile) * SCORE_BYTES)


def estimate(eng: Engine, n_ctx: int, widths: list[int],
             progress: Callable[[int, int], None] = lambda done, total: None,
             tile: int | None = None) -> list[MemoryRow]:
    """One row per width for a context of n_ctx tokens on the engine's model (loaded with no_alloc
    for an estimate, or for real for a measurement): a context is created and freed per width, with
    the indexer tile the engine's library applies (DFLASH_DS4_INDEXER_TILE), or `tile` (the library
    takes it for these contexts only)."""
    rows = indexer_rows(eng.info.compress_ratios, n_ctx)
    applied = eng.indexer_tile if tile is None or not llama.set_indexer_tile(tile) else tile
    out = []
    try:
        for i, w in enumerate(widths):
            with eng.context(n_ctx, w) as ctx:
                out.append(row(w, ctx.memory(), rows, applied))
            progress(i + 1, len(widths))
    finally:
        if tile is not None:
            llama.set_indexer_tile(eng.indexer_tile, eng.settings.indexer_tile_plant)
    return out


class Budget:
    """--memory-budget for one request: widths checked against the no_alloc estimate of its context.
    Holds a no_alloc engine until closed."""

    def __init__(self, eng: Engine, n_ctx: int, limit: int):
        self.eng, self.n_ctx, self.limit = eng, n_ctx, limit
        self.tile = eng.indexer_tile  # the indexer tile the estimates take (choice weighs several)
        self._rows: dict[tuple[int, int], MemoryRow] = {}

    @property
    def has_indexer(self) -> bool:
        """DeepSeek-V4 on a library with indexer tiles: the tile changes what a width needs."""
        return bool(self.eng.info.compress_ratios) and llama.indexer_tile_supported()

    def row(self, width: int) -> MemoryRow:
        key = (width, self.tile)
        if key not in self._rows:
            (self._rows[key],) = estimate(self.eng, self.n_ctx, [width], tile=self.tile)
        return self._rows[key]

    def fits(self, width: int) -> bool:
        return self.row(width).total_bytes <= self.limit

    def require(self, width: int) -> None:
        """A usage error naming the bytes when `width` does not fit."""
        r = self.row(width)
        if r.total_bytes > self.limit:
            raise UsageError(
                f"width {width} needs {r.total_bytes} bytes ({human(r.total_bytes)}: weights {human(r.weights_bytes)}, "
                f"caches {human(r.context_bytes)}, compute {human(r.compute_bytes)}) for a context of {self.n_ctx} "
                f"tokens, over {arg('memory_budget')} {self.limit} bytes ({human(self.limit)})")

    def to_json(self, width: int) -> dict[str, Any]:
        r = self.row(width)
        return {"budget_bytes": self.limit, "n_ctx": self.n_ctx, "width": width, "total_bytes": r.total_bytes,
                "estimate": r.to_json()}

    def close(self) -> None:
        self.eng.close()

