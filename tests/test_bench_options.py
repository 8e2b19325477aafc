"""`dflash bench` options through the CLI: --interleave (request order), --logits last, and the exit
status and evidence when the candidate is not exact (the stock library)."""
import json

import pytest

from .conftest import run_dflash, run_json

FAST = ("--threads", 1, "--runs", 2, "--warmup", 0, "--n-predict", 2)
ARMS = ["q1_a", "candidate", "q1_b"]
ARM_ORDER = [(arm, i) for arm in ARMS for i in range(2)]
INTERLEAVED = [(arm, i) for i in range(2) for arm in ARMS]


def bench(tmp_path_factory, name, *args):
    d = tmp_path_factory.mktemp(name) / "ev"
    return run_json("bench", *FAST, *args, "--evidence", d), d


def requests(d):
    return json.loads((d / "requests.json").read_text())["requests"]


def flavor(library):
    """The library's flavor: results name the library as {"flavor", "dir"} (a plain name before)."""
    return library["flavor"] if isinstance(library, dict) else library


def options(d):
    return json.loads((d / "options.json").read_text())


@pytest.fixture(scope="module")
def arm_order(tmp_path_factory):
    return bench(tmp_path_factory, "arms")


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    return bench(tmp_path_factory, "interleave", "--interleave")


@pytest.fixture(scope="module")
def last(tmp_path_factory):
    return bench(tmp_path_factory, "last", "--logits", "last")


def test_requests_run_arm_after_arm_without_interleave(arm_order):
    r, d = arm_order
    assert [(q["arm"], q["index"]) for q in requests(d)] == ARM_ORDER
    assert options(d)["interleave"] is False and options(d)["logits"] == "all"
    assert flavor(r["library"]) == "exact" and r["hashes_identical"] is True


def test_interleave_alternates_a_candidate_b(interleaved):
    r, d = interleaved
    reqs = requests(d)
    assert [(q["arm"], q["index"]) for q in reqs] == INTERLEAVED
    assert INTERLEAVED != ARM_ORDER  # the two orders are told apart
    assert options(d)["interleave"] is True
    assert not any(q["warmup"] for q in reqs)
    # the summary's per-arm samples are that arm's requests, in run order
    arms = {a["name"]: a for a in r["arms"]}
    for arm in ARMS:
        assert arms[arm]["samples"] == [q["tokens_per_second"] for q in reqs if q["arm"] == arm]
        assert arms[arm]["n"] == 2
    assert r["hashes_identical"] is True


def test_interleave_does_not_change_the_hashes(arm_order, interleaved):
    a, b = arm_order[0], interleaved[0]
    assert (a["logits_sha256"], a["response_sha256"]) == (b["logits_sha256"], b["response_sha256"])


def test_logits_last_hash_is_its_own_and_identical_everywhere(arm_order, last):
    r_all, _ = arm_order
    r, d = last
    reqs = requests(d)
    assert len(reqs) == 6 and options(d)["logits"] == "last"
    assert {q["logits_sha256"] for q in reqs} == {r["logits_sha256"]}  # every arm and run
    assert r["logits_hashes_identical"] is True and r["hashes_identical"] is True
    assert r["logits_sha256"] != r_all["logits_sha256"]  # one row hashed, not every row
    assert r["response_sha256"] == r_all["response_sha256"]  # the response does not depend on it


def test_bench_hashes_match_a_prefill_run(arm_order, last):
    """The same prompt through `dflash prefill` (q1) gives the bench's hashes in both modes."""
    for mode, (r, _) in (("all", arm_order), ("last", last)):
        p = run_json("prefill", "--threads", 1, "--n-predict", 2, "--logits", mode)
        assert set(p["widths"]) == {1}
        assert p["logits_sha256"] == r["logits_sha256"], mode
        assert p["response_sha256"] == r["response_sha256"], mode


def test_verify_passes_on_both_evidence_dirs(arm_order, last):
    for r, d in (arm_order, last):
        v = run_dflash("verify", d, "--manifest-sha256", r["manifest_sha256"])
        assert v.returncode == 0, v.stderr
    # (it can fail: the stock evidence below does)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    d = tmp_path_factory.mktemp("stock") / "ev"
    r = run_dflash("bench", *FAST, "--lib", "stock", "--chunk", 4, "--evidence", d, "--json")
    return r, d


def test_bench_exits_4_when_the_candidate_is_not_exact(stock):
    r, d = stock
    assert r.returncode == 4, r.stderr
    out = json.loads(r.stdout)
    assert flavor(out["library"]) == "stock" and out["chunk"] == 4
    assert out["hashes_identical"] is False and out["logits_hashes_identical"] is False
    assert "not exact" in r.stderr and str(d) in r.stderr and "Traceback" not in r.stderr
    # the evidence is written anyway, and it shows where the difference is: in the candidate only
    assert (d / "manifest.json").is_file() and out["evidence_dir"] == str(d)
    reqs = requests(d)
    assert [(q["arm"], q["index"]) for q in reqs] == ARM_ORDER
    by_arm = {arm: {q["logits_sha256"] for q in reqs if q["arm"] == arm} for arm in ARMS}
    assert by_arm["q1_a"] == by_arm["q1_b"] and len(by_arm["q1_a"]) == 1  # the reference is stable
    assert by_arm["candidate"].isdisjoint(by_arm["q1_a"])
    assert options(d)["lib"] == "stock" and max(json.loads((d / "schedules.json").read_text())["candidate"]) == 4


def test_verify_on_not_exact_evidence(stock):
    """verify finds every file intact and reports exactly the logits difference (exit 1: a bench
    manifest requires identical hashes across requests)."""
    r, d = stock
    v = run_dflash("verify", d, "--manifest-sha256", json.loads(r.stdout)["manifest_sha256"], "--json")
    rep = json.loads(v.stdout)
    assert v.returncode == 1 and rep["ok"] is False
    failed = [c["check"] for c in rep["checks"] if not c["ok"]]
    assert failed == ["requests.json: every requests item has the same logits_sha256"]
    passed = [c["check"] for c in rep["checks"] if c["ok"]]
    assert any("self_sha256 matches" in c for c in passed) and any("size and SHA-256" in c for c in passed)
    assert "no unlisted files" in passed and rep["n_files"] >= 10
    assert len(rep["problems"]) == 1 and "logits_sha256" in rep["problems"][0]
