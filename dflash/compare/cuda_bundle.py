"""The CUDA bundle `scripts/gpu-check --make-bundle DIR` packs here for a lent NVIDIA machine, whose
image lacks a compiler and Python packages: both CUDA flavors of the library (or the exact one alone
when both do not fit), the pure-Python packages dflash imports, and bundle.json (sizes, SHA-256s,
the build host's instruction sets); and, there, the unpacking and the CUDA runtime's folders."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash.core import cpu_isa
from dflash.core.fileio import sha256_file
from dflash.core.paths import REPO_ROOT
from dflash.native import build

FLAVORS = ("exact", "stock")
ISA_FLAGS = re.compile(r"avx512\w*|amx\w*|avx_vnni\w*|avx2|fma|f16c|bmi2")  # what -march=native can lean on
BUNDLE_LIMIT = 64 << 20  # what the lent machine takes beside the working tree


def host_isa(flags: frozenset[str]) -> list[str]:
    """The instruction sets among `flags` that a -march=native build can lean on."""
    return sorted(f for f in flags if ISA_FLAGS.fullmatch(f))


def make_bundle(out: Path, log: Any = print) -> dict:
    """Build (if needed) both CUDA flavors here and pack what the lent machine runs into `out`:
    libs.tar.xz (each flavor's lib/ and include/, shared objects stripped of their symbol tables but
    not of their dynamic symbols or GPU code), py/ (pure-Python packages) and bundle.json (sizes,
    SHA-256s, the build host's instruction sets). Both flavors when they fit BUNDLE_LIMIT, else the
    exact one alone (the check's twin is then the exact library with its hooks off); refuses more."""
    out.mkdir(parents=True, exist_ok=True)
    built = {f: build.build_library(f, "cuda", log=log) for f in FLAVORS}
    _bundle_python(out / "py")
    py_bytes = sum(p.stat().st_size for p in (out / "py").rglob("*") if p.is_file())
    room = BUNDLE_LIMIT - _tree_bytes() - py_bytes - (64 << 10)  # the working tree travels too; bundle.json
    tried = {}
    for flavors in (FLAVORS, ("exact",)):
        info = _pack(out, {f: built[f] for f in flavors})
        tried[",".join(flavors)] = info["libs_tar_xz_bytes"]
        if info["libs_tar_xz_bytes"] <= room:
            break
    else:
        (out / "libs.tar.xz").unlink()
        raise SystemExit(f"gpu-check: even the exact library alone packs to {tried['exact'] / 2**20:.1f} MiB, over "
                         f"the {room / 2**20:.1f} MiB left of the lent machine's {BUNDLE_LIMIT >> 20} MiB")
    info.update({"made_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "py_bytes": py_bytes,
                 "cuda_architectures": build.cuda_architectures(), "nvcc": build._nvcc_version(),
                 "build_host_isa": host_isa(cpu_isa.host_flags()), "packed_bytes_tried": tried})
    (out / "bundle.json").write_text(json.dumps(info, indent=2) + "\n")
    info["total_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return info


def _tree_bytes() -> int:
    """What the device tool carries of the checkout: tracked and untracked files git does not ignore."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, cwd=REPO_ROOT)
    names = [n for n in r.stdout.decode(errors="replace").split("\0") if n]
    return sum((REPO_ROOT / n).stat().st_size for n in names if (REPO_ROOT / n).is_file())


def _pack(out: Path, libs: Mapping[str, Path]) -> dict:
    stage = Path(tempfile.mkdtemp(prefix="bundle-", dir=out))
    info: dict[str, Any] = {"flavors": {}}
    try:
        for flavor, lib in libs.items():
            dest = stage / flavor
            shutil.copytree(lib.parent / "include", dest / "include")
            (dest / "lib").mkdir(parents=True)
            sizes = {}
            for f in sorted(lib.iterdir()):
                if f.is_symlink():
                    (dest / "lib" / f.name).symlink_to(os.readlink(f))
                elif f.is_file() and ".so" in f.name:
                    copy = dest / "lib" / f.name
                    shutil.copy2(f, copy)
                    subprocess.run(["strip", "--strip-unneeded", str(copy)], check=True)
                    sizes[f.name] = {"bytes": f.stat().st_size, "stripped_bytes": copy.stat().st_size}
            info["flavors"][flavor] = {"build": lib.parent.name, "files": sizes}
        tar = out / "libs.tar.xz"
        with tarfile.open(tar, "w:xz", preset=9) as t:
            for flavor in libs:
                t.add(stage / flavor, arcname=flavor)
        info["libs_tar_xz_bytes"] = tar.stat().st_size
        info["libs_tar_xz_sha256"] = sha256_file(tar)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return info


def _bundle_python(dest: Path) -> None:
    """The pure-Python packages dflash needs that the lent machine's image lacks: llama_cpp's
    bindings (installed without their library), diskcache (which they import) and gguf."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    import importlib.util
    for name in ("llama_cpp", "diskcache", "gguf"):  # located, not imported: importing llama_cpp loads a library
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SystemExit(f"gpu-check: {name} is not installed here (scripts/setup installs it)")
        src = Path(spec.origin).parent
        shutil.copytree(src, dest / src.name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "lib"))


def unpack_bundle(bundle: Path, work: Path) -> tuple[dict[str, Path], dict]:
    info = json.loads((bundle / "bundle.json").read_text())
    with tarfile.open(bundle / "libs.tar.xz") as t:
        t.extractall(work / "bundle", filter="tar")
    return {f: work / "bundle" / f / "lib" for f in info["flavors"]}, info


def cuda_runtime_dirs() -> list[Path]:
    """Folders holding libcublas.so.<N> and libcudart.so.<N> on this machine (pip's nvidia
    packages of any Python on PATH, the toolkit), for LD_LIBRARY_PATH on a machine that did not
    build the libraries (their run path names the builder's wheel folder)."""
    found: list[Path] = []
    roots = [Path(p) for p in sys.path if p] + [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/lib")]
    for py in ("python3",):
        exe = shutil.which(py)
        if exe:
            r = subprocess.run([exe, "-c", "import sys; print('\\n'.join(sys.path))"], capture_output=True, text=True)
            roots += [Path(p) for p in r.stdout.splitlines() if p]
    for root in roots:
        for cand in [root, *root.glob("nvidia/*/lib")]:
            if cand.is_dir() and any(cand.glob("lib*.so.*")) and (
                    any(cand.glob("libcublas.so.*")) or any(cand.glob("libcudart.so.*"))) and cand not in found:
                found.append(cand)
    return found
