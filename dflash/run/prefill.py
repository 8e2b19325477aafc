"""Run a band plan through a Context: one llama_decode per band, fingerprints and timings.

Fingerprints (SHA-256, hex):
  logits    float32 little-endian logits of every prompt position, in position order
  prompt    prompt token ids as int32 little-endian
  tokens    response token ids as int32 little-endian
  response  the response text's bytes as llama.cpp detokenizes them

Logits that are not finite (NaN, an infinity) fail the request with one line naming the first
position and the library: no fingerprint is ever taken of them.
"""
from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from dflash.core.errors import LlamaError
from dflash.core.results import Library, PrefillResult, Q1Comparison, Q1Run, SpecComparison
from dflash.core.stage import stage
from dflash.run import speculate
from dflash.run.bands import Band

if TYPE_CHECKING:
    from dflash.native.llama import Context
    from dflash.run.engine import Engine

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

    def __post_init__(self) -> None:
        if self.logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {self.logits!r}")
        pos = self.start
        for b in self.bands:  # the bands tile [start, n) in order: no gap, no overlap
            if b.start != pos or b.width < 1:
                raise ValueError(f"band ({b.start}, width {b.width}) does not start where the previous "
                                 f"one ends ({pos})")
            pos = b.end
        if pos != len(self.tokens):
            raise ValueError(f"bands cover positions {self.start}..{pos - 1}, the request has "
                             f"{self.start}..{len(self.tokens) - 1}")


@dataclass
class RequestOutput:
    """One request's raw output (PrefillResult is the typed result built from it)."""
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
    response_logits_sha256: str = ""  # the logits each response token was chosen from, in order

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.n_prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


@dataclass
class PromptOutput:
    """The prompt part of a request: the logits hash, the last position's logits (None with no
    prompt tokens) and, with keep_logits, every row by position."""
    logits_sha256: str
    last: np.ndarray | None
    seconds: float
    kept: np.ndarray | None = field(default=None, repr=False)


def check_finite(out: np.ndarray, first_position: int, library: str) -> None:
    """LlamaError naming the first position whose logits hold a NaN or an infinity. One sum per
    row finds them (any non-finite value makes the sum non-finite; finite logits are far from
    float32's overflow), so the check costs a fraction of hashing them."""
    sums = out.sum(axis=1, dtype=np.float32)
    if np.isfinite(sums).all():
        return
    bad = np.flatnonzero(~np.isfinite(out).all(axis=1))
    row = int(bad[0]) if bad.size else int(np.flatnonzero(~np.isfinite(sums))[0])
    kind = "NaN" if np.isnan(out[row]).any() else "an infinity"
    raise LlamaError(f"the logits at position {first_position + row} hold {kind}: the llama.cpp library "
                     f"{library} computed non-finite values (a broken or half-built library?)")


KEEP_IN_MEMORY = 1 << 30  # kept logits larger than this many bytes go to an unlinked temporary file


def logit_rows(n: int, n_vocab: int, start: int = 0) -> np.ndarray:
    """A float32 (n, n_vocab) array for kept logits, NaN until written (a file-backed one: rows
    before `start`, the rest zeros).
    Past KEEP_IN_MEMORY bytes (Gemma's 262,144-token vocabulary over an 8K prompt: 8.8 GB) it maps
    an unlinked temporary file, so that a reference and a run side by side stay in the page cache,
    which the kernel can write back, instead of anonymous memory it can only kill for."""
    if n * n_vocab * 4 <= KEEP_IN_MEMORY:
        return np.full((n, n_vocab), np.nan, dtype=np.float32)
    with tempfile.TemporaryFile(prefix="dflash-logits-") as f:
        f.truncate(n * n_vocab * 4)
        rows = np.memmap(f, dtype=np.float32, mode="r+", shape=(n, n_vocab))
    rows[:start] = np.nan  # the rest reads as zeros until written
    return rows


