"""cuBLAS and the CUDA runtime for the CUDA flavor, from NVIDIA's wheels on PyPI.

ggml's CUDA backend links cuBLAS (CUDA::cublas, with cublasLt), the CUDA runtime and the driver
(CUDA::cuda_driver, for its virtual-memory pool). A CUDA toolkit installed from NVIDIA's wheels
(nvcc, the runtime headers: what this project's machines have) holds no cuBLAS, so
`dflash build --gpu cuda` takes it from PyPI:

- the wheel set matching nvcc's major.minor (WHEEL_SETS; the versions the `cuda-toolkit`
  meta-package of that release pins), fetched once with `pip download --no-deps` into
  ~/.cache/dflash/cuda/<key>/ (`$XDG_CACHE_HOME/dflash/...` when set); only the shared libraries
  and the cuBLAS headers are kept, the wheels are deleted after extraction;
- `lib/`: libcublas, libcublasLt and libcudart with their unversioned names, which CMake's
  FindCUDAToolkit is handed as CUDA_cublas_LIBRARY, CUDA_cublasLt_LIBRARY and CUDA_cudart_LIBRARY;
  the built libraries get this folder (and $ORIGIN) as their run path, so they load without
  LD_LIBRARY_PATH;
- `include/`: cuBLAS's headers (CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES); the runtime's headers
  stay the toolkit's own, so nvcc and its headers always match;
- `stubs/libcuda.so`: a link stub (soname libcuda.so.1) with every function cuda.h declares,
  each returning CUDA_ERROR_STUB_LIBRARY, as CUDA_cuda_driver_LIBRARY. It is only linked
  against: no run path names it, and at run time the driver's own libcuda.so.1 is loaded.

`wheels.json` in that folder names each wheel, its version, file, size and SHA-256.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import DflashError
from dflash.core.fileio import fsync_dir, sha256_file
from dflash.core.paths import cache_root

Log = Callable[[str], None]
# the download step, replaceable in tests: (requirement "name==version", folder) -> the wheel file
Download = Callable[[str, Path], Path]

STUB_ERROR = 34  # CUDA_ERROR_STUB_LIBRARY: what NVIDIA's own stub answers
STUB_VERSION = 1  # bump when the stub's source or build changes (it is in the key)
# the libraries each wheel contributes (lib<name>.so.<major>); nothing else is extracted
_LIB_NAMES = {"cublas": ("cublas", "cublasLt"), "cuda-runtime": ("cudart",)}


@dataclass(frozen=True)
class Wheel:
    name: str     # the PyPI project: nvidia-cublas, nvidia-cublas-cu12, ...
    version: str
    part: str     # "cublas" or "cuda-runtime": what it holds

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class WheelSet:
    release: str  # the CUDA release whose cuda-toolkit meta-package pins these versions
    wheels: tuple[Wheel, ...]

    @property
    def major(self) -> int:
        return int(self.release.split(".")[0])


def _set(release: str, cublas: tuple[str, str], runtime: tuple[str, str]) -> WheelSet:
    return WheelSet(release, (Wheel(*cublas, "cublas"), Wheel(*runtime, "cuda-runtime")))


# nvcc (major, minor) -> the wheels. CUDA 13 wheels drop the -cuXX suffix (nvidia-cublas-cu13 is
# an empty, deprecated name); CUDA 12's keep it.
WHEEL_SETS: dict[tuple[int, int], WheelSet] = {
    (13, 0): _set("13.0.3", ("nvidia-cublas", "13.1.1.3"), ("nvidia-cuda-runtime", "13.0.96")),
    (12, 9): _set("12.9.1", ("nvidia-cublas-cu12", "12.9.1.4"), ("nvidia-cuda-runtime-cu12", "12.9.79")),
}


def nvcc_release(version_text: str) -> tuple[int, int]:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    m = re.search(r"release (\d+)\.(\d+)", version_text)
    if m is None:
        raise DflashError(f"cannot read the CUDA release from nvcc's version: {version_text.strip()[:120]!r}")
    return int(m[1]), int(m[2])


def wheel_set(release: tuple[int, int]) -> WheelSet:
    """The wheels for nvcc's release: the exact entry, else the newest entry of the same major
    whose minor is not above nvcc's (cuBLAS and the runtime are compatible within a major, and an
    older cuBLAS than the toolkit never uses a runtime function the toolkit lacks)."""
    if release in WHEEL_SETS:
        return WHEEL_SETS[release]
    same = sorted(r for r in WHEEL_SETS if r[0] == release[0] and r[1] <= release[1])
    if same:
        return WHEEL_SETS[same[-1]]
    known = ", ".join(f"{a}.{b}" for a, b in sorted(WHEEL_SETS))
    raise DflashError(f"no cuBLAS wheel set for CUDA {release[0]}.{release[1]} (dflash knows {known}): "
                      f"install cuBLAS with the toolkit, or use a toolkit of a known release")


def key(ws: WheelSet, cuda_h: bytes) -> str:
    """The folder's key: the wheels, the stub's version and the cuda.h it is generated from."""
    h = hashlib.sha256(f"{ws.release}|{'|'.join(w.requirement for w in ws.wheels)}|stub{STUB_VERSION}|".encode())
    h.update(cuda_h)
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class CudaLibs:
    root: Path

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def include(self) -> Path:
        return self.root / "include"

    @property
    def driver_stub(self) -> Path:
        return self.root / "stubs" / "libcuda.so"

    def library(self, name: str) -> Path:
        return self.lib / f"lib{name}.so"

    def cmake_args(self) -> list[str]:
        """What cmake/llama.cmake passes on to llama.cpp's configure (DFLASH_CUDA_LIBS)."""
        return [f"-DDFLASH_CUDA_LIBS={self.root}"]

    def manifest(self) -> dict:
        return dict(json.loads((self.root / "wheels.json").read_text()))


