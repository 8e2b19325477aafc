"""`dflash diff` and dflash.core.trace: the first differing graph node between two schedules.

The pure part is checked on synthetic node lists with a planted difference; end to end, the
stock build (q1 runs vec_dot, width 2 runs tinyBLAS) must name a node and the exact build must
report q1 and w4 identical."""
import numpy as np
import pytest

from dflash.core import trace
from dflash.core.errors import UsageError
from dflash.run import bands

from .conftest import run_dflash, run_json

D = 6  # values per position of the synthetic "hidden" node


def truth(pos: int, node: str) -> np.ndarray:
    """The value every schedule should compute for `node` at `pos`."""
    seed = sum(map(ord, node))
    return np.arange(D, dtype=np.float32) * (pos + 1) + seed


def decode_nodes(start: int, width: int, plant=()):
    """Nodes of one decode in graph order, as GraphTap.take() returns them: array shaped ne[::-1].
    `plant`: (position, node) pairs whose value gets one element nudged by one float step."""
    def per_token(name):
        rows = np.stack([truth(start + j, name) for j in range(width)])
        for pos, node in plant:
            if node == name and start <= pos < start + width:
                rows[pos - start, 2] = np.nextafter(rows[pos - start, 2], np.float32(np.inf))
        return rows
    nodes = [
        ("embd", "GET_ROWS", (D, width, 1, 1), per_token("embd")),
        ("x", "MUL_MAT", (D, width, 1, 1), per_token("x")),
        ("cache (view)", "VIEW", (D, 7, 1, 1), np.zeros((7, D), np.float32)),  # no token axis
        ("x", "ADD", (D, width, 1, 1), per_token("x#2")),                       # a repeated name
        ("topk", "ARGSORT", (2, width, 1, 1), np.tile(np.array([1, 0], np.int32), (width, 1))),
    ]
    return [(name, op, ne, a.reshape(ne[::-1])) for name, op, ne, a in nodes]


def build(widths, plant=()):
    n = sum(widths)
    tr, p = trace.new_trace(n), 0
    for w in widths:
        trace.add_decode(tr, decode_nodes(p, w, plant), p, w)
        p += w
    return tr


def test_identical_traces_report_no_difference():
    d = trace.compare(build([1] * 8), build([2, 2, 4]))
    assert d.identical and d.first is None and d.differing == []
    assert d.positions_compared == 8 and d.positions_differing == []
    # embd, x, x#2 and topk at each position; the view has no token axis, and topk (ne = (2, w))
    # has an ambiguous token axis in the width-2 decodes (positions 0..3), so it is skipped there
    assert d.n_compared == 8 * 4 - 4


@pytest.mark.parametrize("pos,node,key", [(5, "x", "x"), (0, "embd", "embd"), (7, "x#2", "x#2")])
def test_planted_difference_is_found(pos, node, key):
    d = trace.compare(build([1] * 8), build([2, 3, 3], plant=[(pos, node)]))
    assert not d.identical
    assert (d.first.position, d.first.key, d.first.n_differing, d.first.n_values) == (pos, key, 1, D)
    assert d.first.op == ("ADD" if key == "x#2" else "MUL_MAT" if key == "x" else "GET_ROWS")
    assert d.first.max_abs_delta > 0 and d.positions_differing == [pos]
    assert d.n_compared == (3 if pos < 2 else 4)  # topk is ambiguous in the width-2 band
    assert trace.compare(build([1] * 8), build([2, 3, 3], plant=[(pos, node)]), ignore=f"^{node[0]}").identical


def test_first_position_wins_over_graph_order():
    # a later node at an earlier position comes first
    d = trace.compare(build([1] * 8), build([4, 4], plant=[(6, "embd"), (4, "x#2")]))
    assert (d.first.position, d.first.key) == (4, "x#2") and d.positions_differing == [4, 6]


def test_token_axis_rule():
    assert trace.token_axis((D, 4, 1, 1), 4) == 1
    assert trace.token_axis((4, 1, 1, 1), 1) is None          # width 1: the whole node, no axis
    assert trace.token_axis((D, 7, 1, 1), 4) is None          # outermost dim is not the width
    assert trace.token_axis((256, 4, 4, 1), 4) is None        # kq with n_head == width: ambiguous
    assert trace.token_axis((256, 4, 4, 1), 4, strict=False) == 2
    assert trace.token_axis((1, 2, 2, 1), 2, strict=False) == 2  # routing weights, n_used == width


