"""CTest from pytest, with skips counted as failures.

CTest reports a skipped test (SKIP_REGULAR_EXPRESSION, SKIP_RETURN_CODE) as passed: "100% tests
passed" and exit 0, even when the skipped test is the one that mattered. `run_ctest` reads each
test's status from CTest's JUnit file instead and fails on every test that did not run and pass,
unless the caller names that test as an expected skip, with the reason."""
from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The CTest tests of this project that may be skipped on a machine scripts/setup prepared, each with
# its reason. None today: the only test with a skip rule, ggml_patch_applies, skips when the pinned
# llama.cpp source is missing, and that is a broken setup (`dflash build` puts it in the dflash
# cache, $XDG_CACHE_HOME/dflash or ~/.cache/dflash, where hip_kernels/CMakeLists.txt looks).
EXPECTED_SKIPS: dict[str, str] = {}


@dataclass(frozen=True)
class Result:
    name: str
    status: str    # "passed", "failed", "skipped", "disabled" or "not run"
    message: str   # CTest's reason for anything but a pass ("" for a pass)
    output: str


def parse_junit(path: Path) -> dict[str, Result]:
    """name -> Result, from `ctest --output-junit` (CTest >= 3.21)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name, status = case.get("name", ""), case.get("status", "")
        failure, skipped = case.find("failure"), case.find("skipped")
        text = case.findtext("system-out") or ""
        if failure is not None or status == "fail":
            r = Result(name, "failed", (failure.get("message", "") if failure is not None else "") or "failed", text)
        elif status == "disabled":
            r = Result(name, "disabled", "DISABLED", text)
        elif skipped is not None and skipped.get("message", "").startswith("SKIP_"):
            r = Result(name, "skipped", skipped.get("message", ""), text)
        elif skipped is not None or status != "run":
            r = Result(name, "not run", (skipped.get("message", "") if skipped is not None else status), text)
        else:
            r = Result(name, "passed", "", text)
        out[name] = r
    return out


def problems(results: Mapping[str, Result], expected_skips: Mapping[str, str]) -> list[str]:
    """One line per test that neither passed nor is an expected skip (a skip or a disabled test
    named in expected_skips); failures and tests that could not run are never excused."""
    bad = []
    for r in results.values():
        if r.status == "passed" or (r.status in ("skipped", "disabled") and r.name in expected_skips):
            continue
        tail = r.output.strip().splitlines()[-3:]
        bad.append(f"{r.name}: {r.status} ({r.message}){': ' + ' | '.join(tail) if tail else ''}")
    return bad


@dataclass(frozen=True)
class Run:
    stdout: str
    results: dict[str, Result]


def run_ctest(build: Path, args: list[str], expected_skips: Mapping[str, str], timeout: int = 1800,
              env: Mapping[str, str] | None = None) -> Run:
    """`ctest --test-dir build --output-on-failure ARGS`; asserts that every selected test passed
    (or is a skip named in expected_skips) and that at least one test ran."""
    junit = Path(build).resolve() / "pytest-ctest-junit.xml"
    junit.unlink(missing_ok=True)
    cmd = ["ctest", "--test-dir", str(build), "--output-on-failure", "--output-junit", str(junit), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    log = f"{' '.join(cmd)}: rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert junit.is_file(), f"no JUnit file from {log}"
    results = parse_junit(junit)
    bad = problems(results, expected_skips)
    assert results, f"no test selected by {log}"
    assert not bad and r.returncode == 0, "\n".join(bad) + f"\n{log}"
    return Run(r.stdout, results)
