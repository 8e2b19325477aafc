"""Helper run by tests/test_ds4_long_context.py in its own process (the library reads
DFLASH_DS4_INDEXER_SHORTCUT, DFLASH_DS4_INDEXER_TILE and DFLASH_DS4_RAW_WINDOW when it loads):
decode a prompt in bands of WIDTH (default 4) and print, as JSON, the start of every band whose
graph ran the indexer's top-k (a node named lid_top_k-N), of every band whose top-k ran in tiles
(lid_top_k_tiled-N), and per band the raw cache cells its attention read (csa_raw_k-N's cells).

    python tests/ds4_indexer_nodes.py MODEL N_TOKENS [WIDTH]
"""
import json
import sys

from dflash.core import settings
from dflash.native import llama
from dflash.run import engine


def main(model: str, n: int, width: int) -> None:
    eng = engine.open_engine(settings.from_env(bands=True), model, threads=2)
    tokens = (eng.tokenize(engine.DEFAULT_PROMPT * 20))[:n]
    if len(tokens) < n:
        raise SystemExit(f"the prompt has {len(tokens)} tokens, fewer than {n}")
    tap = llama.GraphTap(lambda name: name.startswith(("lid_top_k", "csa_raw_k")))
    with eng, eng.context(n + 4, width, eval_callback=tap.callback) as ctx:
        ran, tiled, raw_cells = [], [], []
        for p in range(0, n, width):
            ctx.decode(tokens[p:p + width], p, "none")
            nodes = tap.take()
            names = [node[0] for node in nodes]
            raw_cells.append(max(node[2][2] for node in nodes if node[0].startswith("csa_raw_k")))
            if any(name.startswith("lid_top_k") for name in names):
                ran.append(p)
            if any(name.startswith("lid_top_k_tiled") for name in names):
                tiled.append(p)
    print(json.dumps({"indexer_shortcut": eng.indexer_shortcut, "indexer_tile": eng.indexer_tile,
                      "bands_with_top_k": ran, "bands_with_tiles": tiled, "raw_cells": raw_cells}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 4)