def prefill(ctx: Context, req: Request, progress: Progress = _noop,
            on_band: Callable[[Band], None] | None = None, library: str = "") -> PromptOutput:
    """Clear the context (unless resuming) and run one llama_decode per band.

    Logits are hashed (and kept) for positions req.start..n-1; kept rows are indexed by position.
    `on_band(band)` runs after each band's llama_decode (e.g. to collect a graph tap). The timing
    window is this band loop: every decode plus copying and hashing its logits."""
    if req.start == 0:
        ctx.clear()
    n = len(req.tokens)
    h = hashlib.sha256()
    kept = logit_rows(n, ctx.n_vocab, req.start) if req.keep_logits else None
    last = None
    t0 = time.perf_counter()
    for b in req.bands:
        stage(f"band at position {b.start} (width {b.width})")
        out = ctx.decode(req.tokens[b.start:b.end], b.start, logits=req.logits
                         if req.logits == "all" or b.end == n else "none")
        if out is not None:
            check_finite(out, b.end - len(out), library)
            if req.logits == "all":
                h.update(np.ascontiguousarray(out, dtype="<f4").data)  # no copy on little-endian hosts
                if kept is not None:
                    kept[b.start:b.end] = out
            last = out[-1]
        if on_band is not None:
            on_band(b)
        progress(b.end, n)
    seconds = time.perf_counter() - t0
    if req.logits == "last" and last is not None:
        h.update(np.ascontiguousarray(last, dtype="<f4").data)
    return PromptOutput(h.hexdigest(), last, seconds, kept)


def greedy(ctx: Context, last: np.ndarray | None, pos: int, n_predict: int,
           library: str = "") -> Iterator[tuple[int, np.ndarray]]:
    """Greedy response after a prefill whose last logits are `last`, from position `pos`: up to
    n_predict (token, the logits it was chosen from) pairs, stopping at end-of-generation or the
    end of the context."""
    n = 0
    while n < n_predict and last is not None:
        tok = int(np.argmax(last))
        if ctx.model.is_eog(tok):
            return
        yield tok, last
        n += 1
        if n == n_predict or pos >= ctx.n_ctx:
            return
        stage(f"decode of response token {n} at position {pos}")
        out = ctx.decode([tok], pos, logits="last")
        assert out is not None  # logits="last" always returns a row
        check_finite(out, pos, library)
        last = out[0]
        pos += 1


def decode(ctx: Context, last: np.ndarray | None, pos: int, n_predict: int,
           library: str = "") -> tuple[list[int], float, str]:
    """The greedy response's tokens (see greedy), the seconds spent and the SHA-256 of the logits
    each token was chosen from (float32 little-endian, in order)."""
    return _take(greedy(ctx, last, pos, n_predict, library))


def _take(pairs: Iterator[tuple[int, np.ndarray]]) -> tuple[list[int], float, str]:
    t0 = time.perf_counter()
    h = hashlib.sha256()
    response = []
    for tok, logits in pairs:
        response.append(tok)
        h.update(np.ascontiguousarray(logits, dtype="<f4").data)
    return response, time.perf_counter() - t0, h.hexdigest()


def run(ctx: Context, req: Request, progress: Progress = _noop,
        on_band: Callable[[Band], None] | None = None, library: str = "") -> RequestOutput:
    """One request: prefill band by band, then greedy-decode n_predict tokens."""
    p = prefill(ctx, req, progress, on_band, library)
    response, decode_s, decode_logits = decode(ctx, p.last, len(req.tokens), req.n_predict, library)
    text = ctx.model.detokenize(response)
    return RequestOutput(
        widths=[b.width for b in req.bands], n_prompt_tokens=len(req.tokens) - req.start,
        prefill_seconds=p.seconds, decode_seconds=decode_s, logits_sha256=p.logits_sha256,
        prompt_sha256=sha256_tokens(req.tokens), response_tokens=response, response_text=text,
        response_tokens_sha256=sha256_tokens(response), response_sha256=hashlib.sha256(text).hexdigest(),
        logits=p.kept, response_logits_sha256=decode_logits)


# ---------------------------------------------------------------------------------------------
# One request on an engine: what `dflash prefill` runs

def compare_q1(banded: RequestOutput, q1: RequestOutput) -> Q1Comparison:
    """The band run against the q1 run of the same request: identical when both the logits and the
    response hashes are equal."""
    return Q1Comparison(
        Q1Run(q1.logits_sha256, q1.response_sha256, q1.prefill_seconds, q1.prefill_tokens_per_second),
        identical=(q1.logits_sha256, q1.response_sha256) == (banded.logits_sha256, banded.response_sha256),
        speedup=q1.prefill_seconds / banded.prefill_seconds if banded.prefill_seconds else None)


