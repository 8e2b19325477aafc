"""scripts/gpu-check --cpu-stand-in: the GPU check's own logic, run here with the CPU backend
standing in for the GPU (dflash/compare/gpu_check.py). Every summary line must say what it says on a good
build, the evidence directory must pass `dflash verify`, and the check must be able to fail: the
exact library's harness run with the planted bug FAILs its line, and a corrupted evidence file
fails verify. Needs the CPU libraries (scripts/setup); about a minute and a half on 2 idle cores."""
import json
import re
import shutil
import subprocess

import pytest

from dflash.native import build

from .conftest import ROOT, run_dflash

SCRIPT = ROOT / "scripts" / "gpu-check"
LINE = re.compile(r"^gpu-check: (PASS|FAIL|INFO|SKIP) ([a-z-]+): (.*)$")
EXPECTED = {"libraries": "PASS", "selftest": "SKIP", "harness": "PASS", "harness-wide": "PASS",
            "harness-planted": "PASS", "harness-twin": "PASS", "model": "PASS", "model-twin": "PASS",
            "qualify": "PASS", "evidence": "PASS"}


def gpu_check(*args, timeout=900):
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def lines(stdout: str) -> dict[str, tuple[str, str]]:
    out = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            assert m[2] not in out, f"two lines for {m[2]}"
            out[m[2]] = (m[1], m[3])
    return out


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    for flavor in build.FLAVORS:
        if not build.is_built(flavor):
            pytest.fail(f"the {flavor} llama.cpp library is not built: run scripts/setup")
    ev = tmp_path_factory.mktemp("gpu-check") / "evidence"
    r = gpu_check("--cpu-stand-in", ev)
    return r, ev


def test_every_summary_line_passes(stand_in):
    r, ev = stand_in
    got = lines(r.stdout)
    assert {k: v[0] for k, v in got.items()} == EXPECTED, r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stand-in subset" in got["harness"][1] and "on CPU" in got["harness"][1]
    assert "ncols 1..8" in got["harness"][1]
    assert re.search(r"differs in [1-9]\d*/", got["harness-twin"][1])  # the twin really differs
    assert re.search(r"differs from q1 in 1/1", got["model-twin"][1])
    assert "10/10 cases" in got["harness-planted"][1]
    final = r.stdout.strip().splitlines()[-1]
    assert final.startswith("gpu-check: PASS: 10/10 lines") and str(ev) in final


def test_the_evidence_holds_every_check_and_verifies(stand_in):
    r, ev = stand_in
    summary = json.loads((ev / "summary.json").read_text())
    assert summary["ok"] and summary["mode"] == "cpu-stand-in"
    # every line but the evidence line itself (it is about the sealed directory)
    assert summary["lines"] == [x for x in r.stdout.splitlines() if LINE.match(x) and " evidence: " not in x]
    for name in ("libraries.json", "harness-exact.jsonl", "harness-twin.jsonl", "harness-exact-planted.jsonl",
                 "qualify.json", "machine.txt", "summary.txt"):
        assert (ev / name).is_file(), name
    v = run_dflash("verify", ev, "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["ok"], v.stdout + v.stderr


def test_a_corrupted_evidence_file_fails_verify(stand_in, tmp_path):
    _, ev = stand_in
    bad = tmp_path / "corrupted"
    shutil.copytree(ev, bad)
    target = bad / "harness-exact.jsonl"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    v = run_dflash("verify", bad)
    assert v.returncode == 1 and "harness-exact.jsonl" in v.stderr, v.stderr


def test_the_planted_bug_fails_the_harness_line(tmp_path):
    """--plant-exact gives the exact library's narrow harness run the planted bug: its line must
    FAIL (and the run exit 1), the rest of the harness check is unchanged."""
    r = gpu_check("--cpu-stand-in", tmp_path / "planted", "--checks", "harness", "--plant-exact")
    got = lines(r.stdout)
    assert got["harness"][0] == "FAIL" and "differing:" in got["harness"][1], r.stdout + r.stderr[-2000:]
    assert got["harness-planted"][0] == "PASS" and got["harness-twin"][0] == "PASS"
    assert got["evidence"][0] == "PASS" and r.returncode == 1
