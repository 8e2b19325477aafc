"""Run a band plan through a Context: one llama_decode per band, fingerprints and timings.

Fingerprints (SHA-256, hex):
  logits    float32 little-endian logits of every prompt position, in position order
  prompt    prompt token ids as int32 little-endian
  tokens    response token ids as int32 little-endian
  response  the response text's bytes as llama.cpp detokenizes them
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .bands import Band

Progress = Callable[[int, int], None]


def _noop(done: int, total: int) -> None:
    pass


def sha256_tokens(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


@dataclass
class Request:
    tokens: list[int]
    bands: list[Band]
    n_predict: int = 16
    logits: str = "all"       # "all" (hash every position) or "last"
    keep_logits: bool = False  # keep the (n, n_vocab) array for position-level comparison
    start: int = 0            # > 0: resume; tokens[:start] are already in the context (an earlier
    #                           request with n_predict=0), so the context is not cleared

    def __post_init__(self):
        covered = sum(b.width for b in self.bands)
        if covered != len(self.tokens) - self.start:
            raise ValueError(f"bands cover {covered} tokens, the request has {len(self.tokens) - self.start}")
        if self.bands and self.bands[0].start != self.start:
            raise ValueError(f"the bands start at {self.bands[0].start}, the request at {self.start}")


@dataclass
class Result:
    widths: list[int]
    n_prompt_tokens: int  # tokens this request prefilled (after req.start when resuming)
    prefill_seconds: float
    decode_seconds: float
    logits_sha256: str
    prompt_sha256: str
    response_tokens: list[int]
    response_text: bytes
    response_tokens_sha256: str
    response_sha256: str
    logits: np.ndarray | None = field(default=None, repr=False)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.n_prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


def run(ctx, req: Request, progress: Progress = _noop,
        on_band: Callable[[Band], None] | None = None) -> Result:
    """One request: clear (unless resuming), prefill band by band, greedy-decode n_predict tokens.

    Logits are hashed (and kept) for positions req.start..n-1; `kept` rows are indexed by
    position. `on_band(band)` runs after each band's llama_decode (e.g. to collect a graph tap)."""
    if req.start == 0:
        ctx.clear()
    n = len(req.tokens)
    h = hashlib.sha256()
    kept = np.full((n, ctx.n_vocab), np.nan, dtype=np.float32) if req.keep_logits else None
    last = None
    t0 = time.perf_counter()
    for b in req.bands:
        out = ctx.decode(req.tokens[b.start:b.end], b.start, logits=req.logits
                         if req.logits == "all" or b.end == n else "none")
        if out is not None:
            if req.logits == "all":
                h.update(np.ascontiguousarray(out, dtype="<f4"))  # no copy on little-endian hosts
                if kept is not None:
                    kept[b.start:b.end] = out
            last = out[-1]
        if on_band is not None:
            on_band(b)
        progress(b.end, n)
    prefill_s = time.perf_counter() - t0
    if req.logits == "last" and last is not None:
        h.update(np.ascontiguousarray(last, dtype="<f4"))

    response: list[int] = []
    t1 = time.perf_counter()
    pos = n
    while len(response) < req.n_predict and last is not None:
        tok = int(np.argmax(last))
        if ctx.model.is_eog(tok):
            break
        response.append(tok)
        if len(response) == req.n_predict or pos >= ctx.n_ctx:
            break
        last = ctx.decode([tok], pos, logits="last")[0]
        pos += 1
    decode_s = time.perf_counter() - t1
    text = ctx.model.detokenize(response)
    return Result(
        widths=[b.width for b in req.bands], n_prompt_tokens=n - req.start, prefill_seconds=prefill_s,
        decode_seconds=decode_s, logits_sha256=h.hexdigest(), prompt_sha256=sha256_tokens(req.tokens),
        response_tokens=response, response_text=text, response_tokens_sha256=sha256_tokens(response),
        response_sha256=hashlib.sha256(text).hexdigest(), logits=kept)
