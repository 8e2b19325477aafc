"""How the CUDA flavor finds cuBLAS and the runtime (dflash/native/cuda_libs.py), without a download and
without a GPU: the wheel set nvcc's release picks, the folder assembled from (fake) wheels, the
driver link stub, the CMake arguments, the build key, and the ldd verdict the CUDA build test uses.
Fast: it always runs (a C compiler builds the stub from a small cuda.h of its own)."""
import shutil
import subprocess
import zipfile

import pytest

from dflash.core.errors import DflashError
from dflash.native import build, cuda_libs

NVCC_13 = ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
           "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\nCuda compilation tools, release 13.0, V13.0.88\n"
           "Build cuda_13.0.r13.0/compiler.36424714_0\n")


def test_nvcc_release_is_read_from_its_version_text():
    assert cuda_libs.nvcc_release(NVCC_13) == (13, 0)
    assert cuda_libs.nvcc_release("Cuda compilation tools, release 12.4, V12.4.131") == (12, 4)
    with pytest.raises(DflashError, match="cannot read the CUDA release"):
        cuda_libs.nvcc_release("no nvcc")


def test_the_wheel_set_matches_the_toolkit():
    """CUDA 13.0 (this machine's nvcc 13.0.88): the versions cuda-toolkit 13.0.3 pins; CUDA 13 names
    carry no -cu13 suffix, CUDA 12 names keep -cu12."""
    ws = cuda_libs.wheel_set((13, 0))
    assert [w.requirement for w in ws.wheels] == ["nvidia-cublas==13.1.1.3", "nvidia-cuda-runtime==13.0.96"]
    assert ws.major == 13
    assert all(w.name.endswith("-cu12") for w in cuda_libs.wheel_set((12, 9)).wheels)
    # a newer minor of a known major takes the newest set not above it; an older minor has none
    assert cuda_libs.wheel_set((13, 2)) is ws
    with pytest.raises(DflashError, match="no cuBLAS wheel set for CUDA 12.4"):
        cuda_libs.wheel_set((12, 4))
    with pytest.raises(DflashError, match="CUDA 11.8"):
        cuda_libs.wheel_set((11, 8))


def fake_toolkit(tmp_path, n_functions=60):
    """bin/nvcc and include/cuda.h whose declarations look like the real ones (macros map some names
    to _v2, as cuda.h does)."""
    root = tmp_path / "toolkit"
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ncat <<'EOF'\n{NVCC_13}EOF\n")
    nvcc.chmod(0o755)
    decls = "".join(f"CUresult CUDAAPI cuFake{i}(int x);\n" for i in range(n_functions))
    (root / "include" / "cuda.h").write_text(
        "#define CUDAAPI\ntypedef int CUresult;\ntypedef int CUdevice;\n#define cuMemAlloc cuMemAlloc_v2\n"
        "CUresult CUDAAPI cuMemAlloc(void **p, unsigned long n);\nCUresult CUDAAPI cuMemCreate(void *h);\n"
        "typedef CUresult (CUDAAPI *PFN_cuInit)(unsigned int);\n" + decls)
    return nvcc


def fake_wheel(folder, w: cuda_libs.Wheel, layout="cu13"):
    """A wheel with NVIDIA's layout: nvidia/cu13/{lib,include} (CUDA 13) or nvidia/<part>/... (12)."""
    stem = w.name.replace("-", "_")
    path = folder / f"{stem}-{w.version}-py3-none-manylinux_2_27_x86_64.whl"
    base = "nvidia/cu13" if layout == "cu13" else f"nvidia/{w.part.replace('-', '_')}"
    with zipfile.ZipFile(path, "w") as z:
        for lib in cuda_libs._LIB_NAMES[w.part]:
            z.writestr(f"{base}/lib/lib{lib}.so.13", b"\x7fELF fake " + lib.encode())
        z.writestr(f"{base}/lib/libnvblas.so.13", b"not wanted")
        z.writestr(f"{base}/lib/lib{cuda_libs._LIB_NAMES[w.part][0]}_static.a", b"not wanted")
        if w.part == "cublas":
            z.writestr(f"{base}/include/cublas_v2.h", b"/* cublas */")
            z.writestr(f"{base}/include/cublas_api.h", b"/* cublas api */")
        else:
            z.writestr(f"{base}/include/cuda_runtime.h", b"/* the toolkit's own stays in use */")
        z.writestr(f"{stem}-{w.version}.dist-info/METADATA", f"Name: {w.name}\nVersion: {w.version}\n")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "dflash" / "cuda"


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (apt-get install gcc)")


