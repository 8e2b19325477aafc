"""DeepSeek-V4 indexer tiles (--indexer-tile) and the raw window: memory and speed per (width, tile).

Memory: `dflash memory` (llama.cpp's no_alloc estimate) on DeepSeek-V4 Flash's shapes without
weights (`dflash tiny-model --ds4-flash-shapes`), per context, width and tile, beside the analytic
indexer-score term (pooled rows x min(width, tile) x 4 bytes). Speed: the tiny model with Flash's
indexer shape (64 heads of 128, top-k 256), a prompt of more than 2 x 2,048 tokens; each (width,
tile) is first qualified (`dflash qualify --indexer-tile T`: bit-identical to q1, the record the
run needs), then timed with `dflash prefill --chunk W --indexer-tile T` in rounds whose order
alternates, so that a machine whose speed drifts does not favour one pair. Every timed run's logits
hash must equal every other's: a tile changes no bit. Both run with the raw window (the exact
library's default: the raw cache's mask and K view span the cells a ubatch can see, patch 0008) and
with the whole raw cache (DFLASH_DS4_RAW_WINDOW=0, the library before that patch), side by side.

    .venv/bin/python benchmarks/indexer_tiles.py                     # the README's table
    .venv/bin/python benchmarks/indexer_tiles.py --rounds 7 --json out.json

Not a test: nothing is asserted beyond the hashes (the script exits 4 when one differs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash.core.fileio import write_atomic  # noqa: E402
from dflash.run import engine  # noqa: E402

WINDOW = "DFLASH_DS4_RAW_WINDOW"


def dflash(*args: object, window: int = 1) -> dict:
    cmd = [sys.executable, "-m", "dflash", *map(str, args), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, WINDOW: str(window)})
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} failed (rc={r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(r.stdout)


def pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        w, _, t = part.partition(":")
        out.append((int(w), int(t or 0)))
    return out


def memory_rows(flash: Path, contexts: list[int], widths: list[int], tiles: list[int],
                windows: list[int]) -> list[dict]:
    rows = []
    for ctx in contexts:
        for tile in tiles:
            for window in windows:
                m = dflash("memory", "--model", flash, "--ctx", ctx, "--widths", ",".join(map(str, widths)),
                           "--threads", "1", "--indexer-tile", tile, window=window)
                for r in m["rows"]:
                    if tile and r["width"] <= tile:
                        continue  # a tile as wide as the band is no tiling: the untiled row says it
                    rows.append({"ctx": ctx, "width": r["width"], "tile": tile, "raw_window": bool(window),
                                 "compute_bytes": r["compute_bytes"], "total_bytes": r["total_bytes"],
                                 "indexer_scores_bytes": r["indexer_scores_bytes"]})
    return rows


def speed_rows(model: Path, prompt: Path, todo: list[tuple[int, int]], windows: list[int], rounds: int,
               threads: int) -> tuple[list, bool]:
    runs = [(w, t, window) for w, t in todo for window in windows]
    times: dict[tuple[int, int, int], list[float]] = {p: [] for p in runs}
    hashes = set()
    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for w, t, window in order:
            d = dflash("prefill", "--model", model, "--prompt-file", prompt, "--chunk", w, "--indexer-tile", t,
                       "--n-predict", "0", "--threads", threads, window=window)
            times[(w, t, window)].append(d["prefill_tokens_per_second"])
            hashes.add(d["logits_sha256"])
            print(f"round {r + 1}/{rounds}: width {w}, tile {t}, raw window {'on' if window else 'off'}: "
                  f"{d['prefill_tokens_per_second']:.0f} tok/s", file=sys.stderr)
    rows = [{"width": w, "tile": t, "raw_window": bool(window),
             "prefill_tok_s": statistics.median(times[(w, t, window)]), "runs": times[(w, t, window)]}
            for w, t, window in runs]
    return rows, len(hashes) == 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="131072,1048576", help="Contexts sized on Flash's shapes.")
    ap.add_argument("--widths", default="256,512,2048", help="Widths sized on Flash's shapes.")
    ap.add_argument("--tiles", default="0,128,256", help="Tiles sized on Flash's shapes (0: untiled).")
    ap.add_argument("--pairs", default="512:0,512:128,2048:0,2048:256", help="(width:tile) pairs timed.")
    ap.add_argument("--windows", default="1,0", help="The raw window on (1, the default) and off (0, the whole cache).")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="Write every figure here (atomically).")
    a = ap.parse_args()
    todo = pairs(a.pairs)
    windows = [int(x) for x in a.windows.split(",")]
    with tempfile.TemporaryDirectory(prefix="dflash-tiles-") as tmp:
        work = Path(tmp)
        flash = work / "flash-shapes.gguf"
        dflash("tiny-model", "--ds4-flash-shapes", "--out", flash)
        mem = memory_rows(flash, [int(c) for c in a.contexts.split(",")], [int(w) for w in a.widths.split(",")],
                          [int(t) for t in a.tiles.split(",")], windows)
        model = work / "tiny-flash-indexer.gguf"
        dflash("tiny-model", "--idx-heads", 64, "--idx-dim", 128, "--top-k", 256, "--out", model)
        prompt = work / "prompt.txt"
        prompt.write_text(engine.DEFAULT_PROMPT * 12)
        proofs = []
        for window in windows:  # the whole raw cache is keyed apart in records: each mode is qualified
            for tile in sorted({t for _, t in todo}):
                widths = ",".join(str(w) for w, t in todo if t == tile)
                q = dflash("qualify", "--model", model, "--prompt-file", prompt, "--widths", widths,
                           "--indexer-tile", tile, "--threads", a.threads, "--n-predict", "4",
                           "--evidence", work / f"qualify-{tile}-{window}", window=window)
                proofs.append({"tile": tile, "raw_window": bool(window), "widths": widths, "all_exact": q["all_exact"],
                               "n_tokens": q["n_tokens"], "logits_sha256": q["reference"]["logits_sha256"]})
                print(f"qualify tile {tile}, raw window {'on' if window else 'off'}, widths {widths}: "
                      f"all exact {q['all_exact']} ({q['n_tokens']} tokens)", file=sys.stderr)
        speed, same = speed_rows(model, prompt, todo, windows, a.rounds, a.threads)
    out = {"memory": mem, "qualify": proofs, "speed": speed, "identical": same}
    print("| context | width | tile | raw window | compute | indexer scores (analytic) |\n|---|---|---|---|---|---|")
    for r in mem:
        print(f"| {r['ctx']:,} | {r['width']} | {r['tile'] or '-'} | {'on' if r['raw_window'] else 'off'} | "
              f"{r['compute_bytes'] / 2**20:,.1f} MiB | {r['indexer_scores_bytes'] / 2**20:,.1f} MiB |")
    print("\n| width | tile | raw window | prefill tok/s (median) |\n|---|---|---|---|")
    for r in speed:
        on = "on" if r["raw_window"] else "off"
        print(f"| {r['width']} | {r['tile'] or '-'} | {on} | {r['prefill_tok_s']:.0f} |")
    print(f"\nevery timed run bit-identical: {same}; every qualification exact: "
          f"{all(p['all_exact'] for p in proofs)}")
    if a.json:
        write_atomic(a.json, (json.dumps(out, indent=2) + "\n").encode())
    if not same or not all(p["all_exact"] for p in proofs):
        sys.exit(4)


if __name__ == "__main__":
    main()
