"""The llama.cpp library build key (dflash/native/build.py): which inputs it sees, per flavor and GPU.

Every test runs on a temporary copy of the key's inputs (the CMake files, cpu_kernels/patches and
hip_kernels), with build.SOURCE_ROOT pointed at it: the checkout is never touched, and nothing is
built (no cmake), only keys are computed."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash.core.errors import DflashError
from dflash.native import build

INPUTS = ("CMakeLists.txt", "cmake", "cpu_kernels/patches", "rpc/patches", "hip_kernels", "vulkan_kernels")
RPC = "rpc/patches"
COMMON = "cpu_kernels/patches/common"
EXACT = "cpu_kernels/patches/exact"


def first_patch(root, d):
    patches = sorted((root / d).glob("*.patch"))
    assert patches, f"no patch under {d}"
    return patches[0]


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def keys(gpu="none"):
    return {f: build.build_key(f, gpu) for f in build.FLAVORS}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A copy of the build inputs that build_key reads instead of the checkout."""
    real = build.SOURCE_ROOT
    real_keys = keys()
    root = tmp_path / "checkout"
    for rel in INPUTS:
        src, dst = real / rel, root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=False)
        else:
            shutil.copy2(src, dst)
    monkeypatch.setattr(build, "SOURCE_ROOT", root)
    try:
        from dflash.core import paths
        monkeypatch.setattr(paths, "SOURCE_ROOT", root)
    except ImportError:
        pass
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # the key names inputs by their path in the checkout, so a copy has the checkout's keys
    assert keys() == real_keys
    return root


def test_same_inputs_same_key(repo):
    first = {gpu: keys(gpu) for gpu in ("none", "hip")}
    assert first == {gpu: keys(gpu) for gpu in ("none", "hip")}
    for ks in first.values():
        assert all(len(k) == 16 and int(k, 16) >= 0 for k in ks.values())


def test_flavors_and_gpus_have_different_keys(repo):
    none, hip = keys("none"), keys("hip")
    assert none["exact"] != none["stock"]
    assert hip["exact"] != hip["stock"]
    assert none["exact"] != hip["exact"] and none["stock"] != hip["stock"]


def test_an_exact_patch_changes_only_the_exact_key(repo):
    before = {gpu: keys(gpu) for gpu in ("none", "hip")}
    patch = first_patch(repo, EXACT)
    original = patch.read_bytes()
    flip_byte(patch)
    after = {gpu: keys(gpu) for gpu in ("none", "hip")}
    for gpu in ("none", "hip"):
        assert after[gpu]["exact"] != before[gpu]["exact"], gpu
        assert after[gpu]["stock"] == before[gpu]["stock"], gpu  # stock never applies it
    patch.write_bytes(original)  # the key is the content's: back to the same bytes, back to the same key
    assert keys() == before["none"]


@pytest.mark.parametrize("d", [COMMON, RPC])
def test_a_common_patch_changes_both_keys(repo, d):
    before = keys()
    flip_byte(first_patch(repo, d))
    after = keys()
    assert after["exact"] != before["exact"] and after["stock"] != before["stock"]


def test_new_removed_and_renamed_patches_change_the_key(repo):
    before = keys()
    new = repo / EXACT / "9999-extra.patch"
    new.write_text("--- a/x\n+++ b/x\n")
    added = keys()
    assert added["exact"] != before["exact"] and added["stock"] == before["stock"]
    new.unlink()
    assert keys() == before
    patch = first_patch(repo, EXACT)
    patch.rename(patch.with_name("z" + patch.name))  # same bytes, another name (and order)
    assert keys()["exact"] != before["exact"]


def test_cmake_inputs_change_both_keys(repo):
    for rel in ("CMakeLists.txt", "cmake/llama.cmake", "cmake/apply_patches.cmake", "cmake/patch_set.cmake"):
        before = keys()
        with open(repo / rel, "a") as f:
            f.write("\n# touched\n")
        after = keys()
        assert after["exact"] != before["exact"] and after["stock"] != before["stock"], rel