def toolkit_include(nvcc: str) -> Path:
    """The toolkit's include folder (cuda.h, cuda_runtime.h): nvcc's bin/../include, following links
    (a wrapper script that execs the real nvcc is read for the path it names)."""
    real = Path(nvcc).resolve()
    for cand in (real.parent.parent / "include", real.parent.parent / "targets" / "x86_64-linux" / "include"):
        if (cand / "cuda.h").is_file():
            return cand
    try:
        text = real.read_text(errors="replace")[:4096] if real.stat().st_size < 4096 else ""
    except OSError:
        text = ""
    m = re.search(r"(/\S+/bin/nvcc)\b", text)
    if m and Path(m[1]).resolve() != real:
        return toolkit_include(m[1])
    raise DflashError(f"cannot find the CUDA toolkit's cuda.h beside {nvcc} (bin/../include)")


def driver_functions(cuda_h: Path, cc: str = "cc") -> list[str]:
    """The names client code links against: every `CUresult cuXxx(` declaration of cuda.h after
    the preprocessor (so cuMemAlloc is cuMemAlloc_v2, as the macros map it)."""
    r = subprocess.run([cc, "-E", "-P", "-x", "c", "-I", str(cuda_h.parent), str(cuda_h)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise DflashError(f"cannot preprocess {cuda_h}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    names = sorted(set(re.findall(r"\bCUresult\s+(cu[A-Z]\w*)\s*\(", r.stdout)))
    if len(names) < 50 or "cuMemCreate" not in names:
        raise DflashError(f"{cuda_h} declares only {len(names)} driver functions (no cuMemCreate): not cuda.h?")
    return names


def build_driver_stub(cuda_h: Path, out: Path, cc: str = "cc") -> Path:
    """stubs/libcuda.so: soname libcuda.so.1, each driver function returning STUB_ERROR."""
    names = driver_functions(cuda_h, cc)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / "libcuda_stub.c"
    src.write_text("/* dflash: link stub for the CUDA driver (generated from cuda.h); never loaded at run time */\n"
                   "int dflash_cuda_link_stub(void) { return 1; }\n"
                   + "".join(f"int {n}(void) {{ return {STUB_ERROR}; }}\n" for n in names))
    r = subprocess.run([cc, "-shared", "-fPIC", "-O0", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise DflashError(f"cannot build the CUDA driver link stub: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def pip_download(requirement: str, folder: Path) -> Path:
    """`pip download --no-deps --only-binary=:all:` of one wheel into `folder`; the file it saved."""
    before = set(folder.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(folder), requirement]
    r = subprocess.run(cmd, capture_output=True, text=True)
    got = sorted(p for p in set(folder.iterdir()) - before if p.suffix == ".whl")
    if r.returncode != 0 or len(got) != 1:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DflashError(f"pip download {requirement} failed: {tail[0]}")
    return got[0]


def _wheel_file_name(w: Wheel, path: Path) -> None:
    """The wheel pip saved is the one asked for (name and version in its file name)."""
    stem = w.name.replace("-", "_").lower()
    if not path.name.lower().startswith(f"{stem}-{w.version}-"):
        raise DflashError(f"pip saved {path.name} for {w.requirement}")


def extract(w: Wheel, wheel: Path, root: Path) -> list[str]:
    """The shared libraries of `w.part` (lib<name>.so.<N>) into root/lib with their unversioned
    links, and for cuBLAS its headers into root/include; the relative paths written."""
    wanted = _LIB_NAMES[w.part]
    written: list[str] = []
    lib_re = re.compile(r"lib(" + "|".join(map(re.escape, wanted)) + r")\.so\.(\d+)")
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            name = parts[-1]
            if "lib" in parts[:-1] and lib_re.fullmatch(name):
                dest = root / "lib" / name
            elif w.part == "cublas" and "include" in parts[:-1] and name.endswith(".h"):
                dest = root / "include" / name
            else:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            if name.startswith("lib"):
                dest.chmod(0o755)
            written.append(str(dest.relative_to(root)))
    for name in wanted:
        versioned = sorted((root / "lib").glob(f"lib{name}.so.*"))
        if not versioned:
            raise DflashError(f"{wheel.name} holds no lib{name}.so.<N>")
        link = root / "lib" / f"lib{name}.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(versioned[0].name)
    if w.part == "cublas" and not (root / "include" / "cublas_v2.h").is_file():
        raise DflashError(f"{wheel.name} holds no cublas_v2.h")
    return written


def cache_folder() -> Path:
    return cache_root() / "cuda"


def _release_line(nvcc_version: str) -> str:
    return next((x.strip() for x in nvcc_version.splitlines() if "release" in x), nvcc_version.strip()[:80])


def ensure(nvcc: str, nvcc_version: str, log: Log = lambda s: None, download: Download = pip_download,
           cc: str = "cc") -> CudaLibs:
    """The folder of cuBLAS, the runtime and the driver stub for this nvcc: fetched and assembled
    on first use (atomically: a half-made folder never sits at the keyed path), reused after."""
    ws = wheel_set(nvcc_release(nvcc_version))
    cuda_h = toolkit_include(nvcc) / "cuda.h"
    base = cache_folder()
    dest = base / key(ws, cuda_h.read_bytes())
    if (dest / "wheels.json").is_file():
        return CudaLibs(dest)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="assemble-", dir=base))
    try:
        root, wheels_dir = work / "root", work / "wheels"
        root.mkdir()
        wheels_dir.mkdir()
        entries = []
        for w in ws.wheels:
            log(f"CUDA libraries: pip download {w.requirement} (once)")
            path = download(w.requirement, wheels_dir)
            _wheel_file_name(w, path)
            files = extract(w, path, root)
            entries.append({"name": w.name, "version": w.version, "part": w.part, "file": path.name,
                            "bytes": path.stat().st_size, "sha256": sha256_file(path), "extracted": files})
            path.unlink()  # hundreds of MB; only what the build links stays
        build_driver_stub(cuda_h, root / "stubs" / "libcuda.so", cc)
        (root / "wheels.json").write_text(json.dumps(
            {"cuda_release": ws.release, "nvcc": _release_line(nvcc_version), "cuda_h": str(cuda_h),
             "wheels": entries, "lib_bytes": {p.name: p.stat().st_size for p in sorted((root / "lib").iterdir())
                                              if not p.is_symlink()}}, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(root, dest)
        fsync_dir(base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return CudaLibs(dest)


def unresolved(ldd_output: str, allowed: Sequence[str] = ("libcuda.so.1",)) -> list[str]:
    """The libraries `ldd` reports "not found", less the `allowed` ones (the driver's, which only a
    machine with an NVIDIA driver has), and any resolved to a link stub (a path under stubs/)."""
    bad = []
    for line in ldd_output.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(.*?)\s*(?:\(0x[0-9a-f]+\))?\s*$", line)
        if m is None:
            continue
        name, where = m[1], m[2]
        if where == "not found" and name not in allowed:
            bad.append(name)
        elif "/stubs/" in where:
            bad.append(f"{name} (the link stub {where})")
    return bad
