"""Which width a run takes: `chunk`, `auto`, the qualification record and the memory budget.

One place decides it for the Session, the CLI and `dflash plan`:
  * chunk 1..4 (or none): the narrow bands the flags allow, no record needed;
  * chunk N > 4: the qualification record of this library, model and device must prove N
    (dflash/proof/records.py), else a UsageError naming the `dflash qualify` command;
  * chunk auto: the widest width the record proves (4 without a record, with a note);
  * a memory budget: auto takes the widest proven width whose no_alloc estimate fits (without a
    record: 4, or the widest narrower one that fits), and a width that does not fit is a
    UsageError naming the bytes. On DeepSeek-V4, when no indexer tile is set, it chooses the
    width and the tile together: among the tiles of TILES with a record, the widest proven width
    that fits at that tile (a tile bounds the indexer's scratch, so a wider width may fit); on a
    tie no tile, then the widest tile.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dflash.core import settings
from dflash.core.errors import arg
from dflash.core.settings import Chunk, Settings
from dflash.model.tiny_model import DEFAULT_WEIGHTS
from dflash.native import devices
from dflash.native.rpc import Remote
from dflash.proof import records
from dflash.run import engine, memory

Say = Callable[[str], None]

TILES = (0, 512, 256, 128, 64)  # the indexer tiles --memory-budget weighs for --chunk auto (0: none)


def _quiet(msg: str) -> None:
    pass


def choose(env: Mapping[str, str], *, bands: bool | None, chunk: Chunk | None, lib: str = "exact",
           model: str | None = None, weights: str = DEFAULT_WEIGHTS, device: str = "cpu", remote: Remote | None = None,
           repack: bool = True, budget: memory.Budget | None = None, warn: Say = _quiet,
           note: Say = _quiet) -> Settings:
    """The settings a run takes (see the module doc). `budget`, when given, is the no_alloc
    estimate of the run's context (open_budget)."""
    if budget is not None and budget.has_indexer and bands is not False \
            and settings.parse_chunk(chunk) == settings.AUTO and not env.get(settings.ENV_TILE, "").strip():
        tiled = _with_tile(env, bands, chunk, lib, model=model, weights=weights, device=device, remote=remote,
                           repack=repack, budget=budget, warn=warn, note=note)
        if tiled is not None:
            return tiled
        budget.tile = 0
    s = _proven(env, bands, chunk, lib, model=model, weights=weights, device=device, remote=remote, repack=repack,
                budget=budget, warn=warn, note=note)
    if budget is None:
        return s
    if s.chunk_requested == settings.AUTO and s.qualified is None and s.bands:
        fitting = [w for w in range(s.chunk, 0, -1) if budget.fits(w)]  # 4, 3, 2, 1: no record needed
        if fitting and fitting[0] != s.chunk:
            note(f"{arg('chunk')} auto: width {s.chunk} does not fit {arg('memory_budget')}, running {fitting[0]}")
            s = settings.resolve(env, bands=True, chunk=fitting[0], lib=lib)
    budget.require(s.cap)
    return s


def _with_tile(env: Mapping[str, str], bands: bool | None, chunk: Chunk | None, lib: str, *, model: str | None,
               weights: str, device: str, remote: Remote | None, repack: bool, budget: memory.Budget, warn: Say,
               note: Say) -> Settings | None:
    """--chunk auto within a budget on DeepSeek-V4 with no tile set: the width and tile (module
    doc), or None when no tile of TILES has a record."""
    best: tuple[tuple[int, bool, int], Settings] | None = None
    for tile in TILES:
        budget.tile = tile
        s = _proven({**env, settings.ENV_TILE: str(tile)}, bands, chunk, lib, model=model, weights=weights,
                    device=device, remote=remote, repack=repack, budget=budget, warn=warn, note=_quiet)
        if s.qualified is None or not budget.fits(s.cap):
            continue
        rank = (s.cap, tile == 0, tile)
        if best is None or rank > best[0]:
            best = rank, s
    if best is None:
        return None
    s = best[1]
    budget.tile = s.indexer_tile
    tile_text = f"indexer tile {s.indexer_tile}" if s.indexer_tile else "no indexer tile"
    note(f"{arg('chunk')} auto within {arg('memory_budget')}: width {s.chunk} with {tile_text} "
         f"(record {s.qualified.path if s.qualified else '-'})")
    return s


def _proven(env: Mapping[str, str], bands: bool | None, chunk: Chunk | None, lib: str, *, model: str | None,
            weights: str, device: str, remote: Remote | None, repack: bool, budget: memory.Budget | None,
            warn: Say, note: Say) -> Settings:
    req = settings.parse_chunk(chunk)
    if req is None or not settings.needs_record(req) or bands is False:
        return settings.resolve(env, bands=bands, chunk=req, lib=lib)
    base = settings.resolve(env, bands=bands, lib=lib)  # flags and lib checked before any hashing
    q = records.lookup(base, req, model, weights, device, warn=warn, note=note, remote=remote,
                      repack=engine.repack_for(devices.parse_spec(device), repack),
                      fits=budget.fits if budget is not None else None)
    return settings.resolve(env, bands=bands, chunk=req, lib=lib, qualified=q)


@dataclass(frozen=True)
class BudgetRequest:
    """What a memory budget must hold: a context of `ctx` tokens, or (without it) the prompt plus
    n_predict response tokens, as a request sizes its context."""
    limit: int
    ctx: int | None = None
    prompt: str | Sequence[int] | None = None
    n_predict: int = 16


def open_budget(env: Mapping[str, str], request: BudgetRequest, *, bands: bool | None, chunk: Chunk | None,
                lib: str, model: str | None, weights: str, device: str, remote: Remote | None, repack: bool,
                threads: int | None, build: bool, log: Say) -> memory.Budget:
    """The no_alloc estimate (the model's metadata only, before its weights load) of the request's
    context, for the widths a run may pick. It loads the library the run then uses, with the same
    flags exported (a library reads them once): bands on exactly when the run's will be."""
    on = True if bands is None and settings.needs_record(settings.parse_chunk(chunk)) else bands
    est = engine.open_engine(settings.resolve(env, bands=on, lib=lib), model, threads=threads, weights=weights,
                             device=device, remote=remote, repack=repack, no_alloc=True, mmap=False,
                             build_missing=build, log=log)
    try:
        if request.ctx is not None:
            n_ctx = est.context_size(0, 0, request.ctx)
        else:
            p = engine.DEFAULT_PROMPT if request.prompt is None else request.prompt
            n_tokens = len(est.tokenize(p) if isinstance(p, str) else p)
            n_ctx = est.context_size(n_tokens, request.n_predict, None)
    except BaseException:
        est.close()
        raise
    return memory.Budget(est, n_ctx, request.limit)
