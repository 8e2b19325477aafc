"""Exact vs stock llama-server, side by side: throughput, time to first token, cache hits, and the
share of responses identical to their solo cold run.

    .venv/bin/python benchmarks/serve.py                       # built-in tiny DeepSeek-V4 model
    .venv/bin/python benchmarks/serve.py --model M.gguf --requests 8 --json out.json
    .venv/bin/python benchmarks/serve.py --probe-only --rounds 3      # the cache-hit probe alone

Both libraries' llama-servers run at once (the configuration `dflash serve` runs: --parallel P,
-b/-ub U, one KV stream per slot, prompt cache on), but only one computes at a time: for each
concurrency and each prompt mode (`shared`: every prompt is the same ~N-token prefix plus its own
suffix; `unique`: prompts of the same length with nothing in common), R streamed greedy completions of T tokens are
sent by `concurrency` client threads. Timing window: from the first request sent to the last
answer read. Reported: generated tokens/s (all completion tokens / window), prompt tokens/s
(prompt tokens the server evaluated, cached ones excluded / window), time to first token p50/p95
(first streamed token), and the share of responses identical (token ids, logprobs, last-position
logits fingerprint) to the same request run alone with the prompt cache off on the same server.
Then the cache-hit probe, each request alone: an N-token prompt cold (cache off), the same prompt
again (a full-prompt cache hit), the same prefix with a new suffix (a shared-prefix hit): first-
token times and their ratios to the cold runs. Each row runs on one library and then at once on
the other (the order alternating row by row and round by round), so the two figures of a pair are
taken seconds apart: a shared machine's speed drifts by tens of percent over the minutes a whole
pass takes. `--rounds` rounds (new prompts each) give medians per row, and per row the median of
the rounds' paired ratios. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash import serve as ds  # noqa: E402
from dflash.core import settings  # noqa: E402
from dflash.core.fileio import write_atomic  # noqa: E402
from dflash.serving import serve_config  # noqa: E402
from dflash.serving import serve_workload as wl  # noqa: E402


def _calls(mode: str, n: int, prefix_words: int, max_tokens: int, seed: int) -> list[wl.Call]:
    """n prompts of one row: `seed` is the row's own (no prompt of one row reappears in another)."""
    out = []
    for i in range(n):
        prefix = wl.words(prefix_words, seed) if mode == "shared" else wl.words(prefix_words, seed + 1 + i)
        body = {"prompt": f"{prefix} {wl.words(8 + i % 5, seed + 500 + i)}", "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 1}
        out.append(wl.Call(f"{mode}-{i}", wl.COMPLETIONS, body, stream=True))
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _load(url: str, calls: list[wl.Call], concurrency: int) -> tuple[list[wl.Response], float]:
    """The calls through `concurrency` client threads (a shared queue); answers and the window."""
    out: list[wl.Response | None] = [None] * len(calls)
    nxt = [0]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(calls):
                return
            out[i] = wl.send(url, calls[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in out if r is not None], time.perf_counter() - t0


def _cache_probe(url: str, prefix_words: int, max_tokens: int, seed: int) -> dict:
    """First-token times alone on the server: the prompt cold (cache off), the same prompt again (a
    full-prompt cache hit) and the same prefix with a new 8-word suffix (a shared-prefix hit)."""
    prefix = wl.words(prefix_words, seed + 7777)

    def call(prompt: str) -> wl.Call:
        return wl.Call("probe", wl.COMPLETIONS, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                       stream=True)
    first = call(f"{prefix} {wl.words(8, 1)}")
    cold = wl.send(url, first, extra={"cache_prompt": False})
    wl.send(url, first)  # a cold evaluation that leaves its KV (and checkpoints) in the slot
    repeat = wl.send(url, first)
    sibling = wl.send(url, call(f"{prefix} {wl.words(8, 2)}"))
    sibling_cold = wl.send(url, call(f"{prefix} {wl.words(8, 2)}"), extra={"cache_prompt": False})

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None
    return {"prompt_tokens": cold.prompt_tokens, "cold_ttft_s": cold.first_token_seconds,
            "repeat_ttft_s": repeat.first_token_seconds, "repeat_cached_tokens": repeat.cached_tokens,
            "repeat_speedup": ratio(cold.first_token_seconds, repeat.first_token_seconds),
            "repeat_identical_to_cold": repeat.same_as(cold),
            "sibling_ttft_s": sibling.first_token_seconds, "sibling_cached_tokens": sibling.cached_tokens,
            "sibling_speedup": ratio(sibling_cold.first_token_seconds, sibling.first_token_seconds),
            "sibling_identical_to_cold": sibling.same_as(sibling_cold)}


def _row(url: str, lib: str, mode: str, conc: int, seed: int, a: argparse.Namespace) -> dict:
    """One row on one server: the load, then every call of it alone with the cache off."""
    row_seed = seed * 1_000_000 + conc * 10_000 + (0 if mode == "shared" else 5_000)
    calls = _calls(mode, a.requests, a.prefix_words, a.max_tokens, row_seed)
    got, window = _load(url, calls, conc)
    solo = {c.key(): wl.send(url, wl.Call(c.name, c.endpoint, c.body), extra={"cache_prompt": False}) for c in calls}
    ok = [r for r in got if r.status == 200]
    same = sum(r.same_as(solo[c.key()]) for c, r in zip(calls, got, strict=True))
    ttft = [r.first_token_seconds for r in ok if r.first_token_seconds is not None]
    row = {"lib": lib, "mode": mode, "concurrency": conc, "requests": len(calls), "ok": len(ok), "window_s": window,
           "generated_tok_s": sum(len(r.tokens) for r in ok) / window,
           "prompt_tok_s": sum(r.prompt_tokens - r.cached_tokens for r in ok) / window,
           "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
           "cached_tokens": sum(r.cached_tokens for r in ok),
           "identical_to_solo": same, "identical_share": same / len(calls)}
    print(json.dumps(row), file=sys.stderr)
    return row


def bench_round(libs: list[str], urls: dict[str, str], r: int, a: argparse.Namespace) -> list[dict]:
    """One round: every row on every library back to back (their order alternating row by row and
    round by round, so a pair of rows is measured seconds apart), then each library's cache probe.
    Each round has prompts of its own (the servers live on, and a prompt of an earlier round would be
    a cache hit); within a round both libraries get the same ones."""
    seed = a.seed + 100 * r
    rows: dict[str, list[dict]] = {lib: [] for lib in libs}
    pairs = [(mode, conc) for mode in a.modes for conc in a.concurrency]
    for i, (mode, conc) in enumerate(pairs):
        for lib in (libs if (r + i) % 2 == 0 else libs[::-1]):
            rows[lib].append(_row(urls[lib], lib, mode, conc, seed, a))
    out = []
    for lib in libs:
        probe = _cache_probe(urls[lib], a.probe_words or a.prefix_words, a.max_tokens, seed)
        print(json.dumps({"lib": lib, "cache_probe": probe}), file=sys.stderr)
        out.append({"lib": lib, "rows": rows[lib], "cache_probe": probe})
    return out


def bench(libs: list[str], a: argparse.Namespace) -> list[list[dict]]:
    """Both libraries' servers up at once (one computes at a time: the rows run one after another),
    `a.rounds` rounds; per round and library its rows and cache probe."""
    config = serve_config.ServeConfig(a.parallel, a.ubatch, a.ctx, a.threads)
    with contextlib.ExitStack() as stack:
        urls, meta = {}, {}
        for lib in libs:
            target = ds.target(a.model, lib=lib, device=a.device, extra=a.extra,
                               settings=settings.Settings.from_env(lib=lib), build_missing=True,
                               log=lambda s, lib=lib: print(f"[{lib}] {s}", file=sys.stderr))
            lib_config = replace(config, flash_attn=target.flash_attn)  # as dflash serve runs each library
            urls[lib] = stack.enter_context(target.server(lib_config)).url
            wl.send(urls[lib], wl.Call("warm", wl.COMPLETIONS, {"prompt": "warm up", "max_tokens": 4,
                                                                 "temperature": 0}))
            meta[lib] = {"config": lib_config.to_json(), "device": target.check.device_label,
                         "fingerprint": target.check.fingerprint, "model": target.check.model}
        return [[{**res, **meta[res["lib"]]} for res in bench_round(libs, urls, r, a)] for r in range(a.rounds)]


def _median_rows(runs: list[dict]) -> dict:
    """One library's rounds: per row the median of each rate and time, identical counts summed;
    the cache probe's times are medians too (its identical flags: all rounds)."""
    med = statistics.median
    rows = []
    for i, first in enumerate(runs[0]["rows"]):
        same = [r["rows"][i] for r in runs]
        row = {**first, **{k: med(x[k] for x in same) for k in ("generated_tok_s", "prompt_tok_s", "window_s",
                                                                 "ttft_p50_s", "ttft_p95_s")},
               "requests": sum(x["requests"] for x in same), "identical_to_solo": sum(x["identical_to_solo"]
                                                                                     for x in same)}
        rows.append(row)
    probes = [r["cache_probe"] for r in runs]
    probe = {**probes[0], **{k: med(p[k] for p in probes) for k in probes[0] if k.endswith(("_s", "_speedup"))},
             **{k: all(p[k] for p in probes) for k in probes[0] if k.endswith("_to_cold")}}
    return {**runs[0], "rows": rows, "cache_probe": probe}


def _paired(rounds: list[list[dict]], libs: list[str]) -> list[dict]:
    """Per row: the first library's generated tokens/s over the second's, in each round (the two
    rows of a round taken back to back), their median, and the ratio of the two medians."""
    out = []
    for i, first in enumerate(rounds[0][0]["rows"]):
        by = [{res["lib"]: res["rows"][i]["generated_tok_s"] for res in rnd} for rnd in rounds]
        ratios = [b[libs[0]] / b[libs[1]] for b in by]
        out.append({"mode": first["mode"], "concurrency": first["concurrency"], "paired_ratios": ratios,
                    "median_paired_ratio": statistics.median(ratios),
                    "ratio_of_medians": statistics.median(b[libs[0]] for b in by)
                    / statistics.median(b[libs[1]] for b in by)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF model [default: the built-in tiny DeepSeek-V4 model]")
    ap.add_argument("--libs", default="exact,stock")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--modes", default="shared,unique")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-words", type=int, default=1000, help="words of each prompt's prefix")
    ap.add_argument("--probe-words", type=int, default=None,
                    help="words of the cache-hit probe's prompt [default: --prefix-words]")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or vulkan:N (what dflash serve --device takes)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="rounds (new prompts each; library order alternating)")
    ap.add_argument("--probe-only", action="store_true", help="only the cache-hit probe (no load rows)")
    ap.add_argument("--json", dest="json_out", default=None, help="write all rows to this file")
    ap.add_argument("extra", nargs="*", help="llama-server options after --")
    a = ap.parse_args()
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    a.modes = [] if a.probe_only else a.modes.split(",")
    libs = a.libs.split(",")
    rounds = bench(libs, a)
    results = [_median_rows([res for rnd in rounds for res in rnd if res["lib"] == lib]) for lib in libs]
    print(f"medians over {a.rounds} round(s), libraries alternating; identical counts summed over rounds")
    print("| lib | prompts | conc | gen tok/s | prompt tok/s | TTFT p50 | TTFT p95 | identical to solo |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {r['lib']} | {r['mode']} | {r['concurrency']} | {r['generated_tok_s']:.0f} | "
                  f"{r['prompt_tok_s']:.0f} | {r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | "
                  f"{r['identical_to_solo']}/{r['requests']} |")
    paired = _paired(rounds, libs) if len(libs) == 2 else []
    for p in paired:
        print(f"{p['mode']} c{p['concurrency']}: {libs[0]}/{libs[1]} generated tok/s {p['ratio_of_medians']:.3f} "
              f"(median of the rounds' paired ratios {p['median_paired_ratio']:.3f}: "
              f"{', '.join(f'{x:.2f}' for x in p['paired_ratios'])})")
    for res in results:
        p = res["cache_probe"]
        print(f"{res['lib']}: {p['prompt_tokens']}-token prompt, first token cold {p['cold_ttft_s']:.3f} s; "
              f"repeated (cache hit, {p['repeat_cached_tokens']} cached) {p['repeat_ttft_s']:.3f} s = "
              f"{p['repeat_speedup']:.1f}x, identical {p['repeat_identical_to_cold']}; same prefix, new suffix "
              f"({p['sibling_cached_tokens']} cached) {p['sibling_ttft_s']:.3f} s = {p['sibling_speedup']:.1f}x, "
              f"identical {p['sibling_identical_to_cold']}")
    if a.json_out:
        write_atomic(a.json_out, (json.dumps({"medians": results, "paired": paired, "rounds": rounds}, indent=2)
                                  + "\n").encode())


if __name__ == "__main__":
    main()
