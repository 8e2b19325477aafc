"""`dflash sweep`: parsing, the schedule and summary math (pure), one short real run, and the
NLL benchmark's arithmetic. Speed is never asserted."""
import importlib.util
import json
import math

import numpy as np
import pytest

from dflash.compare import sweep
from dflash.compare.sweep import repeat_to
from dflash.core.errors import UsageError

from .conftest import ROOT, run_dflash, run_json
from .test_cli import assert_one_line_error


def test_parse_widths():
    assert sweep.parse_widths("1,4,64,512") == (1, 4, 64, 512)
    assert sweep.parse_widths(" 64, 4,4 ") == (1, 4, 64)  # sorted, distinct, q1 added
    for bad in ("", "1,x", "1,,4", "-4", "0,4", "1.5", "4;8"):
        with pytest.raises(UsageError, match="^widths"):
            sweep.parse_widths(bad)


def test_parse_libs():
    assert sweep.parse_libs("exact,stock") == ("exact", "stock")
    assert sweep.parse_libs("stock, exact,stock") == ("stock", "exact")
    for bad, needle in (("", "empty"), ("exact,fast", "'fast'"), (" , ", "empty")):
        with pytest.raises(UsageError, match=needle):
            sweep.parse_libs(bad)


def test_clamp_widths():
    assert sweep.clamp_widths((1, 4, 64), 100) == ((1, 4, 64), [])
    widths, warnings = sweep.clamp_widths((1, 4, 64, 512), 50)
    assert widths == (1, 4, 50) and "64, 512 clamped to 50" in warnings[0]


