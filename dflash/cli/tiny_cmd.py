"""`dflash tiny-model`: write the built-in tiny DeepSeek-V4 GGUF."""
from __future__ import annotations

import hashlib
from pathlib import Path

import click

from .. import engine, gguf_meta, tiny_model
from ..errors import DflashError
from . import output
from .options import Command


def _out_path(ctx, param, value):
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
@click.option("--out", default=None, callback=_out_path,
              help="Output file [default: the user cache, reused by every command].")
@click.option("--weights", type=click.Choice(tiny_model.WEIGHTS), default=tiny_model.DEFAULT_WEIGHTS,
              show_default=True, help="Weight types (mxfp4: Q8_0 dense, MXFP4 experts, BF16 embeddings; "
              "q4_k_m, q6_k: the f32 model through llama.cpp's quantizer, which loads the exact library).")
@click.option("--seed", type=click.IntRange(0, tiny_model.SEED_MAX), default=1234, show_default=True,
              help="Seed of the random weights.")
@click.option("--json", "as_json", is_flag=True)
def command(out, weights, seed, as_json):
    """Write the deterministic tiny DeepSeek-V4 model."""
    cfg = tiny_model.TinyConfig(weights=weights, seed=seed)
    try:
        path = engine.write_tiny_model(cfg, out, log=output.note)
    except OSError as e:  # --out in a folder that cannot be made or written
        raise DflashError(f"cannot write {out}: {e.strerror or e}") from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    types = gguf_meta.read(path).weight_types
    if as_json:
        output.emit_json({"path": str(path), "weights": weights, "seed": seed, "sha256": digest,
                          "bytes": path.stat().st_size, "tensor_types": types})
    else:
        output.out.print(f"{path}  ({path.stat().st_size} bytes, sha256 {digest})", highlight=False, markup=False)
        output.out.print("tensor types: " + ", ".join(f"{k} {n}" for k, n in types.items()),
                         highlight=False, markup=False)
