"""The native build as a user runs it: `cmake -S . -B build && cmake --build build && ctest`.

Builds both AMD code objects with clang 19 (no ROCm), the host body tests, and runs CTest: ISA
checks per arch, host body vs reference, planted-bug detection, the ggml patch applying cleanly.
The build folder is build/native (ignored by git), so a second run is incremental. CTest counts a
skipped test as passed; here every skip fails the test unless ctest_run.EXPECTED_SKIPS names it."""
import os
import shutil
import subprocess

import pytest

from .conftest import ROOT
from .ctest_run import EXPECTED_SKIPS, parse_junit, problems, run_ctest


def run(cmd, env=None):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def test_cmake_build_and_ctest():
    assert shutil.which("cmake"), "cmake is missing: scripts/setup installs it"
    build = ROOT / "build" / "native"
    run(["cmake", "-S", ".", "-B", str(build)])
    run(["cmake", "--build", str(build), "-j", "2"])
    for arch in ("gfx1151", "gfx1201"):
        assert (build / "hip_kernels" / f"dflash_mmvq_{arch}.hsaco").is_file()
    # the ROCm-less ggml-hip compile tests (minutes) run once, in tests/test_hip_build.py
    done = run_ctest(build, ["-E", "^ggml_hip_"], EXPECTED_SKIPS, timeout=1200)
    for name in ("mmvq_host_selfcheck", "mmvq_isa_gfx1151", "mmvq_isa_gfx1201", "mmvq_host_planted_bug_caught",
                 "ggml_patch_applies"):
        assert done.results[name].status == "passed", name


def test_patch_test_finds_the_pinned_source_through_xdg_cache_home(tmp_path):
    """hip_kernels/CMakeLists.txt looks for the pinned llama.cpp where dflash keeps it:
    $XDG_CACHE_HOME/dflash when that is set (HOME then plays no part), else ~/.cache/dflash."""
    src = tmp_path / "xdg" / "dflash" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    (src / "ggml" / "src" / "ggml-cuda").mkdir(parents=True)
    (src / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").write_text("")
    linked = tmp_path / "linked"  # a cache whose src/ links to another cache's, as the test session's does
    (linked / "dflash").mkdir(parents=True)
    (linked / "dflash" / "src").symlink_to(tmp_path / "xdg" / "dflash" / "src")
    base = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "nohome")}
    home = tmp_path / "home" / ".cache" / "dflash" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    old_default = tmp_path / "nohome" / ".cache" / "dflash" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    cases = [(xdg, [], src),
             ({"XDG_CACHE_HOME": str(linked), "HOME": str(tmp_path / "nohome")}, [], src),
             ({"XDG_CACHE_HOME": "", "HOME": str(tmp_path / "home")}, [], home),
             (xdg, [f"-DDFLASH_PINNED_LLAMA_SRC={old_default}"], src),  # the old default, cached: forgotten
             (xdg, [f"-DDFLASH_PINNED_LLAMA_SRC={tmp_path / 'mine'}"], tmp_path / "mine")]  # a choice: kept
    for i, (env, args, want) in enumerate(cases):
        b = tmp_path / f"b{i}"
        run(["cmake", "-S", str(ROOT / "hip_kernels"), "-B", str(b), "-DDFLASH_KERNELS_HOST_ONLY=ON", *args],
            env={**base, **env})
        lines = (b / "CTestTestfile.cmake").read_text().splitlines()
        pinned = [ln for ln in lines if ln.startswith("add_test([=[ggml_patch_applies]=]")]
        assert len(pinned) == 1 and f'"-DPINNED={want}"' in pinned[0], (env, args, pinned)


SKIPPING_PROJECT = """cmake_minimum_required(VERSION 3.20)
project(t NONE)
enable_testing()
add_test(NAME passes COMMAND ${CMAKE_COMMAND} -E echo fine)
add_test(NAME skips COMMAND ${CMAKE_COMMAND} -E echo "SKIPPED: no source")
set_tests_properties(skips PROPERTIES SKIP_REGULAR_EXPRESSION "SKIPPED:")
add_test(NAME skips_77 COMMAND ${CMAKE_COMMAND} -E false)
set_tests_properties(skips_77 PROPERTIES SKIP_RETURN_CODE 1)
add_test(NAME disabled COMMAND ${CMAKE_COMMAND} -E echo x)
set_tests_properties(disabled PROPERTIES DISABLED ON)
add_test(NAME fails COMMAND ${CMAKE_COMMAND} -E false)
add_test(NAME no_program COMMAND /nonexistent/program)
"""


@pytest.fixture
def skipping_build(tmp_path):
    (tmp_path / "CMakeLists.txt").write_text(SKIPPING_PROJECT)
    run(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "b")])
    return tmp_path / "b"


def test_a_ctest_skip_fails_unless_expected(skipping_build):
    """CTest itself calls the skipping project's pass and skips "100% tests passed"; the wrapper
    fails on each skip, disabled test, failure and missing program that the caller did not name."""
    r = subprocess.run(["ctest", "--test-dir", str(skipping_build), "-R", "^(passes|skips)$"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "100% tests passed" in r.stdout  # what the old check accepted
    with pytest.raises(AssertionError, match="skips: skipped"):
        run_ctest(skipping_build, ["-R", "^(passes|skips)$"], {})
    assert run_ctest(skipping_build, ["-R", "^(passes|skips)$"], {"skips": "reason"}).results["skips"].status \
        == "skipped"
    with pytest.raises(AssertionError):
        run_ctest(skipping_build, [], {})
    results = parse_junit(skipping_build / "pytest-ctest-junit.xml")
    assert {n: r.status for n, r in results.items()} == {
        "passes": "passed", "skips": "skipped", "skips_77": "skipped", "disabled": "disabled", "fails": "failed",
        "no_program": "not run"}
    named = {"skips": "r", "skips_77": "r", "disabled": "r", "fails": "never excused", "no_program": "never excused"}
    assert [line.split(":")[0] for line in problems(results, named)] == ["fails", "no_program"]
    assert [line.split(":")[0] for line in problems(results, {})] == ["skips", "skips_77", "disabled", "fails",
                                                                      "no_program"]
