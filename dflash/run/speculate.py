"""Greedy decoding with n-gram speculation, token for token what plain greedy decoding yields.

Each step drafts the tokens that followed the most recent earlier occurrence of the context's
last N tokens (an n-gram lookup, as llama-server's ngram-simple does), and verifies the token
just chosen together with its draft in one llama_decode of 1 + k tokens. Row i of that batch holds
the logits plain decoding computes after the i-th of those tokens, bit for bit, on a library whose
kernels do not depend on the batch (the exact library; `dflash prefill --spec` checks it against
plain decoding for each request). A draft token is kept while it is the argmax of the row before
it; the first that is not is dropped with the rest, and the cache is cut back to the last kept
position (or, for a memory that cannot drop a suffix, such as DeepSeek-V4's compressors, restored
from the state saved before the batch and the kept tokens decoded again).

`ngram_draft` is pure; `greedy` drives a llama.Context.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dflash.core.errors import LlamaError, UsageError, arg
from dflash.core.results import Json
from dflash.core.stage import stage

if TYPE_CHECKING:
    from dflash.native.llama import Context

NGRAM_N, NGRAM_M = 4, 16  # lookup length and longest draft (dflash serve --spec ngram uses the same)
MAX_NGRAM_N = 16


def ngram_size(spec: str) -> int | None:
    """The lookup length of 'ngram' (NGRAM_N) or 'ngram:N' (N in 1..MAX_NGRAM_N); None for another
    value; a one-line UsageError for a malformed N."""
    if spec == "ngram":
        return NGRAM_N
    if not spec.startswith("ngram:"):
        return None
    n = spec[len("ngram:"):]
    if not n.isdigit() or not 1 <= int(n) <= MAX_NGRAM_N:
        raise UsageError(f"{arg('spec')} {spec!r}: the n-gram length after 'ngram:' must be 1..{MAX_NGRAM_N}")
    return int(n)


def check_spec(spec: str) -> str:
    """'none', or an n-gram spec (ngram, ngram:N): what the library speculates with."""
    if spec != "none" and ngram_size(spec) is None:
        raise UsageError(f"{arg('spec')} {spec!r}: the library speculates with 'ngram' or 'ngram:N' (or 'none'); "
                         f"draft models and MTP run in `dflash serve --spec`")
    return spec


class NgramIndex:
    """The tokens so far and, for each n-gram among them, where it last started before the final
    one: `draft` is a dictionary lookup and `append` one insertion, so a response costs time in
    its own length, not in the context's length per token."""

    def __init__(self, tokens: Sequence[int], n: int = NGRAM_N) -> None:
        self.tokens: list[int] = []
        self.n = n
        self.last: dict[tuple[int, ...], int] = {}
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        start = len(self.tokens) - self.n - 1  # the n-gram that was final until this token came
        if start >= 0:
            self.last[tuple(self.tokens[start:start + self.n])] = start

    def draft(self, m: int = NGRAM_M) -> list[int]:
        """The up to m tokens that followed the most recent earlier occurrence of the last n
        tokens ([] when they did not occur before)."""
        if len(self.tokens) <= self.n or m < 1:
            return []
        start = self.last.get(tuple(self.tokens[-self.n:]))
        return [] if start is None else self.tokens[start + self.n:start + self.n + m]


def ngram_draft(tokens: Sequence[int], n: int = NGRAM_N, m: int = NGRAM_M) -> list[int]:
    """NgramIndex(tokens, n).draft(m): the draft after `tokens`."""
    return NgramIndex(tokens, n).draft(m)


@dataclass
class SpecStats:
    """What speculation did over one response: tokens drafted and accepted, verification batches,
    and how rejected drafts were undone (cache cut to a prefix, or a saved state restored)."""
    drafted: int = 0
    accepted: int = 0
    batches: int = 0
    truncations: int = 0
    restores: int = 0

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_json(self) -> Json:
        return {"drafted": self.drafted, "accepted": self.accepted, "rejected": self.rejected,
                "acceptance_rate": self.acceptance_rate, "batches": self.batches, "truncations": self.truncations,
                "restores": self.restores}


def _check_finite(out: np.ndarray, pos: int) -> None:
    if not np.isfinite(out).all():
        raise LlamaError(f"llama.cpp returned non-finite logits in the verification batch at position {pos}")


def greedy(ctx: Context, history: Sequence[int], last: np.ndarray | None, n_predict: int,
           stats: SpecStats | None = None, n: int = NGRAM_N, m: int = NGRAM_M) -> Iterator[tuple[int, np.ndarray]]:
    """prefill.greedy with n-gram speculation: after a prefill of `history` (the prompt) whose last
    logits are `last`, up to n_predict (token, the logits it was chosen from) pairs, stopping at
    end-of-generation or the end of the context, the same pairs plain decoding yields."""
    stats = stats if stats is not None else SpecStats()
    seen = NgramIndex(history, n)
    pos, produced = len(seen.tokens), 0
    can_cut: bool | None = None  # whether the memory drops a suffix (learnt at the first rejection)
    while produced < n_predict and last is not None:
        tok = int(np.argmax(last))
        if ctx.model.is_eog(tok):
            return
        yield tok, last
        produced += 1
        seen.append(tok)
        if produced == n_predict or pos >= ctx.n_ctx:
            return
        room = min(n_predict - produced, ctx.n_ctx - pos - 1, ctx.max_band - 1)
        draft = seen.draft(min(m, max(room, 0)))
        saved = ctx.save_state() if draft and not can_cut else None
        stage(f"verification of {len(draft)} drafted tokens at position {pos}")
        out = ctx.decode([tok, *draft], pos, logits="all")
        assert out is not None
        _check_finite(out, pos)
        kept = 0
        stopped = False
        for i, d in enumerate(draft):
            if int(np.argmax(out[i])) != d:
                break
            if ctx.model.is_eog(d):
                stopped = True
                break
            kept += 1
            yield d, out[i]
            produced += 1
            seen.append(d)
            if produced == n_predict:
                stopped = True
                break
        if draft:
            stats.drafted += len(draft)
            stats.accepted += kept
            stats.batches += 1
        if stopped:
            return
        last = out[kept]
        end = pos + 1 + kept
        if kept < len(draft):
            if can_cut is not False and ctx.truncate(end):
                can_cut = True
                stats.truncations += 1
            else:  # the memory cannot drop a suffix: back to the state before the batch, then the kept tokens
                if saved is None:
                    raise LlamaError(f"llama.cpp could not drop the cached positions from {end} on")
                can_cut = False
                ctx.restore_state(saved)
                again = ctx.decode([tok, *draft[:kept]], pos, logits="last")
                assert again is not None
                last = again[0]
                stats.restores += 1
        pos = end
