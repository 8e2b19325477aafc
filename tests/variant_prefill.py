"""Child process of tests/test_cpu_variants.py and tests/test_vulkan.py: one library (flavor, CPU
variant, device) in one process, every model given, each prefilled cache-cold in fixed-width bands
of every width; prints one JSON line per model and width with the fingerprints of every position's
logits and of the response.

    python -m tests.variant_prefill --cpu avx2 --lib exact --widths 1,4,64,512 --threads 2 M1.gguf M2.gguf
    python -m tests.variant_prefill --device vulkan:0 --lib exact --widths 1,9 --tokens 40 --threads 2 M.gguf
"""
from __future__ import annotations

import argparse
import json

from dflash import session
from dflash.compare import sweep
from dflash.core import settings
from dflash.run import engine

N_PREDICT = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", default=None)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--widths", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=0, help="prompt tokens (default: the widest width + 8)")
    ap.add_argument("models", nargs="+")
    a = ap.parse_args()
    widths = [int(w) for w in a.widths.split(",")]
    flags = settings.Settings.from_env({}, cpu=a.cpu, lib=a.lib)
    n = a.tokens or max(widths) + 8
    for model in a.models:
        with session.Session(model, lib=a.lib, settings=flags, threads=a.threads, device=a.device) as s:
            tokens = sweep.repeat_to(s.tokenize, engine.DEFAULT_PROMPT, n)[1][:n]
            for w in widths:
                r = s.prefill(tokens, schedule=f"w{w}", n_predict=N_PREDICT, logits="all",
                              ctx=len(tokens) + N_PREDICT)
                print(json.dumps({"model": model, "width": w, "n_tokens": len(tokens), "library": r.library.to_json(),
                                  "widths_run": sorted(set(r.widths)), "logits_sha256": r.logits_sha256,
                                  "response_sha256": r.response_sha256,
                                  "devices": [d["id"] for d in r.devices],
                                  "flash_attn": {None: "auto", True: "on", False: "off"}[s.engine.flash_attn]}),
                      flush=True)


if __name__ == "__main__":
    main()