ContextFor = Callable[[int, int], "Context"]  # (n_ctx, max_band) -> a context the caller owns


def run_speculative(ctx: Context, req: Request, plain: RequestOutput, spec: str, library: str = "") -> SpecComparison:
    """The request again, its response decoded with speculation (speculate.greedy), against the
    plain run `plain` of the same request."""
    p = prefill(ctx, req, library=library)
    stats = speculate.SpecStats()
    n = speculate.ngram_size(spec) or speculate.NGRAM_N
    response, seconds, logits_sha = _take(speculate.greedy(ctx, req.tokens, p.last, req.n_predict, stats, n=n))
    identical = (response, logits_sha) == (plain.response_tokens, plain.response_logits_sha256)
    return SpecComparison(spec, sha256_tokens(response), logits_sha, identical, stats.drafted, stats.accepted,
                          stats.batches, stats.truncations, stats.restores, seconds, plain.decode_seconds)


def run_request(eng: Engine, tokens: list[int], context: ContextFor, *, n_predict: int = 16, resume_at: int = 0,
                logits: str = "all", ctx: int | None = None, compare: bool = False,
                bands: list[Band] | None = None, progress: Progress = _noop, spec: str = "none") -> PrefillResult:
    """Prefill `tokens` with the engine's band schedule (planned as two parts when resume_at > 0;
    or the explicit `bands`) and decode n_predict tokens, on the context `context(n_ctx, max_band)`
    gives; with `compare`, run the q1 schedule of the same request on the same context afterwards
    and compare the two (PrefillResult.comparison); with a `spec` other than none, run the request
    once more decoding with speculation (PrefillResult.speculation)."""
    speculate.check_spec(spec)
    n_ctx = eng.context_size(len(tokens), n_predict, ctx)
    bands = eng.request_bands(len(tokens), resume_at) if bands is None else bands
    verify = 1 + speculate.NGRAM_M if spec != "none" else 1
    c = context(n_ctx, max(verify, *(b.width for b in bands)))
    lib = str(eng.lib_dir)
    req = Request(tokens, bands, n_predict, logits)
    r = run(c, req, progress, library=lib)
    q1 = None
    if compare:
        q1 = run(c, Request(tokens, eng.request_bands(len(tokens), resume_at, bands_on=False), n_predict, logits),
                 library=lib)
    result = describe(eng, r, n_ctx, compare_q1(r, q1) if q1 is not None else None)
    if spec != "none":
        result = replace(result, speculation=run_speculative(c, req, r, spec, lib))
    return result


def describe(eng: Engine, r: RequestOutput, n_ctx: int, comparison: Q1Comparison | None = None) -> PrefillResult:
    """A request's result with the engine's model, library and settings."""
    s = eng.settings
    return PrefillResult(
        model=str(eng.info.path), architecture=eng.info.architecture, library=Library(s.lib, str(eng.lib_dir), s.cpu),
        bands_on=s.bands, chunk=s.chunk, chunk_requested=s.chunk_requested,
        band_mode="fixed" if s.fixed else "planner", mmvq_max_ncols=s.mmvq_max_ncols, qualification=s.qualified,
        threads=eng.threads, n_ctx=n_ctx, device=eng.device, devices=eng.placement, repack=eng.repack,
        indexer_shortcut=eng.indexer_shortcut, indexer_tile=eng.indexer_tile,
        widths=tuple(r.widths),
        n_prompt_tokens=r.n_prompt_tokens, prefill_seconds=r.prefill_seconds,
        prefill_tokens_per_second=r.prefill_tokens_per_second, decode_seconds=r.decode_seconds,
        prompt_sha256=r.prompt_sha256, logits_sha256=r.logits_sha256, response_tokens=tuple(r.response_tokens),
        response_tokens_sha256=r.response_tokens_sha256,
        response_text=r.response_text.decode("utf-8", errors="replace"), response_sha256=r.response_sha256,
        warnings=tuple(s.warnings() + eng.narrow_warnings()), comparison=comparison,
        uncovered_weight_types=eng.uncovered_weight_types)
