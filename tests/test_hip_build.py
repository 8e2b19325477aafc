"""The ROCm-less ggml-hip toolchain (hip_kernels/README.md, "Compiling ggml-hip without ROCm"):
HIP headers from the triton wheel (fetched once with pip, cached by version), the link stubs, and
the CTest compile checks of the patched ggml HIP sources for gfx1151 and gfx1201 (host and device
passes, ISA checks on the glue). The whole-library build (`dflash build --gpu hip --compile-only`)
is long and is not run here."""
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT
from .ctest_run import EXPECTED_SKIPS, run_ctest

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


def _stub_library(cc, name, soname, out):
    run([cc, "-fPIC", "-shared", f"-Wl,-soname,{soname}", "-o", out / soname, STUBS / "src" / f"{name}_stub.c"])
    return out / soname


def test_hipblas_stub_header_declares_what_the_stub_library_defines(tmp_path):
    """The stub header, preprocessed (so its comments are gone), declares exactly the functions the
    libhipblas stub exports, defines DFLASH_HIPBLAS_STUB (what tells a build it has the stub), and
    every one of those functions aborts with the stub's message when called."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang-19")
    nm = shutil.which("nm") or shutil.which("llvm-nm-19")
    if cc is None or nm is None:
        pytest.fail("no C compiler or nm: scripts/setup installs g++ (binutils)")
    fake = tmp_path / "hip-headers" / "hip"  # the header's HIP includes, empty: only the preprocessor reads them
    fake.mkdir(parents=True)
    for name in ("hip_runtime_api.h", "library_types.h", "hip_version.h"):
        (fake / name).write_text("")
    header = STUBS / "include" / "hipblas" / "hipblas.h"
    pre = [cc, "-E", "-P", "-x", "c", f"-I{fake.parent}", f"-I{STUBS / 'include'}", header]
    declared = set(re.findall(r"\b(hipblas[A-Za-z0-9_]*)\s*\(", run(pre)))
    macros = run([*pre[:2], "-dM", *pre[2:]]).splitlines()
    assert "#define DFLASH_HIPBLAS_STUB 1" in macros
    lib = _stub_library(cc, "hipblas", "libhipblas.so.3", tmp_path)
    exported = {line.split()[0] for line in run([nm, "-D", "--defined-only", "--format=posix", lib]).splitlines()}
    assert declared and declared == {s for s in exported if s.startswith("hipblas")}
    for fn in sorted(declared):
        call = f"import ctypes; ctypes.CDLL({str(lib)!r}).{fn}()"
        r = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True)
        assert r.returncode == -signal.SIGABRT and f"{fn}() called, but libhipblas is a link stub" in r.stderr, fn


@pytest.mark.long
@needs_clang
def test_ctest_ggml_hip_compiles_patched_sources_for_both_archs():
    run(["cmake", "-S", ROOT, "-B", BUILD])
    run(["cmake", "--build", BUILD, "-j", "2"])
    done = run_ctest(BUILD, ["-V", "-R", "^(ggml_patch_applies|ggml_hip_)"], EXPECTED_SKIPS)  # a skip fails
    out = done.stdout
    for arch in ("gfx1151", "gfx1201"):
        assert done.results[f"ggml_hip_compile_{arch}"].status == "passed"
        for src in ("ggml-cuda.cu", "dflash-mmvq.cu", "mmvq.cu", "mmvf.cu"):
            assert f"compiled {src} for {arch} in" in out
        assert f"{arch}: " in out and "dflash kernels in ggml's HIP build of dflash-mmvq.cu" in out
