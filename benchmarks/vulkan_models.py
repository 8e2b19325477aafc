"""The full model-level exactness run on a Vulkan device (CI runs a subset, tests/test_vulkan.py):
every tiny DeepSeek-V4 preset and Gemma 3 270M Q4_K_M, each prefilled cache-cold in fixed-width
bands of every width over one prompt (tests/variant_prefill.py, one process per model and library),
and every width compared with q1 bit for bit (every position's logits and the response).

    .venv/bin/python benchmarks/vulkan_models.py                          # widths 2..64 over 80 tokens, 512 over 520
    .venv/bin/python benchmarks/vulkan_models.py --models q4_k_m,gemma --no-wide --json out.json
    .venv/bin/python benchmarks/vulkan_models.py --lib stock               # the stock twin: expect differences

One line per model and width group as it finishes, then a table; exits 4 when a width differs from
q1 (always expected with --lib stock), 0 otherwise. Not a test: it only reports.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_variants import gemma_path  # noqa: E402
from dflash.core.fileio import write_atomic  # noqa: E402
from dflash.core.paths import cache_root  # noqa: E402

PRESETS = ("f32", "f16", "q8_0", "q4_0", "q4_k_m", "q6_k", "mxfp4")


def tiny_model(weights: str, folder: Path) -> str:
    path = folder / f"tiny-{weights}.gguf"
    if not path.is_file():
        subprocess.run([sys.executable, "-m", "dflash", "tiny-model", "--weights", weights, "--out", str(path)],
                       check=True, capture_output=True, cwd=ROOT)
    return str(path)


def run_widths(model: str, widths: str, tokens: int, device: str, lib: str, threads: int) -> dict:
    """Fingerprints per width (q1 first) and whether each equals q1."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tests.variant_prefill", "--device", device, "--lib", lib,
                        "--widths", widths, "--tokens", str(tokens), "--threads", str(threads), model],
                       capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"widths": widths, "tokens": tokens, "error": f"rc={r.returncode}: {tail}", "seconds": seconds}
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    q1 = next(d for d in rows if d["width"] == 1)
    same = {d["width"]: (d["logits_sha256"], d["response_sha256"]) == (q1["logits_sha256"], q1["response_sha256"])
            for d in rows if d["width"] != 1}
    return {"widths": widths, "tokens": tokens, "identical_to_q1": same, "q1_logits_sha256": q1["logits_sha256"],
            "flash_attn": q1["flash_attn"], "seconds": seconds, "error": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join((*PRESETS, "gemma")),
                    help="tiny presets and/or gemma, comma-separated [default: all]")
    ap.add_argument("--widths", default="2,4,8,9,64", help="band widths over --tokens [default: 2,4,8,9,64]")
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--no-wide", action="store_true", help="leave out width 512 over 520 tokens")
    ap.add_argument("--device", default="vulkan:0")
    ap.add_argument("--lib", default="exact", choices=("exact", "stock"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models-dir", default=str(cache_root() / "models" / "vulkan-check"),
                    help="where the tiny presets are written once")
    ap.add_argument("--json", default=None, help="write every result here (atomically)")
    a = ap.parse_args()
    folder = Path(a.models_dir)
    folder.mkdir(parents=True, exist_ok=True)
    groups = [(f"1,{a.widths}", a.tokens)] + ([] if a.no_wide else [("1,512", 520)])
    results = []
    for name in a.models.split(","):
        if name != "gemma" and name not in PRESETS:
            print(f"vulkan_models: unknown model {name!r} (presets: {', '.join(PRESETS)}, or gemma)", file=sys.stderr)
            return 2
        model = gemma_path() if name == "gemma" else tiny_model(name, folder)
        for widths, tokens in groups:
            r = {"model": name, **run_widths(model, widths, tokens, a.device, a.lib, a.threads)}
            results.append(r)
            verdict = r["error"] or " ".join(f"w{w}:{'=' if ok else 'DIFF'}" for w, ok in r["identical_to_q1"].items())
            print(f"{name:7s} {tokens:4d} tokens  {verdict}  ({r['seconds']:.0f} s)", flush=True)
    if a.json:
        write_atomic(Path(a.json), json.dumps({"device": a.device, "lib": a.lib, "threads": a.threads,
                                               "results": results}, indent=1).encode())
    bad = [r for r in results if r["error"] or not all(r["identical_to_q1"].values())]
    print(f"{len(results) - len(bad)}/{len(results)} model runs identical to q1 at every width ({a.lib}, {a.device})")
    return 4 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
