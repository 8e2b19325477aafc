"""One library's side of `dflash sweep`: a long-lived process that prefills on request.

`python -m dflash.sweep_worker` reads JSON lines on stdin and answers each with one JSON line on
stdout (anything else the process writes to stdout, llama.cpp included, goes to stderr):

    {"lib", "model", "weights", "threads", "prompt", "min_tokens", "max_width", "n_predict"}
        -> {"n_tokens", "tokens_sha256", "repeats", "truncated_from", "threads", "provenance"}
    {"width": W, "kind": "verify" | "warmup" | "timed"}
        -> {"prefill_seconds", "tokens_per_second", "logits_sha256", "response_sha256", "n_bands"}
    {"quit": true}   (or end of input) -> exits 0

A request is cache-cold and prefills the whole prompt in fixed-width bands of W (compressor
boundaries ignored). "verify" hashes the logits of every position and decodes n_predict response
tokens; the others hash the last position only and decode nothing. The timing window is the band
loop (prefill.run). Any failure is answered {"error": "<one line>", "exit_code": N}, then exit N.
While it waits for a request the process blocks on stdin and computes nothing.
"""
from __future__ import annotations

import json
import os
import sys

from . import engine, prefill, records, settings, tiny_model
from .bands import Band, fixed_bands
from .errors import DflashError, UsageError


def repeat_to(tokenize, text: str, need: int) -> tuple[str, list[int], int]:
    """The text repeated (joined by spaces) the fewest times that give at least `need` tokens:
    (text, tokens, repeats)."""
    rep = lambda k: " ".join([text] * k)
    tokens, k = tokenize(text), 1
    while len(tokens) < need:  # jump by the estimate, then step back to the fewest repeats
        k = max(k + 1, -(-k * need // max(len(tokens), 1)))
        tokens = tokenize(rep(k))
    while k > 1 and len(fewer := tokenize(rep(k - 1))) >= need:
        k, tokens = k - 1, fewer
    return rep(k), tokens, k


class Session:
    def __init__(self, setup: dict):
        s = settings.resolve(bands=True, lib=setup["lib"])  # the planner is not used: bands are fixed-width
        self.eng = engine.open_engine(s, setup.get("model"), threads=setup.get("threads"),
                                      weights=setup.get("weights") or tiny_model.DEFAULT_WEIGHTS)
        self.n_predict = int(setup.get("n_predict", 4))
        text, tokens, self.repeats = repeat_to(self.eng.tokenize, setup["prompt"], int(setup["min_tokens"]))
        limit = self.eng.model.n_ctx_train or self.eng.info.context_length or 0
        self.truncated_from = None
        if limit and len(tokens) + self.n_predict > limit:
            self.truncated_from = len(tokens)
            tokens = tokens[:max(limit - self.n_predict, 1)]
        self.text, self.tokens = text, tokens
        max_band = max(1, min(int(setup["max_width"]), len(tokens)))
        self.ctx = self.eng.context(len(tokens) + self.n_predict, max_band)
        self._bands: dict[int, list[Band]] = {}

    def ready(self) -> dict:
        return {"n_tokens": len(self.tokens), "tokens_sha256": prefill.sha256_tokens(self.tokens),
                "repeats": self.repeats, "truncated_from": self.truncated_from, "threads": self.eng.threads,
                "n_ctx_train": self.eng.model.n_ctx_train,
                "provenance": records.provenance(self.eng, None, self.text, self.tokens)}

    def run(self, req: dict) -> dict:
        w, kind = int(req["width"]), req["kind"]
        if not 1 <= w <= self.ctx.max_band:
            raise UsageError(f"width {w} outside 1..{self.ctx.max_band}")
        bands = self._bands.setdefault(w, fixed_bands(len(self.tokens), w))
        verify = kind == "verify"
        r = prefill.run(self.ctx, prefill.Request(self.tokens, bands, self.n_predict if verify else 0,
                                                  "all" if verify else "last"))
        return {"prefill_seconds": r.prefill_seconds, "tokens_per_second": r.prefill_tokens_per_second,
                "logits_sha256": r.logits_sha256, "response_sha256": r.response_sha256, "n_bands": len(bands)}


def serve(lines, send) -> int:
    session = None
    try:
        for line in lines:
            msg = json.loads(line)
            if msg.get("quit"):
                break
            if session is None:
                session = Session(msg)
                send(session.ready())
            else:
                send(session.run(msg))
        return 0
    except DflashError as e:
        send({"error": str(e).splitlines()[0] if str(e) else type(e).__name__, "exit_code": e.exit_code})
        return e.exit_code
    except Exception as e:  # noqa: BLE001 -- one line to the parent, never a traceback
        send({"error": f"{type(e).__name__}: {e}".splitlines()[0], "exit_code": 1})
        return 1


def main() -> int:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else writes to stdout (llama.cpp, ggml) lands on stderr
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        channel.write(json.dumps(obj, allow_nan=False) + "\n")
        channel.flush()
    try:
        return serve(sys.stdin, send)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
