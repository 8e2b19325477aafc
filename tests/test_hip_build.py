"""The ROCm-less ggml-hip toolchain (hip_kernels/README.md, "Compiling ggml-hip without ROCm"):
HIP headers from the triton wheel (fetched once with pip, cached by version), the link stubs, and
the CTest compile checks of the patched ggml HIP sources for gfx1151 and gfx1201 (host and device
passes, ISA checks on the glue). The whole-library build (`dflash build --gpu hip --compile-only`)
is long and is not run here."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT

FETCH = ROOT / "hip_kernels" / "tools" / "fetch_hip_headers.py"
STUBS = ROOT / "hip_kernels" / "stubs"
BUILD = ROOT / "build" / "native"  # shared with test_native_build (incremental)
needs_clang = pytest.mark.skipif(shutil.which("clang++-19") is None,
                                 reason="clang++-19 is not installed (scripts/setup installs clang-19)")


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    return r.stdout


def test_hip_headers_fetched_once_and_cached():
    first = run([sys.executable, FETCH]).strip()
    assert first.endswith("/include") and (ROOT / first / "hip" / "hip_runtime.h").is_file()
    version = run([sys.executable, FETCH, "--print-version"]).strip()
    assert f"/hip-headers/{version}/include" in first
    # cached: a second call never runs pip (an interpreter that cannot run pip still works) and is quick
    t0 = time.monotonic()
    again = run([sys.executable, FETCH, "--python", "/bin/false"]).strip()
    assert again == first and time.monotonic() - t0 < 5
    lib = run([sys.executable, FETCH, "--lib"]).strip()
    assert {p.name for p in (ROOT / lib).iterdir()} >= {"ocml.bc", "ockl.bc"}
    for sub in ("hip/amd_detail",):
        assert (ROOT / first / sub).is_dir()


def test_stub_libraries_compile_and_abort_when_called(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang-19")
    if cc is None:
        pytest.fail("no C compiler: scripts/setup installs g++")
    for name, soname in (("amdhip64", "libamdhip64.so.7"), ("hipblas", "libhipblas.so.3")):
        run([cc, "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", f"-Wl,-soname,{soname}",
             "-o", tmp_path / soname, STUBS / "src" / f"{name}_stub.c"])
        (tmp_path / f"lib{name}.so").symlink_to(soname)
    (tmp_path / "call.c").write_text("int hipblasGemmEx(void); int main(void) { return hipblasGemmEx(); }\n")
    run([cc, "-o", tmp_path / "call", tmp_path / "call.c", f"-L{tmp_path}", "-lhipblas", f"-Wl,-rpath,{tmp_path}"])
    r = subprocess.run([tmp_path / "call"], capture_output=True, text=True)
    assert r.returncode == -signal.SIGABRT
    assert "hipblasGemmEx() called, but libhipblas is a link stub" in r.stderr


def test_hipblas_stub_header_is_marked_as_stub():
    text = (STUBS / "include" / "hipblas" / "hipblas.h").read_text()
    assert "LINK STUB" in text.splitlines()[0]


@needs_clang
def test_ctest_ggml_hip_compiles_patched_sources_for_both_archs():
    run(["cmake", "-S", ROOT, "-B", BUILD])
    run(["cmake", "--build", BUILD, "-j", "2"])
    env = dict(os.environ)
    out = run(["ctest", "--test-dir", BUILD, "--output-on-failure", "-V", "-R", "^(ggml_patch_applies|ggml_hip_)"],
              env=env)
    assert "100% tests passed" in out
    for arch in ("gfx1151", "gfx1201"):
        assert f"ggml_hip_compile_{arch}" in out
        for src in ("ggml-cuda.cu", "dflash-mmvq.cu", "mmvq.cu", "mmvf.cu"):
            assert f"compiled {src} for {arch} in" in out
        assert f"{arch}: " in out and "dflash kernels in ggml's HIP build of dflash-mmvq.cu" in out