def test_repeat_to():
    tok = lambda s: list(range(1 + len(s) // 5))  # BOS + one token per 5 characters
    text, tokens, k = repeat_to(tok, "abcdefghij", 3)
    assert (text, k, len(tokens)) == ("abcdefghij", 1, 3)
    text, tokens, k = repeat_to(tok, "abcdefghij", 40)
    assert len(tokens) >= 40 and text == " ".join(["abcdefghij"] * k)
    assert len(tok(" ".join(["abcdefghij"] * (k - 1)))) < 40  # the fewest repeats that reach it


def test_schedule_puts_each_widths_libraries_back_to_back_and_alternates_them():
    todo = sweep.schedule(("exact", "stock"), (1, 4), warmup=1, runs=2)
    assert todo[:4] == [("exact", 1, "verify", 0), ("exact", 4, "verify", 0),
                        ("stock", 1, "verify", 0), ("stock", 4, "verify", 0)]
    rounds = [todo[4 + 4 * i: 8 + 4 * i] for i in range(3)]
    assert [[x[:2] for x in r] for r in rounds] == [
        [("exact", 1), ("stock", 1), ("stock", 4), ("exact", 4)],   # warm-up
        [("stock", 1), ("exact", 1), ("exact", 4), ("stock", 4)],   # timed round 0
        [("exact", 1), ("stock", 1), ("stock", 4), ("exact", 4)]]   # timed round 1
    assert [x[2] for x in rounds[0]] == ["warmup"] * 4
    assert [x[3] for x in todo if x[2] == "timed"] == [0] * 4 + [1] * 4


def test_schedule_with_decode_ends_every_round_with_one_decode_per_library():
    todo = sweep.schedule(("exact", "stock"), (1, 4), warmup=1, runs=2, decode=True)
    decodes = [x for x in todo if x[2].startswith("decode")]
    assert decodes == [("exact", 4, "decode-warmup", 0), ("stock", 4, "decode-warmup", 0),
                       ("stock", 4, "decode", 0), ("exact", 4, "decode", 0),
                       ("exact", 4, "decode", 1), ("stock", 4, "decode", 1)]
    assert [x for x in todo if not x[2].startswith("decode")] == sweep.schedule(("exact", "stock"), (1, 4), 1, 2)


def test_paired_ratios_pair_the_libraries_round_by_round():
    tps = {("exact", 0): 10.0, ("stock", 0): 20.0, ("exact", 1): 30.0, ("stock", 1): 10.0, ("exact", 2): 5.0}
    samples = [sweep.Sample(lib, 4, "timed", rnd, 1.0, v, "L", "R", 1) for (lib, rnd), v in tps.items()]
    samples.append(sweep.Sample("exact", 1, "timed", 0, 1.0, 99.0, "L", "R", 1))  # another width: not paired
    assert sweep.paired_ratios(samples, "timed", 4) == (0.5, 3.0)  # round 2 has no stock request
    tax = sweep.Tax(4, 10.0, 20.0, (0.5, 3.0, 1.0))
    assert tax.paired_median == 1.0 and tax.to_json()["median_paired_ratio"] == 1.0
    assert sweep.Tax(4, 1.0, 1.0).paired_median is None
    dec = [sweep.Sample(lib, 4, "decode", 0, 1.0, 0.0, "L", "R", 1, v) for lib, v in (("exact", 8.0), ("stock", 10.0))]
    assert sweep.paired_ratios(dec, "decode") == (0.8,)


def test_decode_summary_and_ratio():
    runs = [("exact", "decode-warmup", 1.0), ("exact", "decode", 9.0), ("exact", "decode", 11.0),
            ("stock", "decode", 20.0), ("stock", "decode", 20.0), ("stock", "timed", 99.0)]
    samples = [sweep.Sample(lib, 4, kind, 0, 1.0, 10.0, "L", "R", 1, tps) for lib, kind, tps in runs]
    rows = sweep.summarize_decode(samples, ("exact", "stock"))
    assert [(d.lib, d.median, d.samples) for d in rows] == [("exact", 10.0, (9.0, 11.0)), ("stock", 20.0, (20.0, 20.0))]
    r = sweep.SweepResult(("exact", "stock"), (1, 4), 2, 0, 1, 100, 1, "m.gguf", [], [], None, decode_tokens=8,
                          decode=rows, decode_paired=(0.4, 0.6, 0.5))
    d = json.loads(json.dumps(r.to_json()))
    assert d["decode_exact_over_stock"] == pytest.approx(0.5) and d["decode_tokens"] == 8
    assert d["decode_median_paired_ratio"] == pytest.approx(0.5) and d["decode_paired_ratios"] == [0.4, 0.6, 0.5]
    assert d["decode"][0] == {"lib": "exact", "median_tokens_per_second": 10.0, "mad": 1.0, "samples": [9.0, 11.0],
                              "n": 2}
    assert sweep.SweepResult(("exact",), (1,), 1, 0, 1, 1, 1, "m", [], [], None).to_json()["decode"] == []


def sample(lib, w, kind, tps, logits="L", resp="R", rnd=0):
    return sweep.Sample(lib, w, kind, rnd, 100 / tps, tps, logits, resp, 100 // w)


def test_summary_math():
    samples = [sample("exact", 1, "verify", 1.0), sample("exact", 4, "verify", 1.0),
               sample("stock", 1, "verify", 1.0, logits="S"), sample("stock", 4, "verify", 1.0, logits="T")]
    samples += [sample(lib, w, "warmup", 1.0) for lib in ("exact", "stock") for w in (1, 4)]  # ignored
    for i, (e1, e4, s1, s4) in enumerate([(10, 30, 20, 80), (12, 34, 22, 70), (11, 32, 18, 90)]):
        samples += [sample("exact", 1, "timed", e1, rnd=i), sample("exact", 4, "timed", e4, rnd=i),
                    sample("stock", 1, "timed", s1, rnd=i), sample("stock", 4, "timed", s4, rnd=i)]
    rows, taxes, stock_q1 = sweep.summarize(samples, ("exact", "stock"), (1, 4))
    by = {(r.lib, r.width): r for r in rows}
    assert stock_q1 == 20
    assert by[("exact", 4)].median == 32 and by[("exact", 4)].mad == 2 and by[("exact", 4)].samples == (30, 34, 32)
    assert by[("exact", 4)].exact and by[("exact", 1)].exact
    assert by[("stock", 1)].exact and not by[("stock", 4)].exact  # logits T differ from its q1's S
    assert by[("exact", 4)].speedup_vs_stock_q1 == pytest.approx(1.6)
    assert by[("exact", 4)].speedup_vs_lib_q1 == pytest.approx(32 / 11)
    assert [(t.width, t.ratio) for t in taxes] == [(1, pytest.approx(11 / 20)), (4, pytest.approx(32 / 80))]
    assert taxes[1].paired == pytest.approx((30 / 80, 34 / 70, 32 / 90))
    assert taxes[1].paired_median == pytest.approx(30 / 80)
    r = sweep.SweepResult(("exact", "stock"), (1, 4), 3, 1, 1, 100, 1, "m.gguf", rows, taxes, stock_q1)
    d = json.loads(json.dumps(r.to_json()))
    assert d["exact_library_exact"] is True and d["exactness_tax"][1]["exact_over_stock"] == pytest.approx(0.4)
    assert {"lib", "width", "median_tokens_per_second", "mad", "exact", "samples"} <= set(d["rows"][0])
    png = sweep.plot_png(r)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_summary_without_stock_has_no_stock_speedup():
    samples = [sample("exact", w, k, 5.0 * w) for w in (1, 4) for k in ("verify", "timed")]
    rows, taxes, stock_q1 = sweep.summarize(samples, ("exact",), (1, 4))
    assert stock_q1 is None and taxes == [] and rows[1].speedup_vs_stock_q1 is None
    assert rows[1].speedup_vs_lib_q1 == 4.0


@pytest.mark.parametrize("args,needle", [
    (["--widths", "1,x"], "--widths"), (["--widths", "0"], "--widths"), (["--libs", "exact,fast"], "'fast'"),
    (["--libs", ""], "--libs"), (["--plot", "/nonexistent/dir/p.png"], "--plot"),
    (["--prompt", "  "], "prompt is empty"), (["--runs", "0"], "--runs"),
])
def test_sweep_bad_input_is_one_line_exit_2(args, needle):
    assert_one_line_error(run_dflash("sweep", *args), 2, needle)


def test_sweep_runs_and_its_evidence_verifies(tmp_path, tiny_models):
    ev, png = tmp_path / "ev", tmp_path / "sweep.png"
    d = run_json("sweep", "--model", tiny_models["f32"], "--widths", "1,4", "--libs", "exact", "--runs", 1,
                 "--warmup", 0, "--threads", 1, "--evidence", ev, "--plot", png)
    assert [(r["lib"], r["width"]) for r in d["rows"]] == [("exact", 1), ("exact", 4)]
    for r in d["rows"]:
        assert r["exact"] is True and r["median_tokens_per_second"] > 0 and len(r["samples"]) == 1
        assert r["mad"] == 0 and r["speedup_vs_stock_q1"] is None
    assert d["n_prompt_tokens"] >= 4 and d["threads"] == 1 and d["exact_library_exact"] is True
    assert png.read_bytes() == (ev / "sweep.png").read_bytes()
    assert json.loads((ev / "results.json").read_text())["rows"] == d["rows"]
    requests = json.loads((ev / "requests.json").read_text())["requests"]
    assert sorted((q["kind"], q["width"]) for q in requests) == [
        ("timed", 1), ("timed", 4), ("verify", 1), ("verify", 4)]
    v = run_json("verify", ev, "--manifest-sha256", d["manifest_sha256"])
    assert v["ok"] is True and v["n_hash_checks"] == 2


def test_sweep_long_prompt_and_decode(tmp_path, tiny_models):
    """--prompt-tokens cuts the repeated prompt to exactly that many tokens; --decode times greedy
    tokens after it, one decode request per library and round."""
    d = run_json("sweep", "--model", tiny_models["f32"], "--widths", "1,4", "--libs", "exact", "--runs", 2,
                 "--warmup", 0, "--threads", 1, "--prompt-tokens", 45, "--decode", 6, "--evidence", tmp_path / "ev")
    assert d["n_prompt_tokens"] == 45 and d["decode_tokens"] == 6 and d["exact_library_exact"] is True
    (row,) = d["decode"]
    assert row["lib"] == "exact" and row["n"] == 2 and row["median_tokens_per_second"] > 0
    assert d["decode_exact_over_stock"] is None  # no stock library in this run
    requests = json.loads((tmp_path / "ev" / "requests.json").read_text())["requests"]
    assert [q["kind"] for q in requests].count("decode") == 2


def _nll_module():
    spec = importlib.util.spec_from_file_location("nll_bench", ROOT / "benchmarks" / "nll.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nll_arithmetic():
    mean_nll = _nll_module().mean_nll
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((70, 9)).astype(np.float32) * 5
    tokens = list(rng.integers(0, 9, 70))
    x = logits.astype(np.float64)
    want = np.mean([math.log(np.exp(x[t]).sum()) - x[t, tokens[t + 1]] for t in range(69)])
    assert mean_nll(logits, tokens, rows=8) == pytest.approx(want, rel=1e-12)
    assert mean_nll(np.zeros((3, 4), np.float32), [0, 1, 2]) == pytest.approx(math.log(4))


def test_nll_missing_text_is_a_clear_error(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nll.py"), "--model", str(tmp_path / "m.gguf"),
                        "--text-file", str(tmp_path / "none.txt")], capture_output=True, text=True)
    assert p.returncode == 2 and "none.txt not found" in p.stderr and "Traceback" not in p.stderr


def test_committed_sweep_example_verifies():
    """The committed sweep (tiny Q4_K_M model, exact vs stock, widths 1..512) is intact, and its
    verification records show every exact-library width with q1's hashes."""
    example = ROOT / "evidence" / "example-sweep-tiny-q4_k_m"
    r = run_dflash("verify", example)
    assert r.returncode == 0, r.stderr
    rows = json.loads((example / "results.json").read_text())["rows"]
    assert {(x["lib"], x["width"]) for x in rows} >= {("exact", w) for w in (1, 4, 64, 512)}
    assert all(x["exact"] for x in rows if x["lib"] == "exact")
    assert not all(x["exact"] for x in rows if x["lib"] == "stock")
