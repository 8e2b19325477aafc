"""Per-position graph traces and their comparison (pure: numpy only, no llama.cpp).

A decode of width w starting at position p0 yields graph nodes (name, op, ne, array), the array
shaped like ne reversed (outermost first), as `llama.GraphTap.take()` returns them. This module
cuts each node into one row per position and compares two traces position by position, nodes
in graph order, bit for bit.

Token axis. For w == 1 the whole node belongs to the one position. For w > 1 the token axis is
the outermost dimension of ne that is not 1, when it equals w; a node whose outermost non-1
dimension is not w has no per-token rows and is skipped. With `strict` (the default) a node
with another dimension also equal to w is skipped too: its token axis is ambiguous (e.g. the
attention scores kq, ne = (n_kv, n_tokens, n_head), when n_head == w).

Comparable rows. Rows match by key: the node name, or `name#k` for the k-th node of that name
in one decode (k >= 2), so repeated names stay distinct. Two rows are compared only when op,
dtype and row shape (ne with the token axis set to 1) agree; a node that exists in only one
trace, or whose shape depends on the schedule (e.g. on the KV-cache length seen), is not compared.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Node = tuple[str, str, tuple[int, ...], np.ndarray]  # (name, op, ne, array shaped ne[::-1])


@dataclass(frozen=True)
class Row:
    """One node's output at one position."""
    key: str                 # name, or name#k for the k-th node of that name in the decode
    name: str
    op: str
    shape: tuple[int, ...]   # ne with the token axis set to 1 (a width-1 decode: ne itself)
    values: np.ndarray = field(repr=False)  # the position's values, flattened (a copy)


Trace = list[dict[str, Row]]  # index: position; each dict in graph order


def new_trace(n_positions: int) -> Trace:
    return [{} for _ in range(n_positions)]


def token_axis(ne: Sequence[int], width: int, strict: bool = True) -> int | None:
    """The index into ne of the token axis of a node from a decode of `width` (> 1), or None."""
    outer = [i for i, d in enumerate(ne) if d != 1]
    if width < 2 or not outer or ne[outer[-1]] != width:
        return None
    if strict and sum(1 for d in ne if d == width) > 1:
        return None
    return outer[-1]


def rows(nodes: Iterable[Node], width: int, strict: bool = True) -> list[list[Row]]:
    """One list of rows per position of a decode of `width`, in graph order."""
    out: list[list[Row]] = [[] for _ in range(width)]
    seen: Counter[str] = Counter()
    for name, op, ne, arr in nodes:
        seen[name] += 1
        key = name if seen[name] == 1 else f"{name}#{seen[name]}"
        ne = tuple(int(d) for d in ne)
        arr = np.asarray(arr).reshape(ne[::-1])  # as GraphTap shapes it (a no-op for its arrays)
        if width == 1:
            out[0].append(Row(key, name, op, ne, np.array(arr).ravel()))
            continue
        axis = token_axis(ne, width, strict)
        if axis is None:
            continue
        shape = ne[:axis] + (1,) + ne[axis + 1:]
        np_axis = len(ne) - 1 - axis  # arrays are shaped ne reversed
        for j in range(width):
            out[j].append(Row(key, name, op, shape, np.take(arr, j, axis=np_axis).ravel()))
    return out


def add_decode(trace: Trace, nodes: Iterable[Node], start: int, width: int, strict: bool = True) -> None:
    """Record the nodes of the decode covering positions [start, start + width)."""
    for j, position_rows in enumerate(rows(nodes, width, strict)):
        trace[start + j].update((r.key, r) for r in position_rows)


def comparable(a: Row, b: Row) -> bool:
    return a.op == b.op and a.shape == b.shape and a.values.dtype == b.values.dtype \
        and a.values.size == b.values.size


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.dtype(f"u{x.dtype.itemsize}"))


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(_bits(a), _bits(b)))


def max_abs_delta(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


@dataclass(frozen=True)
class NodeDiff:
    position: int
    key: str
    name: str
    op: str
    max_abs_delta: float
    n_values: int
    n_differing: int     # values whose bits differ

    def to_json(self) -> dict[str, Any]:
        d = self.max_abs_delta
        return {"position": self.position, "key": self.key, "name": self.name, "op": self.op,
                "max_abs_delta": d if np.isfinite(d) else str(d), "n_values": self.n_values,
                "n_differing": self.n_differing}


def diff_row(position: int, a: Row, b: Row) -> NodeDiff | None:
    if bit_equal(a.values, b.values):
        return None
    n_diff = int(np.count_nonzero(_bits(a.values) != _bits(b.values)))
    return NodeDiff(position, a.key, a.name, a.op, max_abs_delta(a.values, b.values), a.values.size, n_diff)


@dataclass
class TraceDiff:
    first: NodeDiff | None            # the first differing node (first position, graph order)
    differing: list[NodeDiff]         # every differing node at first.position, graph order
    n_compared: int                   # nodes compared at first.position (all positions if none)
    positions_compared: int
    positions_differing: list[int]

    @property
    def identical(self) -> bool:
        return self.first is None


def compare(a: Trace, b: Trace, ignore: str | None = None) -> TraceDiff:
    """Walk positions in order and a's nodes in graph order; bit-compare every comparable pair.
    `ignore`: a regular expression; nodes whose name it matches (re.search) are not compared."""
    skip = re.compile(ignore).search if ignore else (lambda name: False)
    first: NodeDiff | None = None
    differing: list[NodeDiff] = []
    at_first = total = 0
    bad_positions: list[int] = []
    n = min(len(a), len(b))
    for p in range(n):
        found: list[NodeDiff] = []
        count = 0
        for key, ra in a[p].items():
            rb = b[p].get(key)
            if rb is None or not comparable(ra, rb) or skip(ra.name):
                continue
            count += 1
            d = diff_row(p, ra, rb)
            if d is not None:
                found.append(d)
        total += count
        if found:
            bad_positions.append(p)
            if first is None:
                first, differing, at_first = found[0], found, count
    return TraceDiff(first, differing, at_first if first is not None else total, n, bad_positions)


def first_differing_row(a: np.ndarray, b: np.ndarray) -> tuple[int | None, int, float]:
    """(first row whose bits differ or None, rows differing, max |a - b|) of two equal-shape arrays."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    n = a.shape[0]
    if n == 0:
        return None, 0, max_abs_delta(a, b)
    # in blocks of rows of about 16 MB, so that the float64 copies of max_abs_delta stay small for
    # logits of 8K positions x 262K tokens (file-backed: prefill.logit_rows)
    step = max(1, (1 << 24) // max(1, a[0].nbytes))
    first, n_bad, worst = None, 0, 0.0
    for i in range(0, n, step):
        x, y = a[i:i + step], b[i:i + step]
        same = np.all(_bits(x).reshape(x.shape[0], -1) == _bits(y).reshape(y.shape[0], -1), axis=1)
        bad = int(same.size - np.count_nonzero(same))
        if bad and first is None:
            first = i + int(np.argmin(same))
        n_bad += bad
        d = max_abs_delta(x, y)
        worst = d if (np.isnan(d) or d > worst) and not np.isnan(worst) else worst
    return first, n_bad, worst
