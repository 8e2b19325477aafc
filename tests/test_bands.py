"""The band planner against the rule in docs (exactness.md section 2) and its properties."""
import pytest
from hypothesis import given, settings, strategies as st

from dflash import bands as B

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
    assert B.widths(B.plan(n, start, ratios, cap)) == expect


def test_bands_off_is_q1():
    plan = B.plan(10, 0, (4, 128), cap=4, bands_on=False)
    assert B.widths(plan) == [1] * 10
    assert {b.reason for b in plan} == {B.Q1}


def test_reasons_name_each_downshift():
    plan = B.plan(10, 1, (4, 128), 4)
    assert [(b.reason, b.ratio) for b in plan] == [(B.START, 4), (B.FULL, None), (B.TAIL, None)]
    plan = B.plan(8, 0, (4, 128), 3)   # cap 3 against ratio 4: 3, then 1 to reach the boundary
    assert [(b.width, b.reason, b.ratio) for b in plan] == [
        (3, B.FULL, None), (1, B.BOUNDARY, 4), (3, B.FULL, None), (1, B.TAIL, None)]


def test_kernel_family_follows_narrow_ceiling():
    plan = B.plan(8, 0, (), cap=4, mmvq_max_ncols=3)
    assert [b.kernel for b in plan] == [B.BATCHED, B.BATCHED]
    assert {b.kernel for b in B.plan(8, 0, (), cap=3, mmvq_max_ncols=3)} == {B.NARROW}


@pytest.mark.parametrize("kw", [dict(n_tokens=-1), dict(start=-1), dict(cap=0), dict(mmvq_max_ncols=0)])
def test_rejects_bad_arguments(kw):
    args = dict(n_tokens=4, start=0, ratios=(4,), cap=4, mmvq_max_ncols=4) | kw
    with pytest.raises(ValueError):
        B.plan(**args)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 600), start=st.integers(0, 700), ratios=RATIO_SETS,
       cap=st.integers(1, 9), bands_on=st.booleans())
def test_properties(n, start, ratios, cap, bands_on):
    plan = B.plan(n, start, ratios, cap, bands_on)
    rs = [r for r in ratios if r > 0]
    # tiles [start, start + n) in order
    pos = start
    for b in plan:
        assert b.start == pos and b.width >= 1
        pos = b.end
    assert pos == start + n
    for b in plan:
        # no emission position except as the band's last token
        assert not any((p + 1) % r == 0 for p in range(b.start, b.end - 1) for r in rs)
        # never above the cap; width 1 everywhere with bands off
        assert b.width <= (cap if bands_on else 1)
        # maximal: one more token would break the cap, the tail or the boundary rule
        limit = min([cap if bands_on else 1, start + n - b.start] + [r - b.start % r for r in rs])
        assert b.width == limit


def test_property_check_can_fail():
    """A planner that ignores boundaries is caught by the same emission check."""
    rs = (4, 128)
    naive = B.fixed_bands(10, 4, start=1)
    assert any((p + 1) % r == 0 for b in naive for p in range(b.start, b.end - 1) for r in rs)


def test_summarize_widths():
    assert B.summarize_widths([4, 4, 4, 2, 1]) == "4x3 2 1"
    assert B.summarize_widths([]) == ""
    assert B.summarize_widths([3, 1] * 40).startswith("counts 3:40 1:40")
