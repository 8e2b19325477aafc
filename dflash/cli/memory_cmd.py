"""`dflash memory`: what llama.cpp allocates for a context at each band width."""
from __future__ import annotations

import click
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import (
    Command,
    ctx_option,
    device_option,
    lib_option,
    model_option,
    open_session,
    parse_widths,
    threads_option,
)
from dflash.core.results import MemoryResult
from dflash.run import memory


@click.command("memory", cls=Command)
@model_option
@ctx_option
@click.option("--widths", default="1,4,64,512", show_default=True, help="Band widths, comma-separated (1..4096).")
@threads_option
@lib_option
@device_option
@click.option("--measured", is_flag=True,
              help="Allocate for real (read the weights, create each context) instead of the no_alloc estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model: str | None, weights: str, ctx: int | None, widths: str, threads: int | None, lib: str, device: str,
            rpc: str | None, allow_mixed_builds: bool, no_repack: bool, measured: bool, as_json: bool) -> None:
    """Bytes llama.cpp allocates for a context of --ctx tokens at each band width: weights, the KV
    cache (DeepSeek-V4: the raw sliding-window cache, the compressed caches, the indexer key cache,
    the compressor states) and the compute buffer reserved for that width, summed over devices.
    Taken from llama.cpp itself: the model is loaded with no_alloc (metadata and shapes only, quick
    even for a model larger than this machine's memory) and one context is created per width.
    Weights are counted as llama.cpp reads them into buffers; a run that maps the model file (the
    default on a CPU) also keeps the file's pages of weights it copied into AMX or repacked buffers.
    indexer_scores_bytes is analytic (rows x width x 4 bytes; with --indexer-tile N, rows x
    min(width, N) x 4), shown beside llama.cpp's figures."""
    if ctx is None:
        raise click.UsageError("--ctx is required (the context size to size)")
    ws = parse_widths(widths)
    with open_session(model=model, weights=weights, lib=lib, device=device, rpc=rpc,
                      allow_mixed_builds=allow_mixed_builds, no_repack=no_repack, threads=threads,
                      no_alloc=not measured, mmap=False) as session:
        with output.progress_bar("memory", enabled=not as_json and len(ws) > 1) as bar:
            result = session.memory(ws, ctx=ctx, progress=bar)
    output.emit(result, as_json, show)


def show(r: MemoryResult) -> None:
    h = memory.human
    title = (f"{r.model} ({r.architecture}), context {r.n_ctx}, "
             f"{'measured' if r.measured else 'no_alloc estimate'}, {r.library.flavor} library, {r.device}")
    t = Table("width", "total", "weights", "KV", "compressed KV", "indexer cache", "compressor states", "compute",
              "indexer scores*", title=title)
    for x in r.rows:
        t.add_row(str(x.width), h(x.total_bytes), h(x.weights_bytes), h(x.kv_bytes), h(x.compressed_kv_bytes),
                  h(x.indexer_cache_bytes), h(x.compressor_state_bytes), h(x.compute_bytes),
                  h(x.indexer_scores_bytes) if x.indexer_scores_bytes is not None else "-")
    output.out.print(t)
    if r.indexer_rows is not None:
        per = f"min(width, tile {r.indexer_tile})" if r.indexer_tile else "width"
        output.out.print(f"* analytic, not llama.cpp's figure: {r.indexer_rows} pooled rows x {per} x 4 bytes "
                         f"(one layer's indexer scores; part of the compute buffer)", highlight=False, markup=False)


commands = [command]
