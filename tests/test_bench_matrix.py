"""bench (A/B/A with evidence), verify on its evidence, matrix, devices and the kernel self-test."""
import json
import shutil

import pytest

from dflash.native import devices

from .conftest import ROOT, run_dflash, run_json

EXAMPLE = ROOT / "evidence" / "example-bench-tiny"


@pytest.fixture(scope="module")
def bench_exact(tmp_path_factory, tiny_models):
    d = tmp_path_factory.mktemp("bench") / "ev"
    r = run_json("bench", "--model", tiny_models["mxfp4"], "--warmup", 1, "--runs", 3, "--threads", 2,
                 "--n-predict", 4, "--evidence", d)
    return r, d


def test_bench_reports_three_arms_and_identical_hashes(bench_exact):
    r, d = bench_exact
    assert [a["name"] for a in r["arms"]] == ["q1_a", "candidate", "q1_b"]
    for a in r["arms"]:
        assert len(a["samples"]) == 3 and a["median"] > 0 and a["mad"] >= 0
    assert isinstance(r["gain_percent"], float) and isinstance(r["drift_percent"], float)
    assert r["hashes_identical"] is True
    assert r["evidence_dir"] == str(d) and len(r["manifest_sha256"]) == 64
    requests = json.loads((d / "requests.json").read_text())["requests"]
    assert len(requests) == 3 * 4 and {q["arm"] for q in requests} == {"q1_a", "candidate", "q1_b"}


def test_verify_passes_then_catches_one_changed_byte(bench_exact, tmp_path):
    _, d = bench_exact
    ok = run_dflash("verify", d, "--manifest-sha256", bench_exact[0]["manifest_sha256"])
    assert ok.returncode == 0, ok.stderr
    for name in ("requests.json", "library.json", "manifest.json"):
        copy = tmp_path / name
        shutil.copytree(d, copy)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        bad = run_dflash("verify", copy)
        assert bad.returncode == 1 and name in bad.stderr and "Traceback" not in bad.stderr


def test_bench_on_stock_build_detects_difference(tiny_models, tmp_path):
    r = run_dflash("bench", "--model", tiny_models["q8_0"], "--lib", "stock", "--warmup", 0, "--runs", 1,
                   "--threads", 2, "--n-predict", 4, "--evidence", tmp_path / "ev", "--json")
    assert r.returncode == 4, r.stderr
    assert json.loads(r.stdout)["hashes_identical"] is False
    # its evidence records the difference, and verify refuses it
    v = run_dflash("verify", tmp_path / "ev")
    assert v.returncode == 1 and "differs" in v.stderr


def test_committed_example_evidence_verifies():
    assert (EXAMPLE / "manifest.json").is_file()
    r = run_dflash("verify", EXAMPLE)
    assert r.returncode == 0, r.stderr
    summary = json.loads((EXAMPLE / "summary.json").read_text())
    assert summary["hashes_identical"] is True and len(summary["arms"]) == 3


def test_matrix_cpu_rows(tiny_models):
    r = run_json("matrix", "--model", tiny_models["q8_0"], "--n-predict", 4)
    rows = {d["config"]: d for d in r["rows"]}
    assert {"cpu t1 exact", "cpu t2 exact", "cpu t1 stock", "cpu t2 stock"} <= set(rows)
    assert r["exact_all_equal"] is True
    for name in ("cpu t1 exact", "cpu t2 exact"):
        assert rows[name]["q1_equals_bands"] and rows[name]["logits_equal_reference"]
    assert not rows["cpu t1 stock"]["q1_equals_bands"]  # the stock build is caught differing
    hip, reason = devices.hip_devices()
    if not hip:
        assert any("hip" in s["config"] and s["reason"] for s in r["skipped"])


def test_devices_and_selftest_without_gpu():
    d = run_json("devices")
    assert d["devices"][0]["id"] == "cpu"
    hip, reason = devices.hip_devices()
    assert d["hip_available"] == bool(hip)
    r = run_dflash("kernels", "selftest")
    if hip:
        pytest.skip(f"a HIP device is present ({hip[0].name}): the no-device path cannot be shown here")
    assert d["hip_reason"] == reason and reason
    assert r.returncode == 3 and "no HIP device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    for cmd in (["prefill", "--device", "hip:0"], ["bench", "--device", "hip:1"]):
        r = run_dflash(*cmd)
        assert r.returncode == 3 and "no HIP device" in r.stderr
    assert run_dflash("prefill", "--device", "cuda").returncode == 2