def test_the_gpu_cmake_file_changes_only_gpu_keys(repo):
    """cmake/llama_gpu.cmake (the HIP and CUDA options) is read by GPU builds alone: editing it
    keys the HIP and CUDA builds anew and leaves every CPU build (native and variants) cached."""
    cpu = {v: {f: build.build_key(f, "none", v) for f in build.FLAVORS} for v in build.CPU_VARIANTS}
    before = {gpu: keys(gpu) for gpu in ("hip", "cuda")}
    with open(repo / "cmake" / "llama_gpu.cmake", "a") as f:
        f.write("\n# touched\n")
    assert cpu == {v: {f: build.build_key(f, "none", v) for f in build.FLAVORS} for v in build.CPU_VARIANTS}
    after = {gpu: keys(gpu) for gpu in ("hip", "cuda")}
    assert all(after[g][f] != before[g][f] for g in after for f in build.FLAVORS)


def test_hip_kernels_change_only_hip_keys(repo):
    before = {gpu: keys(gpu) for gpu in ("none", "hip")}
    flip_byte(repo / "hip_kernels" / "apply_patch.cmake")
    after = {gpu: keys(gpu) for gpu in ("none", "hip")}
    assert after["none"] == before["none"]
    assert all(after["hip"][f] != before["hip"][f] for f in build.FLAVORS)


def test_pinned_source_and_host_are_in_the_key(repo, monkeypatch):
    before = keys()
    version = build.LLAMA_CPP_PYTHON_VERSION
    monkeypatch.setattr(build, "LLAMA_CPP_PYTHON_VERSION", "0.3.35")
    pinned = keys()
    assert all(pinned[f] != before[f] for f in build.FLAVORS)
    monkeypatch.setattr(build, "LLAMA_CPP_PYTHON_VERSION", version)
    assert keys() == before
    monkeypatch.setattr(build, "_host_fingerprint", lambda: "riscv64|flags : none|cc 1.0")
    host = keys()
    assert all(host[f] != before[f] for f in build.FLAVORS)


def test_a_key_blind_to_the_exact_patches_is_caught(repo, monkeypatch):
    """The check above can fail: a build_key that hashed only the common patches for exact would
    give the same key before and after an exact patch changes."""
    monkeypatch.setitem(build._PATCH_DIRS, "exact", (COMMON,))
    before = keys()
    flip_byte(first_patch(repo, EXACT))
    assert keys()["exact"] == before["exact"]  # the wrong key misses it; the real one does not


def test_install_dir_is_named_by_flavor_and_key(repo, tmp_path):
    for f in build.FLAVORS:
        d = build.install_dir(f)
        assert d == tmp_path / "cache" / "dflash" / "llama" / f"{f}-{build.build_key(f)}"
        assert build.library_dir(f) == d / "lib" and not build.is_built(f)
    before = build.install_dir("exact")
    flip_byte(first_patch(repo, EXACT))
    assert build.install_dir("exact") != before  # a changed patch set is never loaded from the old build
    with pytest.raises(DflashError, match="flavor"):
        build.install_dir("bogus")


def test_a_tree_without_cmakelists_is_refused(repo):
    (repo / "CMakeLists.txt").unlink()
    with pytest.raises(DflashError, match="CMake project and patch sets"):
        build.build_key("exact")


# ---- what the GPU keys read from hip_kernels/: the patch set's inputs, never docs or tests ----
NOT_INPUTS = ("hip_kernels/README.md", "hip_kernels/tests/host_main.cpp", "hip_kernels/tests/cuda_selftest.cu",
              "hip_kernels/tests/stubs/cublas_v2.h", "hip_kernels/cmake/check_isa.cmake",
              "hip_kernels/cmake/check_patch.cmake", "hip_kernels/CMakeLists.txt")
NEW_NON_INPUTS = ("hip_kernels/tests/new_test.cpp", "hip_kernels/patches/README.md",
                  "hip_kernels/include/dflash_mmvq/notes.txt", "hip_kernels/NOTES.md")
