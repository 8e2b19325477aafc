"""`dflash qualify`: per-width exactness against q1, the recommendation and its evidence.

The exact build must qualify every cap 1..8 (logits, response and routing identical); the stock
build must fail widths >= 2 at a named position, which shows the check can fail."""
import json

import numpy as np
import pytest

from dflash.core import trace
from dflash.proof import qualify
from dflash.run import bands

from .conftest import HOST_HAS_AMX, run_dflash, run_json

DS4 = (0, 4, 128, 4, 128)


# ---------------------------------------------------------------------------------------------
# Pure parts

def test_default_resume_point():
    assert qualify.default_resume_point(373) == 125   # the built-in prompt on the tiny model
    assert qualify.default_resume_point(9) == 5       # 4 is aligned: skip it
    assert qualify.default_resume_point(383) == 129   # 128 is aligned to both ratios
    for n in range(3, 3000):
        p = qualify.default_resume_point(n)
        assert p > n / 3 and p % 4 and p % 128
        assert all(q % 4 == 0 or q % 128 == 0 for q in range(n // 3 + 1, p))  # the first such p


def test_recommend_all_exact_caps_at_band_max():
    r = qualify.recommend({w: True for w in range(1, 9)}, {w: min(w, 4) for w in range(1, 9)})
    assert (r["largest_exact_cap"], r["largest_exact_width"], r["recommended_cap"]) == (8, 4, 4)
    assert r["recommended_bands"] is True and r["recommended_mmvq_max_ncols"] == 4
    assert r["recommended_env"] == {"DFLASH_DS4_EXACT_PREFILL_BANDS": "1", "LUCE_MMVQ_MAX_NCOLS": "4"}
    assert qualify.recommend({1: True, 2: True, 3: True})["recommended_cap"] == 3


@pytest.mark.parametrize("verdicts,largest,cap", [
    ({1: True, 2: False, 3: True, 4: True}, 1, 1),     # only q1: bands off
    ({1: True, 2: True, 3: False, 4: True}, 2, 2),     # an inexact width stops the run
    ({1: True, 2: True, 4: True, 8: True}, 2, 2),      # width 3 was not run: not vouched for
    ({1: False, 2: True}, 0, 1),                       # q1 not even reproducible
    ({2: True, 3: True}, 0, 1),                        # no q1 repeat at all
])
def test_recommend_stops_at_the_first_gap(verdicts, largest, cap):
    r = qualify.recommend(verdicts)
    assert (r["largest_exact_cap"], r["recommended_cap"]) == (largest, cap)
    assert r["recommended_bands"] is (cap > 1)
    assert r["recommended_env"]["DFLASH_DS4_EXACT_PREFILL_BANDS"] == ("1" if cap > 1 else "0")


def plans(n, resume, caps, ratios=DS4):
    return {w: bands.plan(resume, 0, ratios, w) + bands.plan(n - resume, resume, ratios, w) for w in caps}


def test_coverage_of_the_default_prompt():
    c = qualify.coverage(373, DS4, 64, 125, plans(373, 125, range(1, 9)))
    assert c["missing"] == [] and c["resume_unaligned"]
    assert [x["crossed"] for x in c["crossings"]] == [True, True, True]
    assert c["widths_with_start_band"] == [4, 5, 6, 7, 8] and 2 in c["widths_with_tail_band"]


@pytest.mark.parametrize("n,resume,caps,needle", [
    (100, 34, range(1, 9), "compress ratio 128"),
    (60, 21, range(1, 9), "sliding window 64"),
    (373, 128, range(1, 9), "not an unaligned"),
    (373, 126, [1, 2], "'start' band"),          # 126 % 4 == 2: cap 2 is not cut there
    (372, 126, [2], "'tail' band"),              # every part ends on a full band
])
def test_coverage_names_what_is_missing(n, resume, caps, needle):
    c = qualify.coverage(n, DS4, 64, resume, plans(n, resume, caps))
    assert any(needle in m for m in c["missing"]), c["missing"]


def routing_trace(n, weights_at=None):
    """A synthetic routing trace of 2 layers; weights at (position, layer) nudged when given."""
    tr = trace.new_trace(n)
    for p in range(n):
        nodes = []
        for layer in range(2):
            ids = np.array([[(p + layer) % 4, (p + layer + 1) % 4]], np.int32)
            w = np.array([[[0.75], [0.25]]], np.float32)
            if weights_at == (p, layer):
                w[0, 1, 0] = np.nextafter(w[0, 1, 0], np.float32(1))
            nodes += [(f"ffn_moe_topk-{layer}", "VIEW", (2, 1, 1, 1), ids.reshape(1, 1, 1, 2)),
                      (f"ffn_moe_weights_scaled-{layer}", "SCALE", (1, 2, 1, 1), w.reshape(1, 1, 2, 1))]
        trace.add_decode(tr, nodes, p, 1, strict=False)
    return tr


def test_first_routing_diff():
    ref = routing_trace(5)
    assert qualify.routing_layers(ref) == [0, 1]
    assert qualify.first_routing_diff(ref, routing_trace(5)) is None
    d = qualify.first_routing_diff(ref, routing_trace(5, weights_at=(3, 1)))
    assert (d["position"], d["layer"], d["field"], d["problem"]) == (3, 1, "weights", "differs")
    short = routing_trace(5)
    short[4] = {}
    assert qualify.first_routing_diff(ref, short)["problem"] == "missing"


# ---------------------------------------------------------------------------------------------
# End to end (subprocesses: one llama.cpp library per process)

def test_exact_build_qualifies_every_width(tiny_models, tmp_path):
    ev = tmp_path / "qualify-exact"
    d = run_json("qualify", "--model", tiny_models["mxfp4"], "--threads", 1, "--evidence", ev)
    assert d["widths"] == list(range(1, 9)) and [r["width"] for r in d["results"]] == list(range(1, 9))
    for r in d["results"]:
        assert r["exact"] and r["logits_identical"] and r["first_diff_position"] is None, r
        assert r["response_identical"] and r["routing_identical"] is True and r["max_abs_diff"] == 0.0
    assert d["moe"] and d["routing_layers"] and d["all_exact"]
    # the planner stops at 4 (ratio-4 boundaries); the fixed-width runs decode 5..8-wide bands
    assert d["recommended_cap"] == 4 and d["largest_exact_cap"] == 8 and d["largest_exact_width"] == 8
    for r in d["results"][1:]:
        f = r["fixed_width"]
        assert f["exact"] and f["widest_band"] == r["width"] and r["planner_exact"]
    assert d["recommended_env"]["LUCE_MMVQ_MAX_NCOLS"] == "4"
    c = d["coverage"]
    assert c["missing"] == [] and c["n_tokens"] == 373 and c["resume_at"] == 125
    assert c["widths_with_start_band"] and c["widths_with_tail_band"]
    assert d["evidence_dir"] == str(ev)
    v = run_json("verify", ev, "--manifest-sha256", d["manifest_sha256"])
    assert v["ok"] and v["n_hash_checks"] == 3
    req = json.loads((ev / "requests.json").read_text())
    assert len(req["exact_requests"]) == len(req["requests"]) == 16  # q1 ref, caps 1..8, fixed 2..8
    assert json.loads((ev / "results.json").read_text())["results"] == d["results"]


def test_stock_build_fails_widths_above_one(tiny_models, tmp_path):
    ev = tmp_path / "qualify-stock"
    d = run_json("qualify", "--model", tiny_models["mxfp4"], "--lib", "stock", "--widths", "2,4",
                 "--threads", 1, "--n-predict", 4, "--evidence", ev)
    by = {r["width"]: r for r in d["results"]}
    assert sorted(by) == [1, 2, 4]
    assert by[1]["exact"] and by[1]["first_diff_position"] is None  # q1 is reproducible
    for w in (2, 4):
        assert by[w]["exact"] is False and by[w]["logits_identical"] is False
        assert isinstance(by[w]["first_diff_position"], int) and by[w]["max_abs_diff"] > 0
        assert by[w]["routing_identical"] is False and by[w]["first_routing_diff"]["position"] >= 0
        assert by[w]["fixed_width"]["exact"] is False and by[w]["planner_exact"] is False
    assert d["recommended_cap"] == 1 and d["largest_exact_cap"] == 1 and not d["all_exact"]
    assert run_json("verify", ev)["ok"]  # the evidence holds only the exact runs to identical hashes
    req = json.loads((ev / "requests.json").read_text())
    assert [q["label"] for q in req["exact_requests"]] == ["q1 reference", "q1 repeat"]


def test_human_table_and_short_prompt(tiny_models, tmp_path):
    r = run_dflash("qualify", "--model", tiny_models["mxfp4"], "--lib", "stock", "--widths", "4",
                   "--threads", 1, "--n-predict", 0, "--evidence", tmp_path / "ev", check=True)
    assert "recommended" in r.stdout and "q1 (bands off)" in r.stdout and "NO" in r.stdout
    assert "covers    prompts of up to 373 tokens" in r.stdout
    bufts = "AMX,CPU_REPACK (with AMX)" if HOST_HAS_AMX else "CPU_REPACK (without AMX)"
    assert f"vouches   for native build, CPU buffer types {bufts}, kernel switches none" in r.stdout
    # cap 2 is never cut at the default resume point 125 (safe width 3): no 'start' band
    r = run_dflash("qualify", "--model", tiny_models["mxfp4"], "--widths", "2", "--evidence", tmp_path / "e2")
    assert r.returncode == 2 and "'start' band" in r.stderr and "--resume-at" in r.stderr
    r = run_dflash("qualify", "--model", tiny_models["mxfp4"], "--prompt", "too short a prompt " * 20,
                   "--evidence", tmp_path / "never")
    assert r.returncode == 2 and "does not cross" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()
