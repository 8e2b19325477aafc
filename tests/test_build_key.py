"""The llama.cpp library build key (dflash/build.py): which inputs it sees, per flavor and GPU.

Every test runs on a temporary copy of the key's inputs (the CMake files, cpu_kernels/patches and
hip_kernels), with build.REPO_ROOT pointed at it: the checkout is never touched, and nothing is
built (no cmake), only keys are computed."""
import shutil

import pytest

from dflash import build
from dflash.errors import DflashError

INPUTS = ("CMakeLists.txt", "cmake", "cpu_kernels/patches", "rpc/patches", "hip_kernels")
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
    real = build.REPO_ROOT
    real_keys = keys()
    root = tmp_path / "checkout"
    for rel in INPUTS:
        src, dst = real / rel, root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=False)
        else:
            shutil.copy2(src, dst)
    monkeypatch.setattr(build, "REPO_ROOT", root)
    try:
        from dflash import paths
        monkeypatch.setattr(paths, "REPO_ROOT", root)
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
    with pytest.raises(DflashError, match="source checkout"):
        build.build_key("exact")