@needs_cc
def test_ensure_assembles_the_folder_once(tmp_path, cache):
    nvcc = fake_toolkit(tmp_path)
    calls = []

    def download(requirement, folder):
        calls.append(requirement)
        name, version = requirement.split("==")
        w = next(w for w in cuda_libs.wheel_set((13, 0)).wheels if w.name == name)
        return fake_wheel(folder, w)

    libs = cuda_libs.ensure(str(nvcc), NVCC_13, download=download)
    assert calls == ["nvidia-cublas==13.1.1.3", "nvidia-cuda-runtime==13.0.96"]
    assert libs.root.parent == cache
    lib = libs.lib
    # each versioned library with its unversioned link (what find_library takes), nothing else
    assert sorted(p.name for p in lib.iterdir()) == ["libcublas.so", "libcublas.so.13", "libcublasLt.so",
                                                     "libcublasLt.so.13", "libcudart.so", "libcudart.so.13"]
    assert (lib / "libcublas.so").readlink().name == "libcublas.so.13"
    # cuBLAS's headers only: the runtime's headers stay the toolkit's
    assert sorted(p.name for p in libs.include.iterdir()) == ["cublas_api.h", "cublas_v2.h"]
    manifest = libs.manifest()
    assert manifest["cuda_release"] == "13.0.3" and manifest["nvcc"].endswith("V13.0.88")
    assert [(w["name"], w["version"]) for w in manifest["wheels"]] == [("nvidia-cublas", "13.1.1.3"),
                                                                       ("nvidia-cuda-runtime", "13.0.96")]
    assert all(len(w["sha256"]) == 64 and w["bytes"] > 0 for w in manifest["wheels"])
    assert not list(cache.glob("*/wheels/*")) and not list(cache.glob("assemble-*"))  # wheels deleted
    # the link stub: soname libcuda.so.1, every declared function (macro-mapped names as mapped)
    stub = libs.driver_stub
    dyn = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in dyn.splitlines()}
    assert {"cuMemCreate", "cuMemAlloc_v2", "cuFake0", "cuFake59"} <= names and "cuMemAlloc" not in names
    assert "PFN_cuInit" not in names
    soname = subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True).stdout
    assert "[libcuda.so.1]" in soname
    assert libs.cmake_args() == [f"-DDFLASH_CUDA_LIBS={libs.root}"]
    # a second call reuses the folder
    assert cuda_libs.ensure(str(nvcc), NVCC_13, download=download).root == libs.root and len(calls) == 2


@needs_cc
def test_a_wrong_or_broken_wheel_is_refused_and_leaves_nothing(tmp_path, cache):
    nvcc = fake_toolkit(tmp_path)

    def other_version(requirement, folder):
        w = cuda_libs.Wheel("nvidia-cublas", "13.0.0.19", "cublas")
        return fake_wheel(folder, w)

    with pytest.raises(DflashError, match="pip saved nvidia_cublas-13.0.0.19"):
        cuda_libs.ensure(str(nvcc), NVCC_13, download=other_version)

    def no_headers(requirement, folder):
        name, version = requirement.split("==")
        path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("nvidia/cu13/lib/libcublas.so.13", b"x")
            z.writestr("nvidia/cu13/lib/libcublasLt.so.13", b"x")
        return path

    with pytest.raises(DflashError, match="no cublas_v2.h"):
        cuda_libs.ensure(str(nvcc), NVCC_13, download=no_headers)
    assert not cache.exists() or [p.name for p in cache.iterdir()] == []


def test_cuda12_layout_is_extracted_too(tmp_path):
    """CUDA 12 wheels put each part under nvidia/<part>/lib and include."""
    for w in cuda_libs.wheel_set((12, 9)).wheels:
        cuda_libs.extract(w, fake_wheel(tmp_path, w, layout="cu12"), tmp_path / "root")
    assert (tmp_path / "root" / "lib" / "libcublasLt.so").is_symlink()
    assert (tmp_path / "root" / "include" / "cublas_v2.h").is_file()


