"""`dflash tiny-model`: write the built-in tiny DeepSeek-V4 GGUF."""
from __future__ import annotations

import hashlib

import click

from .. import tiny_model
from . import output


@click.command("tiny-model")
@click.option("--out", default=None, help="Output path [default: the user cache, reused by every command].")
@click.option("--weights", type=click.Choice(tiny_model.WEIGHTS), default=tiny_model.DEFAULT_WEIGHTS,
              show_default=True, help="Weight types (mxfp4: Q8_0 dense, MXFP4 experts, BF16 embeddings).")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(out, weights, seed, as_json):
    """Write the deterministic tiny DeepSeek-V4 model."""
    cfg = tiny_model.TinyConfig(weights=weights, seed=seed)
    path = tiny_model.write(out, cfg) if out else tiny_model.ensure(cfg)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if as_json:
        output.emit_json({"path": str(path), "weights": weights, "seed": seed, "sha256": digest,
                          "bytes": path.stat().st_size})
    else:
        output.out.print(f"{path}  ({path.stat().st_size} bytes, sha256 {digest})", highlight=False)
