"""The band planner: which prefill widths are exact, step by step. Pure: no I/O, no clock.

DeepSeek V4 layers carry a compress ratio r (0 = none). A compressor emits a pooled row at
position p when (p + 1) % r == 0, so a band must never hold an emission position except as its
last token. From position p the safe width is

    safe(p) = min over r > 0 of (r - p % r)          (no ratios: unlimited)

and the planner takes w = min(cap, safe(p), tokens_left): the widest band the rule allows.
With bands off every width is 1 (q1, the reference schedule).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dflash.core.errors import UsageError

NARROW = "narrow"    # width <= narrow ceiling: batch-invariant matrix-vector kernels
BATCHED = "batched"  # wider: batched (MMQ) kernels, outside the narrow exact path

# Why a band has its width.
FULL = "full"          # the cap
Q1 = "q1"              # bands off
BOUNDARY = "boundary"  # cut so a compressor emission is the band's last token
START = "start"        # the first band of an unaligned (resumed) start, cut at the next boundary
TAIL = "tail"          # the prompt ends


@dataclass(frozen=True)
class Band:
    start: int
    width: int
    kernel: str
    reason: str
    ratio: int | None = None  # the compress ratio that cut a boundary/start band

    @property
    def end(self) -> int:
        return self.start + self.width


def positive_ratios(ratios: Iterable[int] | None) -> tuple[int, ...]:
    """Distinct compress ratios > 0, sorted; 0 means a layer without a compressor."""
    return tuple(sorted({int(r) for r in (ratios or ()) if int(r) > 0}))


def safe_width(pos: int, ratios: Iterable[int]) -> int | None:
    """Widest band from `pos` whose only emission position is its last token (None: unlimited)."""
    rs = positive_ratios(ratios)
    return min(r - pos % r for r in rs) if rs else None


def plan(n_tokens: int, start: int = 0, ratios: Iterable[int] | None = (), cap: int = 4,
         bands_on: bool = True, mmvq_max_ncols: int = 4) -> list[Band]:
    """Bands that tile [start, start + n_tokens) in order under the rule above."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if mmvq_max_ncols < 1:
        raise ValueError(f"mmvq_max_ncols must be >= 1, got {mmvq_max_ncols}")
    rs = positive_ratios(ratios)
    cap = cap if bands_on else 1
    bands: list[Band] = []
    pos, end = start, start + n_tokens
    while pos < end:
        left = end - pos
        safe = safe_width(pos, rs)
        width = min(cap, left, safe if safe is not None else cap)
        ratio = None
        if not bands_on:
            reason = Q1
        elif width == cap:
            reason = FULL
        elif width == left:
            reason = TAIL
        else:
            ratio = next(r for r in rs if r - pos % r == width)
            reason = START if pos == start and pos % ratio else BOUNDARY
        kernel = NARROW if width <= mmvq_max_ncols else BATCHED
        bands.append(Band(pos, width, kernel, reason, ratio))
        pos += width
    return bands


def widths(bands: Iterable[Band]) -> list[int]:
    return [b.width for b in bands]


def fixed_bands(n_tokens: int, width: int, start: int = 0, mmvq_max_ncols: int = 4) -> list[Band]:
    """A schedule that ignores compressor boundaries (for experiments and counter-examples)."""
    return plan(n_tokens, start, (), cap=width, bands_on=True, mmvq_max_ncols=mmvq_max_ncols)


def from_widths(ws: Iterable[int], start: int = 0, mmvq_max_ncols: int = 4) -> list[Band]:
    """Bands for an explicit list of widths."""
    out, pos = [], start
    for w in ws:
        if w < 1:
            raise ValueError(f"band widths must be >= 1, got {w}")
        out.append(Band(pos, w, NARROW if w <= mmvq_max_ncols else BATCHED, "given"))
        pos += w
    return out


def summarize_widths(ws: Sequence[int], limit: int = 60) -> str:
    """4 4 4 2 1 -> '4x3 2 1'; longer than `limit` characters: 'counts 4:3 2:1 1:1'."""
    out, i = [], 0
    while i < len(ws):
        j = i
        while j < len(ws) and ws[j] == ws[i]:
            j += 1
        out.append(f"{ws[i]}x{j - i}" if j - i > 1 else str(ws[i]))
        i = j
    text = " ".join(out)
    if len(text) <= limit:
        return text
    return "counts " + " ".join(f"{w}:{c}" for w, c in sorted(Counter(ws).items(), reverse=True))


# ---------------------------------------------------------------------------------------------
# Schedules named on the command line (dflash diff --a/--b)

SCHEDULE_HELP = ("q1 (one token per decode); wN (fixed width N, ignoring compressor boundaries); "
                 "bandsN (the band planner with cap N: boundary-aware); one (the whole prompt in one "
                 "decode); or a comma list of widths that sums to the prompt length, e.g. 4,4,2")


def parse_schedule(spec: str, n_tokens: int, ratios: Iterable[int] = ()) -> list[int]:
    """Band widths for a schedule spec (grammar: SCHEDULE_HELP) over n_tokens from position 0."""
    s = spec.strip().lower()
    if n_tokens < 1:
        raise UsageError("no tokens to schedule")
    if s == "q1":
        return [1] * n_tokens
    if s == "one":
        return [n_tokens]
    m = re.fullmatch(r"(w|bands)(\d+)", s)
    if m:
        cap = int(m.group(2))
        if cap < 1:
            raise UsageError(f"schedule {spec!r}: the width must be >= 1")
        chosen = fixed_bands(n_tokens, cap) if m.group(1) == "w" else plan(n_tokens, 0, ratios, cap)
        return widths(chosen)
    if re.fullmatch(r"\d+(,\d+)*", s):
        ws = [int(x) for x in s.split(",")]
        if min(ws) < 1:
            raise UsageError(f"schedule {spec!r}: widths must be >= 1")
        if sum(ws) != n_tokens:
            raise UsageError(f"schedule {spec!r} covers {sum(ws)} tokens, the prompt has {n_tokens}")
        return ws
    raise UsageError(f"schedule {spec!r} is not one of: {SCHEDULE_HELP}")