PATCH_SET = ("hip_kernels/apply_patch.cmake", "hip_kernels/patches/0001-ggml-cuda-route-narrow-mmvq.patch",
             "hip_kernels/ggml/dflash-mmvq.cu", "hip_kernels/ggml/dflash-mmvq.cuh",
             "hip_kernels/include/dflash_mmvq/body.h", "hip_kernels/include/dflash_mmvq/formats.h")
NEW_PATCH_SET = ("hip_kernels/patches/0003-new.patch", "hip_kernels/ggml/dflash-extra.cuh",
                 "hip_kernels/include/dflash_mmvq/extra.h")
COMPILE_ONLY = ("hip_kernels/stubs/src/hipblas_stub.c", "hip_kernels/stubs/include/hipblas/hipblas.h",
                "hip_kernels/ggml_hip/CMakeLists.txt", "hip_kernels/ggml_hip/grid_sync_trap.h",
                "hip_kernels/cmake/ggml_hip_flags.cmake", "hip_kernels/cmake/hip_root.cmake",
                "hip_kernels/tools/fetch_hip_headers.py")


def gpu_keys():
    return {gpu: keys(gpu) for gpu in ("hip", "cuda")}


def touch(root, rel):
    path = root / rel
    if path.is_file():
        with open(path, "a") as f:
            f.write("\n// touched\n")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("new\n")


@pytest.fixture
def hip_compile(repo, monkeypatch, tmp_path):
    """hip_compile_key on fake tools and device libraries: it runs without clang 19 or ROCm's
    bitcode, and only the checkout's files can change it."""
    libs = tmp_path / "bitcode"
    libs.mkdir()
    for name in ("ocml.bc", "ockl.bc"):
        (libs / name).write_bytes(b"BC" + name.encode())
    tool = shutil.which("cmake")  # any program that answers --version
    monkeypatch.setattr(build, "_hip_tools", lambda: {"clang++-19": tool, "clang-19": tool, "llvm-as-19": tool})
    monkeypatch.setattr(build, "_device_libs", lambda: libs)
    return build.hip_compile_key


def test_docs_and_tests_do_not_change_the_gpu_keys(repo, hip_compile):
    """A README, a test, the code-object build or a stray file under hip_kernels/ is read by no
    library build: editing it leaves every key as it was (no 20-minute GPU rebuild for a doc edit)."""
    before, before_hip = gpu_keys(), hip_compile()
    for rel in NOT_INPUTS + NEW_NON_INPUTS:
        touch(repo, rel)
        assert gpu_keys() == before and hip_compile() == before_hip, rel


@pytest.mark.parametrize("rel", PATCH_SET + NEW_PATCH_SET)
def test_a_patch_set_input_changes_every_gpu_key(repo, hip_compile, rel):
    before, before_hip, cpu = gpu_keys(), hip_compile(), keys()
    touch(repo, rel)
    after = gpu_keys()
    assert all(after[gpu][f] != before[gpu][f] for gpu in after for f in build.FLAVORS), rel
    assert hip_compile() != before_hip and keys() == cpu


@pytest.mark.parametrize("rel", COMPILE_ONLY)
def test_a_compile_only_input_changes_only_the_compile_only_key(repo, hip_compile, rel):
    before, before_hip = gpu_keys(), hip_compile()
    touch(repo, rel)
    assert hip_compile() != before_hip and gpu_keys() == before, rel


def test_the_compile_only_key_follows_its_toolchain(repo, hip_compile, monkeypatch, tmp_path):
    """The compiler (its --version) and the device libraries' bytes are in the key."""
    before = hip_compile()
    (tmp_path / "bitcode" / "ocml.bc").write_bytes(b"BC other ocml")
    libs = hip_compile()
    assert libs != before
    tool = shutil.which("ctest")  # another program's --version: another compiler
    monkeypatch.setattr(build, "_hip_tools", lambda: {"clang++-19": tool, "clang-19": tool, "llvm-as-19": tool})
    assert hip_compile() not in (before, libs)


