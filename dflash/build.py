"""Build and locate the llama.cpp shared libraries dflash loads.

The source is the llama.cpp that llama-cpp-python 0.3.36 vendors (the bindings' ctypes structs
mirror exactly that commit's llama.h). It is fetched with `pip download` into the user cache,
configured through the project's CMakeLists.txt for a flavor ("exact" or "stock"), and
installed under ~/.cache/dflash/llama/<flavor>-<key>/ where the key hashes every input of the
build: the pinned version, the flavor and GPU backend, the CMake files, the compiler and the
host CPU's feature flags (the build is native).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import DflashError
from .paths import FLAVORS, LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, REPO_ROOT, cache_root

__all__ = ["FLAVORS", "LLAMA_CPP_COMMIT", "LLAMA_CPP_PYTHON_VERSION", "REPO_ROOT", "build_key", "build_library",
           "cache_root", "install_dir", "is_built", "library_dir", "source_dir"]

_KEY_INPUTS = ("CMakeLists.txt", "cmake/llama.cmake", "cmake/apply_patches.cmake", "cmake/patch_set.cmake")
_PATCH_DIRS = {"exact": ("cpu_kernels/patches/common", "cpu_kernels/patches/exact"),
               "stock": ("cpu_kernels/patches/common",)}  # the patch set each flavor applies

Log = Callable[[str], None]


@functools.lru_cache(maxsize=1)
def _host_fingerprint() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    try:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout
    except OSError:
        cc = "no cc"
    return f"{platform.machine()}|{flags}|{cc.splitlines()[0] if cc else ''}"


def build_key(flavor: str, gpu: str = "none") -> str:
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}|{flavor}|{gpu}|".encode())
    if not (REPO_ROOT / "CMakeLists.txt").is_file():
        raise DflashError(f"dflash builds llama.cpp from its source checkout, and {REPO_ROOT} is not one: "
                          f"install with `pip install -e` from a clone, or set DFLASH_LLAMA_LIB_DIR")
    for rel in _KEY_INPUTS:
        h.update(rel.encode() + b"\0" + (REPO_ROOT / rel).read_bytes())
    for d in _PATCH_DIRS.get(flavor, ()) + (("hip_kernels",) if gpu == "hip" else ()):
        for p in sorted((REPO_ROOT / d).rglob("*")):
            if p.is_file():
                h.update(str(p.relative_to(REPO_ROOT)).encode() + b"\0" + p.read_bytes())
    h.update(_host_fingerprint().encode())
    return h.hexdigest()[:16]


def install_dir(flavor: str, gpu: str = "none") -> Path:
    if flavor not in FLAVORS:
        raise DflashError(f"unknown llama.cpp library flavor {flavor!r} (use one of {', '.join(FLAVORS)})")
    return cache_root() / "llama" / f"{flavor}-{build_key(flavor, gpu)}"


def library_dir(flavor: str, gpu: str = "none") -> Path:
    return install_dir(flavor, gpu) / "lib"


def is_built(flavor: str, gpu: str = "none") -> bool:
    return (library_dir(flavor, gpu) / "libllama.so").is_file()


def sdist_path(log: Log = lambda s: None) -> Path:
    """The pinned llama-cpp-python sdist, downloaded once with pip into the cache."""
    d = cache_root() / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if (d / name).is_file():
        return d / name
    d.mkdir(parents=True, exist_ok=True)
    log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} source with pip")
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / name
        if not got.is_file():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DflashError(f"pip download of llama-cpp-python source failed: {tail[0]}")
        os.replace(got, d / name)
    return d / name


def source_dir(log: Log = lambda s: None) -> Path:
    """vendor/llama.cpp extracted from the sdist (once)."""
    root = cache_root() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    src = root / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    tarball = sdist_path(log)
    log(f"extracting vendor/llama.cpp from {tarball.name}")
    tmp = Path(tempfile.mkdtemp(dir=cache_root()))
    try:
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"
        with tarfile.open(tarball) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            tf.extractall(tmp, members=members, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}", root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def build_library(flavor: str, gpu: str = "none", jobs: int | None = None,
                  log: Log = lambda s: None) -> Path:
    """Configure and build llama.cpp for `flavor` unless the keyed install already exists."""
    if is_built(flavor, gpu):
        return library_dir(flavor, gpu)
    if shutil.which("cmake") is None:
        raise DflashError("cmake is not installed (apt-get install cmake)")
    from .supervisor import stage
    stage(f"build of the {flavor} llama.cpp library")
    src = source_dir(log)
    dest = install_dir(flavor, gpu)
    work = Path(tempfile.mkdtemp(prefix=f"build-{flavor}-", dir=cache_root()))
    staging = work / "install"
    # every build patches its source (cpu_kernels/patches, and hip_kernels for HIP): give it a
    # private copy, never the shared tree
    src = Path(shutil.copytree(src, work / "llama.cpp", symlinks=True,
                               ignore=shutil.ignore_patterns(".git")))
    configure = ["cmake", "-S", str(REPO_ROOT), "-B", str(work / "b"),
                 f"-DDFLASH_LLAMA_SRC={src}", f"-DDFLASH_LLAMA_FLAVOR={flavor}",
                 f"-DDFLASH_LLAMA_PREFIX={staging}", f"-DDFLASH_GPU={gpu}",
                 "-DDFLASH_BUILD_KERNELS=OFF"]
    build = ["cmake", "--build", str(work / "b"), "-j", str(jobs or os.cpu_count() or 2)]
    log(f"building llama.cpp ({flavor}, {LLAMA_CPP_COMMIT}) -> {dest} (a few minutes, once)")
    try:
        for cmd in (configure, build):
            with open(work / "build.log", "a") as out:
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                keep = cache_root() / f"build-{flavor}-failed.log"
                shutil.copyfile(work / "build.log", keep)
                hint = "; the HIP build needs ROCm >= 6.1 with its clang as HIP compiler" if gpu == "hip" else ""
                raise DflashError(f"llama.cpp {flavor} build failed (rc={r.returncode}){hint}; log: {keep}")
        if not (staging / "lib" / "libllama.so").is_file():
            raise DflashError(f"llama.cpp {flavor} build produced no libllama.so")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)  # atomic: a half-built tree never sits at the keyed path
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return library_dir(flavor, gpu)
