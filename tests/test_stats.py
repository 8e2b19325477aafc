"""dflash.core.stats: known values, refusals, and properties that hold for any sample."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash.core import stats

samples = st.lists(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False), min_size=1, max_size=50)


def test_median_known_values():
    assert stats.median([3]) == 3
    assert stats.median([5, 1, 3]) == 3
    assert stats.median([4, 1, 3, 2]) == 2.5
    assert stats.median(x for x in [10.0, 20.0]) == 15.0


def test_mad_known_values():
    assert stats.mad([7]) == 0
    assert stats.mad([1, 1, 2, 2, 4, 6, 9]) == 1  # median 2, deviations 1 1 0 0 2 4 7
    assert stats.mad([1, 2, 3, 4]) == 1.0  # median 2.5, deviations 1.5 .5 .5 1.5
    assert stats.mad([100, 100, 100, 1000]) == 0  # one outlier does not move it


def test_summarize():
    s = stats.summarize([10, 12, 11])
    assert s == {"samples": [10, 12, 11], "median": 11, "mad": 1, "n": 3}


def test_gain_and_drift():
    assert stats.gain_percent(125.0, 100.0) == pytest.approx(25.0)
    assert stats.gain_percent(50, 100) == pytest.approx(-50.0)
    assert stats.gain_percent(100, 100) == 0
    assert stats.drift_percent(200.0, 198.0) == pytest.approx(-1.0)
    assert stats.drift_percent(100, 103) == pytest.approx(3.0)


@pytest.mark.parametrize("fn", [stats.median, stats.mad, stats.summarize])
@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [math.inf], ["1"], [True]])
def test_bad_samples_refused(fn, bad):
    with pytest.raises(ValueError):
        fn(bad)


@pytest.mark.parametrize("base, new", [(0.0, 1.0), (-5.0, 1.0), (math.nan, 1.0), (math.inf, 1.0),
                                       (None, 1.0), (1.0, math.nan), (1.0, -math.inf), (1.0, "2")])
def test_bad_percent_inputs_refused(base, new):
    with pytest.raises(ValueError):
        stats.gain_percent(new, base)
    with pytest.raises(ValueError):
        stats.drift_percent(base, new)


@given(samples)
def test_mad_is_non_negative(xs):
    assert stats.mad(xs) >= 0


@given(samples)
def test_median_within_range(xs):
    assert min(xs) <= stats.median(xs) <= max(xs)


@given(samples, st.randoms(use_true_random=False))
def test_permutation_invariance(xs, rnd):
    ys = list(xs)
    rnd.shuffle(ys)
    assert stats.median(ys) == stats.median(xs)
    assert stats.mad(ys) == stats.mad(xs)
    assert stats.summarize(ys)["median"] == stats.summarize(xs)["median"]


@given(samples, st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_shift_moves_median_not_mad(xs, c):
    shifted = [x + c for x in xs]
    assert stats.median(shifted) == pytest.approx(stats.median(xs) + c, rel=1e-9, abs=1e-3)
    assert stats.mad(shifted) == pytest.approx(stats.mad(xs), rel=1e-9, abs=1e-3)
