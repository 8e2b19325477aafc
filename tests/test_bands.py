"""The band planner against the rule in docs (exactness.md section 2) and its properties."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.run import bands

RATIO_SETS = st.sampled_from([(), (4,), (128,), (4, 128), (0, 4, 128, 4, 128), (3, 5), (2, 7, 16)])


@pytest.mark.parametrize("n,start,ratios,cap,expect", [
    (10, 0, (4, 128), 4, [4, 4, 2]),
    (10, 1, (4, 128), 4, [3, 4, 3]),
    (4, 127, (128,), 4, [1, 3]),
    (17, 0, (), 9, [9, 8]),
    (10, 0, (4, 128), 2, [2] * 5),
    (5, 126, (4, 128), 4, [2, 3]),   # 126,127 | 128..130 (127 is an emission of both ratios)
    (0, 0, (4, 128), 4, []),
])
def test_documented_examples(n, start, ratios, cap, expect):
    assert bands.widths(bands.plan(n, start, ratios, cap)) == expect


def test_bands_off_is_q1():
    plan = bands.plan(10, 0, (4, 128), cap=4, bands_on=False)
    assert bands.widths(plan) == [1] * 10
    assert {b.reason for b in plan} == {bands.Q1}


def test_reasons_name_each_downshift():
    plan = bands.plan(10, 1, (4, 128), 4)
    assert [(b.reason, b.ratio) for b in plan] == [(bands.START, 4), (bands.FULL, None), (bands.TAIL, None)]
    plan = bands.plan(8, 0, (4, 128), 3)   # cap 3 against ratio 4: 3, then 1 to reach the boundary
    assert [(b.width, b.reason, b.ratio) for b in plan] == [
        (3, bands.FULL, None), (1, bands.BOUNDARY, 4), (3, bands.FULL, None), (1, bands.TAIL, None)]


def test_kernel_family_follows_narrow_ceiling():
    plan = bands.plan(8, 0, (), cap=4, mmvq_max_ncols=3)
    assert [b.kernel for b in plan] == [bands.BATCHED, bands.BATCHED]
    assert {b.kernel for b in bands.plan(8, 0, (), cap=3, mmvq_max_ncols=3)} == {bands.NARROW}


@pytest.mark.parametrize("kw", [dict(n_tokens=-1), dict(start=-1), dict(cap=0), dict(mmvq_max_ncols=0)])
def test_rejects_bad_arguments(kw):
    args = dict(n_tokens=4, start=0, ratios=(4,), cap=4, mmvq_max_ncols=4) | kw
    with pytest.raises(ValueError):
        bands.plan(**args)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 600), start=st.integers(0, 700), ratios=RATIO_SETS,
       cap=st.integers(1, 9), bands_on=st.booleans())
def test_properties(n, start, ratios, cap, bands_on):
    plan = bands.plan(n, start, ratios, cap, bands_on)
    rs = [r for r in ratios if r > 0]
    # tiles [start, start + n) in order
    pos = start
    for b in plan:
        assert b.start == pos and b.width >= 1
        pos = b.end
    assert pos == start + n
    end = start + n
    for i, b in enumerate(plan):
        # no emission position except as the band's last token
        assert not _emission_inside(b.start, b.end, rs)
        # never above the cap; width 1 everywhere with bands off
        assert b.width <= (cap if bands_on else 1)
        # maximal, checked by brute force rather than the planner's formula: one more token
        # would pass the cap, run past the prompt, or hold an emission before its last token
        assert (b.width == (cap if bands_on else 1) or b.end == end
                or _emission_inside(b.start, b.end + 1, rs))
        # the reason names what stopped the band, and only a ratio-cut band names a ratio
        if not bands_on:
            assert (b.reason, b.ratio) == (bands.Q1, None)
        elif b.reason == bands.FULL:
            assert b.width == cap and b.ratio is None
        elif b.reason == bands.TAIL:
            assert b.end == end and b.width < cap and b.ratio is None
        else:
            assert b.reason in (bands.BOUNDARY, bands.START) and b.ratio in rs
            assert b.end % b.ratio == 0 and b.width < cap and b.end < end
            assert (b.reason == bands.START) == (i == 0 and b.start % b.ratio != 0)


def _emission_inside(first: int, end: int, ratios) -> bool:
    """Does [first, end) hold a compressor emission position before its last token?"""
    return any((p + 1) % r == 0 for p in range(first, end - 1) for r in ratios)


def test_property_check_can_fail():
    """A planner that ignores boundaries is caught by the same emission check, and one that cuts
    bands short by the maximality check."""
    rs = (4, 128)
    naive = bands.fixed_bands(10, 4, start=1)
    assert any(_emission_inside(b.start, b.end, rs) for b in naive)
    timid = bands.plan(10, 0, rs, cap=2)  # maximal for cap 2, but not for cap 4
    assert not all(b.width == 4 or b.end == 10 or _emission_inside(b.start, b.end + 1, rs) for b in timid)


def test_summarize_widths():
    assert bands.summarize_widths([4, 4, 4, 2, 1]) == "4x3 2 1"
    assert bands.summarize_widths([]) == ""
    assert bands.summarize_widths([3, 1] * 40).startswith("counts 3:40 1:40")
