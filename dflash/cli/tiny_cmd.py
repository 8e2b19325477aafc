"""`dflash tiny-model`: write the built-in tiny DeepSeek-V4 GGUF."""
from __future__ import annotations

from pathlib import Path

import click

from dflash.cli import output
from dflash.cli.options import Command, cpu_option
from dflash.core import settings
from dflash.core.errors import DflashError
from dflash.core.fileio import sha256_file
from dflash.model import gguf_meta, tiny_model
from dflash.run import engine


def _out_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--out: absent means the user cache; given, it must name a file (empty is no default)."""
    if value is None:
        return None
    if not value.strip():
        raise click.UsageError("--out is empty", ctx)
    p = Path(value)
    if p.is_dir():
        raise click.UsageError(f"--out is a directory: {value}", ctx)
    parent = next((a for a in p.absolute().parents if a.exists()), None)
    if parent is not None and not parent.is_dir():
        raise click.UsageError(f"--out is inside a file, not a folder: {parent}", ctx)
    return value


@click.command("tiny-model", cls=Command)
@cpu_option
@click.option("--out", default=None, callback=_out_path,
              help="Output file [default: the user cache, reused by every command].")
@click.option("--weights", type=click.Choice(tiny_model.WEIGHTS), default=tiny_model.DEFAULT_WEIGHTS,
              show_default=True, help="Weight types (mxfp4: Q8_0 dense, MXFP4 experts, BF16 embeddings; "
              "q4_k_m, q6_k: the f32 model through llama.cpp's quantizer, which loads the exact library).")
@click.option("--seed", type=click.IntRange(0, tiny_model.SEED_MAX), default=1234, show_default=True,
              help="Seed of the random weights.")
@click.option("--idx-heads", type=click.IntRange(1, tiny_model.MAX_IDX_HEADS), default=tiny_model.TinyConfig.idx_heads,
              show_default=True, help="Indexer heads (DeepSeek-V4's lightning indexer).")
@click.option("--idx-dim", type=click.Choice([str(d) for d in tiny_model.IDX_DIMS]),
              default=str(tiny_model.TinyConfig.idx_dim), show_default=True, help="Indexer key length.")
@click.option("--top-k", type=click.IntRange(1, tiny_model.MAX_TOP_K), default=tiny_model.TinyConfig.top_k,
              show_default=True, help="Indexer top-k: pooled rows each token attends to.")
@click.option("--ds4-flash-shapes", is_flag=True,
              help="Write DeepSeek-V4 Flash's metadata and tensor shapes without weights (a sparse file of the "
                   "model's size, nothing written for the weights) to --out, for `dflash memory`.")
@click.option("--mtp", is_flag=True,
              help="Add a next-n (multi-token prediction) block after the others, as DeepSeek-V4 ships one: the "
                   "drafter of `dflash serve --spec mtp`. The main blocks' weights are the same as without it.")
@click.option("--json", "as_json", is_flag=True)
def command(out: str | None, weights: str, seed: int, idx_heads: int, idx_dim: str, top_k: int, mtp: bool,
            ds4_flash_shapes: bool, as_json: bool) -> None:
    """Write the deterministic tiny DeepSeek-V4 model. The indexer options make models where the
    indexer is a real share of the work (and where the all-pooled shortcut applies: its mask is at
    least 256 pooled rows wide, so a top-k of 256 or more)."""
    if ds4_flash_shapes:
        if out is None:
            raise click.UsageError("--ds4-flash-shapes needs --out (the file is as large as the model, sparse)")
        try:
            path = tiny_model.write_shapes(out, tiny_model.ds4_flash_shapes())
        except OSError as e:
            raise DflashError(f"cannot write {out}: {e.strerror or e}") from None
        info = gguf_meta.read(path)
        if as_json:
            output.emit_json({"path": str(path), "bytes": path.stat().st_size, "shapes_only": True,
                              "tensor_types": info.weight_types, "n_layers": info.n_layers})
        else:
            output.out.print(f"{path}  ({path.stat().st_size} bytes, sparse: shapes only, no weights)",
                             highlight=False, markup=False)
        return
    cfg = tiny_model.TinyConfig(weights=weights, seed=seed, idx_heads=idx_heads, idx_dim=int(idx_dim), top_k=top_k,
                                mtp=mtp)
    try:
        path = engine.write_tiny_model(cfg, out, settings.Settings.from_env(), log=output.note, build_missing=True)
    except OSError as e:  # --out in a folder that cannot be made or written
        raise DflashError(f"cannot write {out}: {e.strerror or e}") from None
    digest = sha256_file(path)
    types = gguf_meta.read(path).weight_types
    if as_json:
        output.emit_json({"path": str(path), "weights": weights, "seed": seed, "sha256": digest,
                          "bytes": path.stat().st_size, "tensor_types": types,
                          "indexer": {"heads": idx_heads, "dim": int(idx_dim), "top_k": top_k},
                          "nextn_layers": int(mtp)})
    else:
        output.out.print(f"{path}  ({path.stat().st_size} bytes, sha256 {digest})", highlight=False, markup=False)
        output.out.print("tensor types: " + ", ".join(f"{k} {n}" for k, n in types.items()),
                         highlight=False, markup=False)
