#!/usr/bin/env python3
"""Mean negative log-likelihood of a natural text under the exact and the stock llama.cpp library.

The text is the first --n-tokens tokens (default 512) of /usr/share/common-licenses/GPL-3, which
every Debian machine has (base-files); --text-file picks another. Each library runs in its own
process (one library per process): one cache-cold prefill of the tokens in fixed-width bands of
--width (default 64; compressor boundaries ignored, the same schedule for both libraries) with
the logits of every position, then

    NLL = mean over t < n-1 of -log softmax(logits[t])[token[t+1]]      (float64, numpy)

Prints both means, their perplexities and the relative difference |exact - stock| / stock; exits 1
when that exceeds --max-rel (default 0.005), 2 on bad input.

    .venv/bin/python benchmarks/nll.py [--model PATH] [--n-tokens 512] [--width 64] [--threads T] [--json]
"""
import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from dflash.core.errors import DflashError, UsageError
from dflash.core.settings import ENV_LIB_DIR, LIBS
from dflash.native import build
from dflash.run import bands as B

GPL3 = Path("/usr/share/common-licenses/GPL-3")
REAL_MODEL = build.cache_root() / "models" / "real" / "gemma-3-270m-q4_k_m.gguf"


def mean_nll(logits: np.ndarray, tokens: list[int], rows: int = 32) -> float:
    """Mean of -log softmax(logits[t])[tokens[t+1]] over t = 0..n-2, in float64."""
    n = len(tokens)
    if n < 2:
        raise ValueError("the NLL needs at least two tokens")
    total = 0.0
    for i in range(0, n - 1, rows):
        j = min(i + rows, n - 1)
        x = logits[i:j].astype(np.float64)
        m = x.max(axis=1)
        lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
        total += float((lse - x[np.arange(j - i), tokens[i + 1:j + 1]]).sum())
    return total / (n - 1)


def worker(a) -> dict:
    """In this process: load the library, prefill, compute the NLL."""
    from dflash import Session, Settings
    from dflash.run import prefill
    session = Session(a.model, lib=a.worker, bands=True, threads=a.threads, settings=Settings.from_env(lib=a.worker),
                      build=True)
    eng = session.engine
    tokens = session.tokenize(Path(a.text_file).read_text(encoding="utf-8"))[:a.n_tokens]
    width = min(a.width, len(tokens))
    ctx = session.context(eng.context_size(len(tokens), 0, None), width)
    r = prefill.run(ctx, prefill.Request(tokens, B.fixed_bands(len(tokens), width), n_predict=0, keep_logits=True),
                    library=str(eng.lib_dir))
    nll = mean_nll(r.logits, tokens)
    return {"lib": a.worker, "n_tokens": len(tokens), "width": width, "threads": eng.threads,
            "mean_nll": nll, "perplexity": float(np.exp(nll)), "logits_sha256": r.logits_sha256,
            "tokens_sha256": r.prompt_sha256, "library_dir": str(eng.lib_dir)}


def run_lib(lib: str, argv: list[str]) -> dict:
    drop = {"LLAMA_CPP_LIB_PATH"} | ({ENV_LIB_DIR} if lib != "exact" else set())
    env = {k: v for k, v in os.environ.items() if k not in drop}
    p = subprocess.run([sys.executable, __file__, *argv, "--worker", lib], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        msg = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        msg = msg.split(": ", 2)[-1] if msg.startswith("nll: ") else msg  # the worker's own prefix
        raise (UsageError if p.returncode == 2 else DflashError)(f"{lib} library: {msg}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help=f"GGUF model [default: {REAL_MODEL} if present]")
    ap.add_argument("--text-file", default=str(GPL3), help="UTF-8 text [default: %(default)s]")
    ap.add_argument("--n-tokens", type=int, default=512)
    ap.add_argument("--width", type=int, default=64, help="fixed band width for both libraries")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-rel", type=float, default=0.005)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def check(a) -> None:
    if a.model is None:
        if not REAL_MODEL.is_file():
            raise UsageError(f"no --model given and the default model {REAL_MODEL} is not present")
        a.model = str(REAL_MODEL)
    if not Path(a.text_file).is_file():
        where = " (it ships with Debian's base-files; give --text-file elsewhere)" if a.text_file == str(GPL3) else ""
        raise UsageError(f"text file {a.text_file} not found{where}")
    if a.n_tokens < 2 or a.width < 1 or (a.threads is not None and a.threads < 1) or a.max_rel < 0:
        raise UsageError("--n-tokens must be >= 2, --width and --threads >= 1, --max-rel >= 0")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    try:
        check(a)
        if a.worker:
            print(json.dumps(worker(a)))
            return 0
        fwd = [x for x in argv if x not in ("--json",)]
        res = {lib: run_lib(lib, fwd + ["--model", a.model]) for lib in ("exact", "stock")}
        bad = [lib for lib, r in res.items() if not math.isfinite(r["mean_nll"])]
        if bad:
            raise DflashError(f"the {' and '.join(bad)} library's mean NLL is not finite (NaN or infinite logits)")
    except DflashError as e:
        print(f"nll: {'usage error' if e.exit_code == 2 else 'error'}: {e}".splitlines()[0], file=sys.stderr)
        return e.exit_code
    ex, st = res["exact"]["mean_nll"], res["stock"]["mean_nll"]
    rel = abs(ex - st) / abs(st)
    out = {"model": a.model, "text_file": a.text_file, "n_tokens": res["exact"]["n_tokens"],
           "width": res["exact"]["width"], "libs": res, "relative_difference": rel, "max_rel": a.max_rel,
           "ok": rel <= a.max_rel,
           "same_tokens": res["exact"]["tokens_sha256"] == res["stock"]["tokens_sha256"]}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['n_tokens']} tokens of {a.text_file}, bands of {out['width']}, model {a.model}")
        for lib, r in res.items():
            print(f"{lib:>6}: mean NLL {r['mean_nll']:.6f} nats/token (perplexity {r['perplexity']:.3f})")
        print(f"relative difference {rel:.3e} (max {a.max_rel}): {'ok' if out['ok'] else 'TOO LARGE'}")
    return 0 if out["ok"] and out["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
