"""Helper run by tests/test_ds4_long_context.py in its own process (the library reads
DFLASH_DS4_INDEXER_SHORTCUT once): decode a prompt in bands of 4 and print, as JSON, the start of
every band whose graph ran the indexer's top-k (a node named lid_top_k-N).

    python tests/ds4_indexer_nodes.py MODEL N_TOKENS
"""
import json
import sys

from dflash import engine, llama, settings


def main(model: str, n: int) -> None:
    eng = engine.open_engine(settings.from_env(bands=True), model, threads=2)
    tokens = (eng.tokenize(engine.DEFAULT_PROMPT * 20))[:n]
    if len(tokens) < n:
        raise SystemExit(f"the prompt has {len(tokens)} tokens, fewer than {n}")
    tap = llama.GraphTap(lambda name: name.startswith("lid_top_k"))
    with eng, eng.context(n + 4, 4, eval_callback=tap.callback) as ctx:
        ran = []
        for p in range(0, n, 4):
            ctx.decode(tokens[p:p + 4], p, "none")
            if tap.take():
                ran.append(p)
    print(json.dumps({"indexer_shortcut": eng.indexer_shortcut, "bands_with_top_k": ran}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
