"""cmake/patch_set.cmake (dflash_apply_patches) in CMake script mode on a scratch tree: two
patches of one call that touch the same file both land, a second run leaves the tree as it is, and
a changed patch replaces its older version."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINES = [f"line {i}\n" for i in range(1, 21)]


def diff(old: list[str], new: list[str], path: str = "f.txt") -> str:
    import difflib
    body = "".join(difflib.unified_diff(old, new, f"a/{path}", f"b/{path}", n=3))
    return f"diff --git a/{path} b/{path}\n{body}"


def edit(lines: list[str], i: int, text: str) -> list[str]:
    out = list(lines)
    out[i] = text
    return out


def apply(tree: Path, *patches: Path) -> subprocess.CompletedProcess:
    script = tree.parent / "apply.cmake"
    script.write_text(f'include("{ROOT}/cmake/patch_set.cmake")\n'
                      f'dflash_apply_patches("{tree}" {" ".join(f"{chr(34)}{p}{chr(34)}" for p in patches)})\n')
    return subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not shutil.which("cmake"), reason="no cmake")
def test_two_patches_on_one_file_both_land_and_reruns_are_stable(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "f.txt").write_text("".join(LINES))
    first = edit(LINES, 1, "line 2 (first patch)\n")
    both = edit(first, 15, "line 16 (second patch)\n")
    p1, p2 = tmp_path / "0001.patch", tmp_path / "0002.patch"
    p1.write_text(diff(LINES, first))
    p2.write_text(diff(first, both))
    for _ in range(2):  # applied, then applied again over the patched tree
        r = apply(tree, p1, p2)
        assert r.returncode == 0, r.stderr
        assert (tree / "f.txt").read_text() == "".join(both)
    assert (tree / "f.txt.dflash-orig").read_text() == "".join(LINES)
    # a new version of the second patch replaces the old one; the first stays
    newer = edit(first, 15, "line 16 (second patch, v2)\n")
    p2.write_text(diff(first, newer))
    r = apply(tree, p1, p2)
    assert r.returncode == 0, r.stderr
    assert (tree / "f.txt").read_text() == "".join(newer)


@pytest.mark.skipif(not shutil.which("cmake"), reason="no cmake")
def test_a_patch_that_does_not_fit_is_a_fatal_error(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "f.txt").write_text("".join(LINES))
    bad = tmp_path / "bad.patch"
    bad.write_text(diff(edit(LINES, 3, "something else\n"), edit(LINES, 3, "changed\n")))
    r = apply(tree, bad)
    assert r.returncode != 0 and "does not apply" in r.stderr
    assert (tree / "f.txt").read_text() == "".join(LINES)


@pytest.mark.skipif(not shutil.which("cmake"), reason="no cmake")
def test_the_vulkan_patch_set_fits_the_pinned_source(tmp_path):
    """vulkan_kernels/apply_patches.cmake on a copy of the pinned files it patches: the common patch
    lands (the layer-settings block is guarded for Vulkan headers without VK_EXT_layer_settings),
    and a second run leaves the file as it is."""
    from dflash.native import build
    src = build.source_dir() / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
    tree = tmp_path / "llama.cpp"
    dst = tree / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
    touched = {line[6:].strip() for p in (ROOT / "vulkan_kernels" / "patches").rglob("*.patch")
               for line in p.read_text().splitlines() if line.startswith("+++ b/")}
    assert "ggml/src/ggml-vulkan/ggml-vulkan.cpp" in touched, touched
    for rel in touched:  # every file a patch of the set edits (ggml-vulkan.cpp, shaders)
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build.source_dir() / rel, tree / rel)
    cmd = ["cmake", f"-DSRC={tree}", "-DFLAVOR=exact", f"-DPATCH_DIR={ROOT / 'vulkan_kernels'}", "-P",
           str(ROOT / "vulkan_kernels" / "apply_patches.cmake")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    once = dst.read_text()
    assert "#if defined(VK_EXT_layer_settings)" in once and once != src.read_text()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert dst.read_text() == once