def test_rows_slice_the_token_axis_and_keep_the_row_shape():
    arr = np.arange(2 * 3 * 5, dtype=np.float32).reshape(3, 2, 5)  # ne = (5, 2, 3): tokens outermost
    rows = trace.rows([("h", "MUL", (5, 2, 3, 1), arr)], 3)
    assert [r[0].shape for r in rows] == [(5, 2, 1, 1)] * 3
    assert np.array_equal(rows[1][0].values, arr[1].ravel())
    whole = trace.rows([("h", "MUL", (5, 2, 1, 1), arr[1])], 1)[0][0]
    assert whole.shape == (5, 2, 1, 1) and trace.comparable(whole, rows[1][0])


def test_rows_of_other_shapes_are_not_compared():
    a, b = trace.new_trace(1), trace.new_trace(1)
    trace.add_decode(a, [("kq", "MUL_MAT", (8, 1, 1, 1), np.zeros((1, 1, 1, 8), np.float32))], 0, 1)
    trace.add_decode(b, [("kq", "MUL_MAT", (9, 1, 1, 1), np.ones((1, 1, 1, 9), np.float32))], 0, 1)
    d = trace.compare(a, b)
    assert d.identical and d.n_compared == 0


def test_bits_not_tolerance():
    a = np.array([[0.0, 1.0]], np.float32)
    assert not trace.bit_equal(a, np.array([[-0.0, 1.0]], np.float32))  # equal as floats, not as bits
    b = a.copy()
    b[0, 1] = np.nextafter(np.float32(1), np.float32(2))
    assert trace.first_differing_row(np.vstack([a, a]), np.vstack([a, b]))[:2] == (1, 1)
    assert trace.first_differing_row(a, a.copy()) == (None, 0, 0.0)


def test_parse_schedule():
    assert bands.parse_schedule("q1", 3) == [1, 1, 1]
    assert bands.parse_schedule("one", 10) == [10]
    assert bands.parse_schedule("w3", 10, (4, 128)) == [3, 3, 3, 1]         # ignores boundaries
    assert bands.parse_schedule("bands4", 10, (4, 128)) == [4, 4, 2]
    assert bands.parse_schedule("bands4", 6, ()) == [4, 2]
    assert bands.parse_schedule("3,1,6", 10) == [3, 1, 6]
    for bad in ("3,1", "w0", "fast", "4,,4", "0,10"):
        with pytest.raises(UsageError):
            bands.parse_schedule(bad, 10)


# ---------------------------------------------------------------------------------------------
# End to end (subprocesses: one llama.cpp library per process)

def test_stock_q1_vs_w2_names_a_node(tiny_models):
    d = run_json("diff", "--model", tiny_models["mxfp4"], "--lib", "stock", "--a", "q1", "--b", "w2",
                 "--n-tokens", 32, "--threads", 1, "--show", 5)
    assert d["logits_identical"] is False and isinstance(d["first_diff_position"], int)
    f = d["first_node"]
    assert f["name"] and f["op"] and isinstance(f["position"], int) and f["max_abs_delta"] > 0
    # tinyBLAS (width >= 2) against vec_dot (q1): the first difference is a matrix multiplication
    assert f["op"] == "MUL_MAT" and f["position"] == 0
    assert d["n_compared"] > 100 and 1 <= len(d["differing"]) <= 5 and d["identical"] is False


def test_exact_q1_vs_w4_identical(tiny_models):
    d = run_json("diff", "--model", tiny_models["mxfp4"], "--a", "q1", "--b", "w4", "--threads", 1)
    assert d["n_tokens"] == 64 and d["b"]["widths"] == "4x16"
    assert d["identical"] is True and d["logits_identical"] is True and d["first_node"] is None
    assert d["untapped_identical"] is True and d["tap_faithful"] is True  # the CPU backend fuses nothing
    assert d["n_compared"] > 64 * 100  # every position compared many nodes


def test_human_output_and_bad_schedule(tiny_models):
    r = run_dflash("diff", "--model", tiny_models["mxfp4"], "--lib", "stock", "--b", "w2",
                   "--n-tokens", 8, "--threads", 1, check=True)
    assert "first differing node" in r.stdout and "MUL_MAT" in r.stdout
    r = run_dflash("diff", "--model", tiny_models["mxfp4"], "--b", "4,4", "--n-tokens", 16)
    assert r.returncode == 2 and "covers 8 tokens" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_dflash("diff", "--model", tiny_models["mxfp4"], "--ignore", "(")
    assert r.returncode == 2 and "--ignore" in r.stderr
