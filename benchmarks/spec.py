"""Decode speed with and without llama-server's speculative decoding, exact vs stock, side by side.

    .venv/bin/python benchmarks/spec.py --model gemma                 # Gemma 3 270M (the test extra's GGUF)
    .venv/bin/python benchmarks/spec.py --model M.gguf --spec ngram --rounds 5 --json out.json

Four llama-servers stay up (exact and stock library, each without and with `--spec`, the
configuration `dflash serve` runs at --parallel 1), but only one computes at a time. Workloads:
`repeat`, prompts whose answer repeats them (a code listing and a renaming in it: an edit that
keeps most of the text, what n-gram drafts predict), and `text`, ordinary prompts whose answer
repeats little. Each round sends every prompt of a workload to the four servers in turn, the
order rotating prompt by prompt, so the figures of a pair are taken seconds apart. Decode speed is
llama-server's own (timings: generated tokens / decode time of that response); per arm the median
over the rounds' prompts, per library the median of the paired ratios (with / without
speculation), the acceptance rate (accepted / drafted tokens), and whether each speculative
response's token ids and logprobs equal those of the same library's plain server. Not a test:
nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_variants import gemma_path  # noqa: E402
from dflash import serve as ds  # noqa: E402
from dflash.core.fileio import write_atomic  # noqa: E402
from dflash.serving import client, serve_config  # noqa: E402
from dflash.serving import serve_workload as wl  # noqa: E402

NAMES = ("alpha", "bravo", "delta", "gamma", "omega", "sigma", "theta", "kappa", "lambda", "zeta")


def repeat_prompts(n: int, seed: int) -> list[str]:
    """Code-editing prompts: a small module, then a renaming whose answer repeats most of it."""
    out = []
    for i in range(n):
        a, b = NAMES[(seed + i) % len(NAMES)], NAMES[(seed + 3 * i + 1) % len(NAMES)]
        code = (f"def {a}_total(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n\n"
                f"def {b}_count(values, wanted):\n    count = 0\n    for v in values:\n        if v == wanted:\n"
                f"            count += 1\n    return count\n\n"
                f"def {a}_{b}_mean(values):\n    return {a}_total(values) / len(values)\n")
        c = NAMES[(seed + 5 * i + 2) % len(NAMES)]
        ask = f"Rewrite the code above with the name {a if i % 2 else b} changed to {c}:\n"
        out.append(f"{code}\n{ask}")
    return out


def text_prompts(n: int, seed: int) -> list[str]:
    return [f"Write a short story about {wl.words(6, seed + i)}." for i in range(n)]


def _one(url: str, prompt: str, max_tokens: int) -> dict:
    r = client.post(url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                              "logprobs": 1}, timeout=600)
    if r.status != 200 or not isinstance(r.body, dict):
        raise SystemExit(f"spec.py: HTTP {r.status}: {r.text[:200]}")
    t = r.body.get("timings") or {}
    lps = ((r.body["choices"][0].get("logprobs") or {}).get("content")) or []
    return {"tokens": r.body["dflash"]["response_tokens"], "logprobs": [(e["id"], e["logprob"]) for e in lps],
            "decode_tps": float(t.get("predicted_per_second") or 0.0), "predicted": int(t.get("predicted_n") or 0),
            "drafted": int(t.get("draft_n", 0)), "accepted": int(t.get("draft_n_accepted", 0))}


def bench(a: argparse.Namespace) -> dict:
    arms = [(lib, spec) for lib in ("exact", "stock") for spec in (serve_config.NO_SPEC, a.spec)]
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        urls = {}
        for lib, spec in arms:
            target = ds.target(a.model, lib=lib, build_missing=True)
            config = serve_config.ServeConfig(1, a.ubatch, a.ctx, a.threads, target.flash_attn, spec=spec)
            urls[(lib, spec)] = stack.enter_context(target.server(config)).url
        for workload, make in (("repeat", repeat_prompts), ("text", text_prompts)):
            if workload not in a.workloads.split(","):
                continue
            for r in range(a.rounds):
                for i, prompt in enumerate(make(a.prompts, 100 * r)):
                    k = (r * a.prompts + i) % len(arms)
                    got = {arm: _one(urls[arm], prompt, a.max_tokens) for arm in arms[k:] + arms[:k]}
                    for lib in ("exact", "stock"):
                        plain, fast = got[(lib, serve_config.NO_SPEC)], got[(lib, a.spec)]
                        rows.append({"workload": workload, "round": r, "prompt": i, "lib": lib,
                                     "plain_tps": plain["decode_tps"], "spec_tps": fast["decode_tps"],
                                     "tokens": len(plain["tokens"]), "drafted": fast["drafted"],
                                     "accepted": fast["accepted"],
                                     "identical": (plain["tokens"], plain["logprobs"]) ==
                                                  (fast["tokens"], fast["logprobs"])})
                    print(f"{workload} round {r} prompt {i}: " + "  ".join(
                        f"{x['lib']} {x['plain_tps']:.1f} -> {x['spec_tps']:.1f} tok/s ({x['accepted']}/{x['drafted']}"
                        f"{'' if x['identical'] else ', DIFFERENT'})" for x in rows[-2:]), flush=True)
    summary = []
    for workload in a.workloads.split(","):
        for lib in ("exact", "stock"):
            rs = [x for x in rows if x["workload"] == workload and x["lib"] == lib]
            drafted, accepted = sum(x["drafted"] for x in rs), sum(x["accepted"] for x in rs)
            summary.append({"workload": workload, "lib": lib, "responses": len(rs),
                            "plain_tps": statistics.median(x["plain_tps"] for x in rs),
                            "spec_tps": statistics.median(x["spec_tps"] for x in rs),
                            "speedup": statistics.median(x["spec_tps"] / x["plain_tps"] for x in rs if x["plain_tps"]),
                            "acceptance_rate": accepted / drafted if drafted else None,
                            "identical": sum(x["identical"] for x in rs)})
    return {"model": a.model, "spec": a.spec, "host": platform.node(), "cpu": _cpu(), "threads": a.threads,
            "ubatch": a.ubatch, "max_tokens": a.max_tokens, "rounds": a.rounds, "prompts": a.prompts,
            "summary": summary, "rows": rows}


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma", help="a GGUF, or gemma (the test extra's Gemma 3 270M)")
    ap.add_argument("--spec", default="ngram")
    ap.add_argument("--workloads", default="repeat,text", help="repeat and/or text, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload and round")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the result here (atomically)")
    a = ap.parse_args()
    if a.model == "gemma":
        a.model = gemma_path()
    out = bench(a)
    print(f"\n{'workload':8s} {'library':7s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'speedup':>7s} "
          f"{'accepted':>8s} {'identical':>9s}")
    for s in out["summary"]:
        rate = f"{s['acceptance_rate']:.0%}" if s["acceptance_rate"] is not None else "n/a"
        print(f"{s['workload']:8s} {s['lib']:7s} {s['plain_tps']:11.1f} {s['spec_tps']:10.1f} {s['speedup']:6.2f}x "
              f"{rate:>8s} {s['identical']:>4d}/{s['responses']}")
    if a.json:
        write_atomic(Path(a.json), json.dumps(out, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
