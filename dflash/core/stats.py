"""Robust summaries of repeated timings: median, MAD, gain and drift in percent.

Pure functions, no I/O. Every function refuses empty input and non-finite numbers with a
ValueError that says which argument is wrong: a NaN timing is a broken run, not a sample.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any


def _number(x: float, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise ValueError(f"{what} is {x!r}, not a finite number")
    return x


def _finite(xs: Iterable[float], what: str) -> list[float]:
    vals = list(xs)
    if not vals:
        raise ValueError(f"{what}: no samples")
    for i, x in enumerate(vals):
        _number(x, f"{what}: sample {i}")
    return vals


def _median_sorted(s: list[float]) -> float:
    n = len(s)
    mid = n // 2
    if n % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def median(xs: Iterable[float]) -> float:
    """The middle sample (the mean of the two middle ones for an even count)."""
    return _median_sorted(sorted(_finite(xs, "median")))


def mad(xs: Iterable[float]) -> float:
    """Median absolute deviation from the median, unscaled (no 1.4826 factor)."""
    vals = _finite(xs, "mad")
    m = _median_sorted(sorted(vals))
    return _median_sorted(sorted(abs(x - m) for x in vals))


def _percent_change(base: float, new: float, base_name: str, new_name: str) -> float:
    if _number(base, base_name) <= 0:
        raise ValueError(f"{base_name} is {base!r}; a percent change needs a positive base")
    return 100.0 * (_number(new, new_name) / base - 1.0)


def gain_percent(candidate_median: float, reference_median: float) -> float:
    """100 * (candidate / reference - 1): +25.0 means the candidate is 25% higher.

    Pass rates (tokens per second), not durations, so that a positive gain means faster.
    """
    return _percent_change(reference_median, candidate_median, "reference_median", "candidate_median")


def drift_percent(a_median: float, b_median: float) -> float:
    """100 * (b / a - 1): how far the closing reference run B moved from the opening run A.

    A bracketed benchmark measures the reference before (A) and after (B) the candidate; a
    large drift means the machine changed under the measurement.
    """
    return _percent_change(a_median, b_median, "a_median", "b_median")


def summarize(samples: Iterable[float]) -> dict[str, Any]:
    """{"samples": [...], "median": ..., "mad": ..., "n": ...} for one series of measurements.

    Samples come back as plain ints and floats (numpy scalars are converted) so the dict goes
    straight into JSON.
    """
    vals = [x if isinstance(x, int) else float(x) for x in _finite(samples, "summarize")]
    return {"samples": vals, "median": median(vals), "mad": mad(vals), "n": len(vals)}
