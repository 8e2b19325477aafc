"""`dflash tiny-model`: write the built-in tiny DeepSeek-V4 GGUF."""
from __future__ import annotations

import hashlib

import click

from .. import engine as E
from .. import gguf_meta, tiny_model
from . import output


@click.command("tiny-model")
@click.option("--out", default=None, help="Output path [default: the user cache, reused by every command].")
@click.option("--weights", type=click.Choice(tiny_model.WEIGHTS), default=tiny_model.DEFAULT_WEIGHTS,
              show_default=True, help="Weight types (mxfp4: Q8_0 dense, MXFP4 experts, BF16 embeddings; "
              "q4_k_m, q6_k: the f32 model through llama.cpp's quantizer, which loads the exact library).")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(out, weights, seed, as_json):
    """Write the deterministic tiny DeepSeek-V4 model."""
    cfg = tiny_model.TinyConfig(weights=weights, seed=seed)
    path = E.write_tiny_model(cfg, out, log=output.note)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    types = gguf_meta.read(path).weight_types
    if as_json:
        output.emit_json({"path": str(path), "weights": weights, "seed": seed, "sha256": digest,
                          "bytes": path.stat().st_size, "tensor_types": types})
    else:
        output.out.print(f"{path}  ({path.stat().st_size} bytes, sha256 {digest})", highlight=False)
        output.out.print("tensor types: " + ", ".join(f"{k} {n}" for k, n in types.items()), highlight=False)
