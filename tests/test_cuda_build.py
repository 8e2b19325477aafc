"""The CUDA flavor's built libraries (`dflash build --gpu cuda`), where they are built: every
dynamic dependency resolves from the wheel folder or the system, except the driver's libcuda.so.1
(only a machine with an NVIDIA driver has it), and nothing resolves to the link stub. Without LD_LIBRARY_PATH:
the libraries' run path ($ORIGIN and the wheel folder) is what finds them.

Runs for each flavor that is built here (a named skip for one that is not: its build is long, see
README.md, "On an NVIDIA machine"); a "not found" other than the driver's fails."""
import os
import subprocess

import pytest

from dflash.native import build, cuda_libs


@pytest.mark.parametrize("flavor", build.FLAVORS)
def test_cuda_libraries_resolve_every_dependency_but_the_driver(flavor):
    if not build.is_built(flavor, "cuda"):
        pytest.skip(f"the {flavor} CUDA library is not built here (`dflash build --lib {flavor} --gpu cuda`)")
    lib = build.library_dir(flavor, "cuda")
    files = sorted(p for p in lib.iterdir() if ".so" in p.name and p.is_file() and not p.is_symlink())
    assert any(p.name.startswith("libggml-cuda.so") for p in files), f"no libggml-cuda.so in {lib}"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    problems = {}
    for p in files:
        out = subprocess.run(["ldd", str(p)], capture_output=True, text=True, env=env)
        assert out.returncode == 0, f"ldd {p}: {out.stderr}"
        bad = cuda_libs.unresolved(out.stdout)
        if bad:
            problems[p.name] = bad
    assert not problems, f"unresolved dependencies: {problems}"
    cuda = next(p for p in files if p.name.startswith("libggml-cuda.so"))
    dyn = subprocess.run(["readelf", "-d", str(cuda)], capture_output=True, text=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in dyn.splitlines() if "(NEEDED)" in line]
    for lib_name in ("libcublas.so.", "libcudart.so.", "libcuda.so.1"):  # the wheels' and the driver's
        assert any(n.startswith(lib_name) for n in needed), (lib_name, needed)
    runpath = next((line for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line), "")
    assert "$ORIGIN" in runpath and "/cuda/" in runpath and "/stubs" not in runpath, runpath
