#!/usr/bin/env python3
"""Side-by-side prefill speed of q1 and band caps 2..4 in one process, one context.

Requests are interleaved round-robin (q1, c2, c3, c4, q1, ...), each cache-cold; the timing
window is the band loop of one request (every llama_decode of the prompt, plus copying and
hashing its logits). Prints median and MAD of tokens/s per arm, the ratio of each median to the
q1 median, and whether every request produced the same logits and response SHA-256.

    .venv/bin/python benchmarks/chunk_sweep.py [--model PATH] [--runs 7] [--threads 2] [--json]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash import Session
from dflash.core import settings as S
from dflash.core import stats
from dflash.run import prefill as P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="mxfp4")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--caps", default="1,2,3,4", help="1 means q1")
    ap.add_argument("--lib", default="exact", choices=S.LIBS)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    session = Session(a.model, weights=a.weights, lib=a.lib, bands=True, chunk=4, threads=a.threads,
                      settings=S.Settings.from_env(lib=a.lib), build=True)
    eng = session.engine
    tokens = session.tokenize()
    caps = [int(c) for c in a.caps.split(",")]
    plans = {c: eng.request_bands(len(tokens), cap=c, bands_on=c > 1) for c in caps}
    ctx = session.context(len(tokens) + 4, max(caps))
    tps = {c: [] for c in caps}
    hashes = set()
    for i in range(a.warmup + a.runs):
        for c in caps:
            r = P.run(ctx, P.Request(tokens, plans[c], 4))
            hashes.add((r.logits_sha256, r.response_sha256))
            if i >= a.warmup:
                tps[c].append(r.prefill_tokens_per_second)
    q1 = stats.median(tps[caps[0]])
    rows = [{"cap": c, **stats.summarize(tps[c]), "ratio_vs_first": stats.median(tps[c]) / q1} for c in caps]
    out = {"n_prompt_tokens": len(tokens), "threads": eng.threads, "library": a.lib,
           "model": eng.info.path, "arms": rows, "hashes_identical": len(hashes) == 1}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{len(tokens)} tokens, {eng.threads} threads, {a.lib} library, {a.runs} runs per arm (interleaved)")
        print(f"{'cap':>4} {'median tok/s':>13} {'MAD':>7} {'ratio':>7}")
        for r in rows:
            print(f"{r['cap']:>4} {r['median']:>13.1f} {r['mad']:>7.1f} {r['ratio_vs_first']:>6.2f}x")
        print("hashes identical across every request:", out["hashes_identical"])
    return 0 if out["hashes_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
