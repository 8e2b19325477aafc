"""The native build as a user runs it: `cmake -S . -B build && cmake --build build && ctest`.

Builds both AMD code objects with clang 19 (no ROCm), the host body tests, and runs CTest: ISA
checks per arch, host body vs reference, planted-bug detection, the ggml patch applying cleanly.
The build folder is build/native (ignored by git), so a second run is incremental."""
import shutil
import subprocess

from .conftest import ROOT


def run(cmd):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
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
    out = run(["ctest", "--test-dir", str(build), "--output-on-failure", "-E", "^ggml_hip_"])
    assert "100% tests passed" in out
    for name in ("mmvq_isa_gfx1151", "mmvq_isa_gfx1201", "mmvq_host_planted_bug_caught", "ggml_patch_applies"):
        assert name in out
