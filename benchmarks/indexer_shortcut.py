#!/usr/bin/env python3
"""The all-pooled indexer shortcut's gain: `dflash bench` with DFLASH_DS4_INDEXER_SHORTCUT on and
off, alternated (on, off, on, off, ...) so that both modes see the same machine state.

The library reads the flag once per process, so each bench is its own process; each bench is
already A/B/A (q1, the band arm, q1). Default model: the tiny DeepSeek-V4 model with a
DeepSeek-V4-shaped indexer (64 heads of 128, top-k 512) written by `dflash tiny-model`; the
prompt is repeated to --tokens (at most 2048: 512 pooled rows, every band within the top-k). A
width over 4 is qualified first, in each mode (a record is per mode). Prints, per width and mode,
the median over rounds of each bench's band-arm median and of its pooled q1 median, the ratio
on/off, and whether every request of every bench had the same logits SHA-256.

    .venv/bin/python benchmarks/indexer_shortcut.py [--widths 4,64] [--rounds 3] [--tokens 1900] [--json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"on": "1", "off": "0"}


def dflash(*args: str, mode: str) -> dict:
    env = {**os.environ, "DFLASH_DS4_INDEXER_SHORTCUT": MODES[mode]}
    r = subprocess.run([sys.executable, "-m", "dflash", *args, "--json"], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"dflash {' '.join(args)} ({mode}) failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF [default: tiny model, 64 indexer heads of 128, top-k 512]")
    ap.add_argument("--widths", default="4,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1900)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    widths = [int(w) for w in a.widths.split(",")]
    with tempfile.TemporaryDirectory(prefix="dflash-shortcut-bench-") as tmp:
        model = a.model or str(Path(tmp) / "tiny-indexer.gguf")
        if a.model is None:
            dflash("tiny-model", "--idx-heads", "64", "--idx-dim", "128", "--top-k", "512", "--out", model, mode="on")
        prompt = Path(tmp) / "prompt.txt"
        sentence = "The band scheduler keeps every compressor emission at the end of its band. "
        prompt.write_text(sentence * (a.tokens // 14 + 1))
        common = ["--model", model, "--prompt-file", str(prompt), "--threads", str(a.threads)]
        for mode in MODES:
            if max(widths) > 4:
                dflash("qualify", *common, "--widths", ",".join(map(str, sorted({1, 4, *widths}))),
                       "--n-predict", "2", "--evidence", str(Path(tmp) / f"q-{mode}"), mode=mode)
        results: dict = {w: {m: {"band": [], "q1": [], "logits": set()} for m in MODES} for w in widths}
        n_tokens = None
        for rnd in range(a.rounds):
            for w in widths:
                for mode in (MODES if rnd % 2 == 0 else reversed(list(MODES))):
                    d = dflash("bench", *common, "--chunk", str(w), "--warmup", "1", "--runs", str(a.runs),
                               "--n-predict", "2", "--evidence", str(Path(tmp) / f"b-{w}-{mode}-{rnd}"), mode=mode)
                    arms = {x["name"]: x["median"] for x in d["arms"]}
                    r = results[w][mode]
                    r["band"].append(arms["candidate"])
                    r["q1"].append(d["q1_pooled_median"])
                    r["logits"].add(d["logits_sha256"] if d["hashes_identical"] else "differs")
                    n_tokens = d["n_prompt_tokens"]
    rows = []
    for w in widths:
        on, off = results[w]["on"], results[w]["off"]
        row = {"width": w, "n_prompt_tokens": n_tokens,
               "on": {"band": statistics.median(on["band"]), "q1": statistics.median(on["q1"])},
               "off": {"band": statistics.median(off["band"]), "q1": statistics.median(off["q1"])},
               "identical": len(on["logits"] | off["logits"]) == 1 and "differs" not in on["logits"] | off["logits"]}
        row["gain_band"] = row["on"]["band"] / row["off"]["band"]
        row["gain_q1"] = row["on"]["q1"] / row["off"]["q1"]
        rows.append(row)
    if a.json:
        print(json.dumps({"rounds": a.rounds, "runs": a.runs, "threads": a.threads, "rows": rows}, indent=2))
    else:
        print(f"prefill tokens/s, median over {a.rounds} rounds of bench medians, {n_tokens} tokens, "
              f"{a.threads} threads")
        print("width  q1 on  q1 off  q1 gain  band on  band off  band gain  identical")
        for r in rows:
            print(f"{r['width']:>5}  {r['on']['q1']:6.0f}  {r['off']['q1']:6.0f}  {r['gain_q1']:6.3f}x  "
                  f"{r['on']['band']:7.0f}  {r['off']['band']:8.0f}  {r['gain_band']:8.3f}x  {r['identical']}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