def test_the_gpu_key_hashes_what_the_patch_step_opens(tmp_path):
    """Run the GPU builds' patch step (hip_kernels/apply_patch.cmake, cmake/llama.cmake's
    PATCH_COMMAND) under strace on a copy of the pinned ggml-cuda: every checkout file it opens is a
    key input, and every hip_kernels/ input the key hashes is opened."""
    strace = shutil.which("strace")
    pinned = build.cache_root() / "src" / f"llama_cpp_python-{build.LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if strace is None or not (pinned / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").is_file():
        pytest.skip("needs strace and the pinned llama.cpp source (`dflash build` fetches it)")
    src = tmp_path / "src"
    for sub in ("ggml-cuda", "ggml-hip"):
        shutil.copytree(pinned / "ggml" / "src" / sub, src / "ggml" / "src" / sub, symlinks=True)
    trace = tmp_path / "trace.txt"
    root = build.SOURCE_ROOT.resolve()
    cmd = [strace, "-f", "-qq", "-s", "4096", "-e", "trace=open,openat,execve", "-o", str(trace), "cmake",
           f"-DSRC={src}", f"-DPATCH_DIR={root / 'hip_kernels'}", "-P", str(root / "hip_kernels" / "apply_patch.cmake")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    opened = set()
    for path in re.findall(r'"(/[^"]+)"', trace.read_text()):
        p = Path(path)
        rel = p.resolve().relative_to(root) if p.resolve().is_relative_to(root) else None
        if p.is_file() and rel is not None and rel.parts[0] not in (".venv", "build"):  # not the tools' own files
            opened.add(str(rel))
    hashed = set(build._hip_kernels_inputs())
    assert opened <= hashed | set(build._KEY_INPUTS), opened - hashed - set(build._KEY_INPUTS)
    assert hashed <= opened, hashed - opened


def test_vulkan_kernels_and_toolchain_change_only_vulkan_keys(repo, monkeypatch):
    """vulkan_kernels (its patch set and apply script) and the Vulkan toolchain (glslc, the
    headers' version) key the Vulkan builds alone; hip_kernels do not key them."""
    monkeypatch.setattr(build, "vulkan_toolchain", lambda: "shaderc v2023.2|headers 239")
    before = {gpu: keys(gpu) for gpu in ("none", "hip", "vulkan")}
    assert before["vulkan"] != before["hip"] and before["vulkan"] != before["none"]
    flip_byte(first_patch(repo, "vulkan_kernels/patches/common"))
    after = {gpu: keys(gpu) for gpu in ("none", "hip", "vulkan")}
    assert after["none"] == before["none"] and after["hip"] == before["hip"]
    assert all(after["vulkan"][f] != before["vulkan"][f] for f in build.FLAVORS)
    flip_byte(repo / "hip_kernels" / "apply_patch.cmake")
    assert keys("vulkan") == after["vulkan"]
    flip_byte(first_patch(repo, "vulkan_kernels/patches/exact"))  # the exact flavor's kernels: its key alone
    exact_only = keys("vulkan")
    assert exact_only["exact"] != after["vulkan"]["exact"] and exact_only["stock"] == after["vulkan"]["stock"]
    after["vulkan"] = exact_only
    monkeypatch.setattr(build, "vulkan_toolchain", lambda: "shaderc v2024.0|headers 290")
    assert all(keys("vulkan")[f] != after["vulkan"][f] for f in build.FLAVORS)


def test_the_vulkan_build_names_the_packages_it_lacks(monkeypatch):
    """Without glslc, the headers or SPIRV-Headers the build stops before cmake, naming the Debian
    packages (one line, the exit code of a failed build)."""
    monkeypatch.setattr(build, "VULKAN_NEEDS", (("dflash-no-such-glslc", "glslc"),
                                                ("/nonexistent/vulkan_core.h", "libvulkan-dev")))
    monkeypatch.setattr(build, "is_built", lambda *a, **k: False)
    assert build.vulkan_missing() == ["glslc", "libvulkan-dev"]
    with pytest.raises(DflashError, match="apt-get install glslc libvulkan-dev"):
        build.build_library("stock", "vulkan")