def test_a_cuda_h_without_driver_functions_is_refused(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    h = tmp_path / "cuda.h"
    h.write_text("typedef int CUresult;\nCUresult cuInit(unsigned);\n")
    with pytest.raises(DflashError, match="declares only 1 driver functions"):
        cuda_libs.driver_functions(h)


def test_the_key_follows_the_wheels_and_cuda_h():
    ws = cuda_libs.wheel_set((13, 0))
    k = cuda_libs.key(ws, b"cuda.h")
    assert k == cuda_libs.key(ws, b"cuda.h") and len(k) == 16
    assert cuda_libs.key(ws, b"other cuda.h") != k
    assert cuda_libs.key(cuda_libs.wheel_set((12, 9)), b"cuda.h") != k


def test_the_cuda_build_key_holds_the_wheel_set(tmp_path, monkeypatch):
    """Another cuBLAS pin is another CUDA build (build_key), not a CPU one."""
    nvcc = fake_toolkit(tmp_path)
    monkeypatch.setattr(build, "_nvcc", lambda: str(nvcc))
    monkeypatch.setattr(build, "_nvcc_version_text", lambda: NVCC_13)
    before, cpu = build.build_key("exact", "cuda"), build.build_key("exact")
    pinned = cuda_libs.WHEEL_SETS[(13, 0)]
    other = cuda_libs.WheelSet(pinned.release, (cuda_libs.Wheel("nvidia-cublas", "13.1.0.3", "cublas"),
                                                pinned.wheels[1]))
    monkeypatch.setitem(cuda_libs.WHEEL_SETS, (13, 0), other)
    assert build.build_key("exact", "cuda") != before
    assert build.build_key("exact") == cpu


LDD = """\tlinux-vdso.so.1 (0x00007ffd1c5f2000)
\tlibggml-base.so.0 => /c/llama/exact-1/lib/libggml-base.so.0 (0x00007f0a1c000000)
\tlibcudart.so.13 => /c/cuda/k/lib/libcudart.so.13 (0x00007f0a1b800000)
\tlibcublas.so.13 => /c/cuda/k/lib/libcublas.so.13 (0x00007f0a15000000)
\tlibcuda.so.1 => not found
\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f0a14c00000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f0a1c4b0000)
"""


def test_ldd_verdict_allows_only_the_driver():
    assert cuda_libs.unresolved(LDD) == []
    assert cuda_libs.unresolved(LDD, allowed=()) == ["libcuda.so.1"]
    worse = LDD.replace("libcublas.so.13 => /c/cuda/k/lib/libcublas.so.13 (0x00007f0a15000000)",
                        "libcublas.so.13 => not found")
    assert cuda_libs.unresolved(worse) == ["libcublas.so.13"]
    stubbed = LDD.replace("libcuda.so.1 => not found", "libcuda.so.1 => /c/cuda/k/stubs/libcuda.so (0x1)")
    assert cuda_libs.unresolved(stubbed) == ["libcuda.so.1 (the link stub /c/cuda/k/stubs/libcuda.so)"]


def test_the_gpu_cmake_file_hands_the_folder_to_findcudatoolkit(tmp_path):
    """cmake/llama_gpu.cmake, run by CMake itself (script mode, the variables cmake/llama.cmake
    sets before it): with DFLASH_CUDA_LIBS it passes each library, cuBLAS's headers, the stub and
    a run path of $ORIGIN and the folder on to llama.cpp's configure; without it, none of them.
    (The configure and link themselves are tests/test_cuda_build.py's, where a CUDA build exists.)"""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is missing (scripts/setup installs it)")
    src = (build.SOURCE_ROOT / "cmake" / "llama_gpu.cmake").resolve()

    def configure(libs: str, flavor: str = "exact") -> dict[str, list[str]]:
        script = tmp_path / f"probe-{flavor}-{bool(libs)}.cmake"
        script.write_text(
            f'set(DFLASH_GPU cuda)\nset(CUDA_ARCHITECTURES "90")\nset(DFLASH_LLAMA_FLAVOR {flavor})\n'
            f'set(DFLASH_CUDA_LIBS "{libs}")\nset(_llama_args -DBUILD_SHARED_LIBS=ON)\nset(_llama_patch cmake)\n'
            f'include("{src}")\n'
            'foreach(a IN LISTS _llama_args)\n  message(STATUS "ARG ${a}")\nendforeach()\n'
            'foreach(a IN LISTS _llama_cuda_cache)\n  message(STATUS "CACHE ${a}")\nendforeach()\n')
        r = subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True, cwd=build.SOURCE_ROOT)
        assert r.returncode == 0, r.stdout + r.stderr
        out: dict[str, list[str]] = {"ARG": [], "CACHE": []}
        for line in (r.stdout + r.stderr).splitlines():
            kind, _, value = line.removeprefix("-- ").partition(" ")
            if kind in out:
                out[kind].append(value)
        return out

    got = configure("/w/cuda/k")
    for arg in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA=OFF",
                "-DCUDA_cublas_LIBRARY=/w/cuda/k/lib/libcublas.so",
                "-DCUDA_cublasLt_LIBRARY=/w/cuda/k/lib/libcublasLt.so",
                "-DCUDA_cudart_LIBRARY=/w/cuda/k/lib/libcudart.so",
                "-DCUDA_cuda_driver_LIBRARY=/w/cuda/k/stubs/libcuda.so",
                "-DCMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES=/w/cuda/k/include",
                "-DCMAKE_CUDA_FLAGS=-DGGML_DFLASH_MMVQ_CUDA"):
        assert arg in got["ARG"], (arg, got["ARG"])
    # one cache argument whose value is the list "$ORIGIN;<folder>/lib" (split by the list print)
    assert got["CACHE"] == ["CMAKE_CACHE_ARGS", "-DCMAKE_INSTALL_RPATH:STRING=$ORIGIN", "/w/cuda/k/lib"], got["CACHE"]
    bare = configure("")
    assert not [a for a in bare["ARG"] if "CUDA_cu" in a or "STANDARD_INCLUDE" in a] and bare["CACHE"] == []
    stock = configure("/w/cuda/k", "stock")
    assert "-DCMAKE_CUDA_FLAGS=-DGGML_DFLASH_MMVQ_CUDA" not in stock["ARG"]
