"""DeepSeek-V4 prompt-cache reuse on llama-server, before and after server patch 0005, side by side.

    .venv/bin/python benchmarks/reuse.py --before ~/.cache/dflash/llama-server/KEY/bin/llama-server

Two llama-servers run the built-in tiny DeepSeek-V4 model on the exact library (the configuration
`dflash serve` runs, --parallel 4): `--before`, an older llama-server build (its own libraries
beside it), and the current one. For each prompt length, each round (new words every round) sends
to one server and then the other: the prompt cold (cache off), the prompt (cold, leaving its
checkpoints), the same prompt again (a repeat), and a second turn (the prompt, the response's token
ids, a new question). Reported per server: cached tokens and time to first token (streamed) of the
repeat and the second turn, medians over the rounds, and whether each equals its cold run (token
ids, logprobs, fingerprints). Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash import serve as ds  # noqa: E402
from dflash.core.fileio import write_atomic  # noqa: E402
from dflash.serving import client  # noqa: E402
from dflash.serving import serve_workload as wl  # noqa: E402


def _ids(url: str, text: str) -> list[int]:
    return [int(t) for t in client.post(url + "/tokenize", {"content": text}).body["tokens"]]


def _call(name: str, ids: list[int], n: int) -> wl.Call:
    return wl.Call(name, wl.COMPLETIONS, {"prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": 2},
                   stream=True)


def one_round(url: str, n_words: int, seed: int, n: int) -> dict:
    ids = _ids(url, wl.words(n_words, seed))
    first = wl.send(url, _call("first", ids, n))
    turn2 = [*ids, *first.tokens, *_ids(url, wl.words(12, seed + 1))]
    out: dict = {"prompt_tokens": len(ids), "turn2_tokens": len(turn2)}
    for name, call in (("repeat", _call("repeat", ids, n)), ("turn2", _call("turn2", turn2, n))):
        hit = wl.send(url, call)
        cold = wl.send(url, call, extra={"cache_prompt": False})
        out[name] = {"cached": hit.cached_tokens, "ttft": hit.first_token_seconds,
                     "cold_ttft": cold.first_token_seconds, "identical_to_cold": hit.same_as(cold)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="an older llama-server binary (bin/llama-server of a build)")
    ap.add_argument("--words", default="60,1000", help="prompt lengths in words, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = ds.target(None, lib="exact")
    # the configuration `dflash qualify --serve` proves by default (4 slots, 512-token ubatches); each
    # hit is compared with its cold run here, so no record is needed
    config, _ = ds.choose_config(t, parallel=4, ubatch=512, ctx=4096, threads=a.threads, allow_inexact=True)
    before_bin = Path(a.before).resolve()
    before_env = {**t.env, "LD_LIBRARY_PATH": f"{t.check.lib_dir}:{before_bin.parent.parent / 'lib'}"}
    servers = {"before": (replace(t.check, binary=str(before_bin)), before_env), "after": (t.check, t.env)}
    rows = []
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, (check, env) in servers.items():
            s = check.make_server(config, env)
            stack.enter_context(s)
            urls[name] = s.url
        for n_words in map(int, a.words.split(",")):
            for r in range(a.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    row = {"server": name, "words": n_words, "round": r,
                           **one_round(urls[name], n_words, 1000 * (r + 1) + n_words, a.max_tokens)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = []
    for n_words in map(int, a.words.split(",")):
        for name in ("before", "after"):
            rs = [x for x in rows if x["server"] == name and x["words"] == n_words]
            summary.append({"server": name, "prompt_tokens": statistics.median(x["prompt_tokens"] for x in rs),
                            **{f"{k}_{m}": statistics.median(x[k][m] for x in rs) for k in ("repeat", "turn2")
                               for m in ("cached", "ttft", "cold_ttft")},
                            "identical": sum(x[k]["identical_to_cold"] for x in rs for k in ("repeat", "turn2")),
                            "responses": 2 * len(rs)})
    print(f"\n{'server':6s} {'prompt':>6s} {'repeat cached':>13s} {'ttft':>7s} {'cold':>7s} {'turn 2 cached':>13s} "
          f"{'ttft':>7s} {'cold':>7s} identical")
    for s in summary:
        print(f"{s['server']:6s} {s['prompt_tokens']:6.0f} {s['repeat_cached']:13.0f} {s['repeat_ttft']:7.3f} "
              f"{s['repeat_cold_ttft']:7.3f} {s['turn2_cached']:13.0f} {s['turn2_ttft']:7.3f} "
              f"{s['turn2_cold_ttft']:7.3f} "
              f"{s['identical']}/{s['responses']}")
    if a.json:
        write_atomic(Path(a.json), json.dumps({"threads": a.threads, "config": config.to_json(), "summary": summary,
                                               "rows": rows}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
