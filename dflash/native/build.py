"""Build and locate the llama.cpp shared libraries dflash loads.

The source is the llama.cpp that llama-cpp-python 0.3.36 vendors (the bindings' ctypes structs
mirror exactly that commit's llama.h). It is fetched with `pip download` into the user cache,
configured through the project's CMakeLists.txt for a flavor ("exact" or "stock"), and
installed under ~/.cache/dflash/llama/<flavor>-<key>/ where the key hashes every input of the
build: the pinned version, the flavor and GPU backend, the CMake files, the compiler and the
host CPU's feature flags (the build is native).

`build_server` builds llama.cpp's own llama-server (server/CMakeLists.txt): the same pinned
source with the exact patch set and the server patches, linked against the exact library's
installed ggml; only the server's own code is compiled. It is cached under
~/.cache/dflash/llama-server/<key>/ and runs against any flavor's library folder (`server_env`).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from dflash.core import settings
from dflash.core.cpu_isa import CPU_VARIANTS, NATIVE
from dflash.core.errors import DflashError
from dflash.core.fileio import fsync_dir, fsync_file
from dflash.core.paths import FLAVORS, LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, SOURCE_ROOT, cache_root
from dflash.native import cuda_libs

__all__ = ["CPU_VARIANTS", "FLAVORS", "HIP_ARCHS", "LLAMA_CPP_COMMIT", "LLAMA_CPP_PYTHON_VERSION", "SOURCE_ROOT",
           "build_hip_compile_only", "build_key", "build_library", "build_server", "cache_root", "hip_compile_key",
           "hip_headers", "install_dir", "is_built", "library_dir", "server_binary", "server_built", "server_env",
           "server_key", "source_dir"]

_KEY_INPUTS = ("CMakeLists.txt", "cmake/llama.cmake", "cmake/apply_patches.cmake", "cmake/patch_set.cmake",
               "cmake/install_cpu_backend.cmake")
_GPU_KEY_INPUTS = ("cmake/llama_gpu.cmake",)  # read by the GPU builds only
_VULKAN_KEY_INPUTS = ("vulkan_kernels/apply_patches.cmake", "vulkan_kernels/patches/common")  # the Vulkan build's own
_VULKAN_FLAVOR_INPUTS = {"exact": ("vulkan_kernels/patches/exact",)}  # and its flavor's
GPU_BACKENDS = ("hip", "cuda", "vulkan")  # `dflash build --gpu`
# what the Vulkan build needs from the system: a file or program each, and the Debian package giving it
VULKAN_NEEDS = (("glslc", "glslc"), ("/usr/include/vulkan/vulkan_core.h", "libvulkan-dev"),
                ("/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake", "spirv-headers"))
_PATCH_DIRS = {"exact": ("cpu_kernels/patches/common", "cpu_kernels/patches/exact", "rpc/patches"),
               "stock": ("cpu_kernels/patches/common", "rpc/patches")}  # the patch set each flavor applies
# what the llama-server build reads beyond the exact library it links against
_SERVER_INPUTS = ("server/CMakeLists.txt", "server/install_server.cmake", "server/apply_patches.cmake",
                  "server/patches", "cmake/apply_patches.cmake", "cmake/patch_set.cmake")

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


def build_key(flavor: str, gpu: str = "none", cpu: str = NATIVE) -> str:
    """The key of a build: every input it reads. A CPU variant other than native is the native
    build's libraries with that variant's libggml-cpu: its key is the native key's inputs and the
    variant's name (cmake/llama.cmake turns the name into llama.cpp's ISA options)."""
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}|{flavor}|{gpu}|".encode())
    if cpu not in CPU_VARIANTS:
        raise DflashError(f"unknown CPU variant {cpu!r} (use one of {', '.join(CPU_VARIANTS)})")
    if cpu != NATIVE:
        if gpu != "none":
            raise DflashError(f"--cpu {cpu} is a CPU-only build: GPU builds use the native CPU backend")
        h.update(f"cpu={cpu}|".encode())
    if not (SOURCE_ROOT / "CMakeLists.txt").is_file():
        raise DflashError(f"dflash builds llama.cpp from its CMake project and patch sets, and {SOURCE_ROOT} does "
                          f"not hold them: install from a clone or a wheel, or set DFLASH_LLAMA_LIB_DIR")
    for rel in _KEY_INPUTS:
        h.update(rel.encode() + b"\0" + (SOURCE_ROOT / rel).read_bytes())
    if gpu == "vulkan":
        gpu_inputs: tuple[str, ...] = (*_GPU_KEY_INPUTS, *_VULKAN_KEY_INPUTS, *_VULKAN_FLAVOR_INPUTS.get(flavor, ()))
    else:
        gpu_inputs = (*_GPU_KEY_INPUTS, *_hip_kernels_inputs()) if gpu != "none" else ()
    _hash_files(h, _PATCH_DIRS.get(flavor, ()) + gpu_inputs)
    h.update(_host_fingerprint().encode())
    if gpu == "cuda":  # the CUDA build: its architectures, its compiler, the cuBLAS/runtime wheels it links
        h.update(f"|{cuda_architectures()}|{_nvcc_version()}|{_cuda_libs_key()}".encode())
    if gpu == "vulkan":  # the shader compiler and the headers the backend is compiled against
        h.update(f"|{vulkan_toolchain()}".encode())
    return h.hexdigest()[:16]


def vulkan_missing() -> list[str]:
    """The Debian packages the Vulkan build needs and this machine lacks."""
    return [pkg for need, pkg in VULKAN_NEEDS
            if not (Path(need).is_file() if need.startswith("/") else shutil.which(need))]


def vulkan_toolchain() -> str:
    """glslc's version line and the Vulkan headers' version: what a Vulkan build is keyed by."""
    try:
        glslc = subprocess.run(["glslc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        glslc = "no glslc"
    header = Path("/usr/include/vulkan/vulkan_core.h")
    m = re.search(r"#define VK_HEADER_VERSION (\d+)", header.read_text(errors="replace")) if header.is_file() else None
    return f"{glslc}|headers {m.group(1) if m else 'none'}"


def _cuda_libs_key() -> str:
    """The key of the wheel folder the CUDA build links (dflash/native/cuda_libs.py), computed without
    fetching it: the wheel set nvcc's release picks, the stub's version, the toolkit's cuda.h."""
    nvcc = _nvcc()
    if nvcc is None:
        return "no nvcc"
    try:
        ws = cuda_libs.wheel_set(cuda_libs.nvcc_release(_nvcc_version_text()))
        return cuda_libs.key(ws, (cuda_libs.toolkit_include(nvcc) / "cuda.h").read_bytes())
    except DflashError as e:  # the build itself says so; the key only has to differ
        return f"no wheels ({e})"


def _hash_files(h: hashlib._Hash, rels: tuple[str, ...]) -> None:
    """Names and bytes of files and of every file under folders, relative to the checkout."""
    for rel in rels:
        p = SOURCE_ROOT / rel
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(str(f.relative_to(SOURCE_ROOT)).encode() + b"\0" + f.read_bytes())


def server_key() -> str:
    """The llama-server build's key: its inputs and the exact library it links against (built
    natively, so the host's CPU and compiler are in that library's key)."""
    h = hashlib.sha256(f"llama-server|{build_key('exact')}|".encode())
    _hash_files(h, _SERVER_INPUTS)
    return h.hexdigest()[:16]


def server_dir() -> Path:
    return cache_root() / "llama-server" / server_key()


def server_binary() -> Path:
    return server_dir() / "bin" / "llama-server"


def server_built() -> bool:
    return server_binary().is_file()


def server_env(flavor: str, gpu: str = "none", lib_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The environment entries that make llama-server load `flavor`'s library (or the folder
    `lib_dir`): its folder first on LD_LIBRARY_PATH, then the server's own libraries."""
    first = Path(lib_dir) if lib_dir else library_dir(flavor, gpu)
    return {"LD_LIBRARY_PATH": f"{first}:{server_dir() / 'lib'}"}


def cuda_architectures() -> str:
    """CUDA_ARCHITECTURES for the CUDA build, as CMake takes it (a;b). Default 90-real: machine code
    for sm_90 (H100/H200) and no PTX, which would only serve GPUs newer than the ones named and
    makes libggml-cuda larger (the lent H200 machine takes 64 MiB of prebuilt files)."""
    return os.environ.get("CUDA_ARCHITECTURES", "").strip() or "90-real"


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def _nvcc_version_text() -> str:
    nvcc = _nvcc()
    if nvcc is None:
        return "no nvcc"
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def _nvcc_version() -> str:
    return (_nvcc_version_text().strip().splitlines() or ["?"])[-1]


def build_name(flavor: str, gpu: str = "none", cpu: str = NATIVE) -> str:
    """The build's folder name under ~/.cache/dflash/llama/: <flavor>-<key>, or
    <flavor>-<variant>-<key> for a CPU variant other than native."""
    if flavor not in FLAVORS:
        raise DflashError(f"unknown llama.cpp library flavor {flavor!r} (use one of {', '.join(FLAVORS)})")
    key = build_key(flavor, gpu, cpu)
    return f"{flavor}-{key}" if cpu == NATIVE else f"{flavor}-{cpu}-{key}"


def install_dir(flavor: str, gpu: str = "none", cpu: str = NATIVE) -> Path:
    return cache_root() / "llama" / build_name(flavor, gpu, cpu)


def library_dir(flavor: str, gpu: str = "none", cpu: str = NATIVE) -> Path:
    return install_dir(flavor, gpu, cpu) / "lib"


def is_built(flavor: str, gpu: str = "none", cpu: str = NATIVE) -> bool:
    return (library_dir(flavor, gpu, cpu) / "libllama.so").is_file()


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
        fsync_file(got)  # a tarball that is there after a crash is whole
        os.replace(got, d / name)
        fsync_dir(d)
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
                  log: Log = lambda s: None, cpu: str = NATIVE) -> Path:
    """Configure and build llama.cpp for `flavor` unless the keyed install already exists. A CPU
    variant other than native builds only its libggml-cpu and installs it beside copies of the
    native build's other libraries (built first when missing)."""
    if is_built(flavor, gpu, cpu):
        return library_dir(flavor, gpu, cpu)
    if cpu != NATIVE:
        return _build_variant(flavor, cpu, jobs, log)
    if shutil.which("cmake") is None:
        raise DflashError("cmake is not installed (apt-get install cmake)")
    if gpu == "cuda" and _nvcc() is None:
        raise DflashError("the CUDA build needs nvcc (install the CUDA toolkit, or put its bin/ on PATH)")
    if gpu == "vulkan" and vulkan_missing():
        pkgs = " ".join(vulkan_missing())
        raise DflashError(f"the Vulkan build needs {pkgs} (Debian: apt-get install {pkgs}, or "
                          f"scripts/setup --vulkan; mesa-vulkan-drivers gives the CPU driver lavapipe)")
    from dflash.core.stage import stage
    stage(f"build of the {flavor} llama.cpp library")
    src = source_dir(log)
    with _work_tree(log) as work:
        if is_built(flavor, gpu):  # another process built it while this one waited
            return library_dir(flavor, gpu)
        return _build_native(flavor, gpu, src, work, jobs, log)


_BUILD_TIME = {"none": "about 2 minutes on 2 cores", "vulkan": "about 3 minutes on 2 cores"}


def _build_native(flavor: str, gpu: str, src: Path, work: Path, jobs: int | None, log: Log) -> Path:
    dest = install_dir(flavor, gpu)
    staging = work / "install"
    # every build patches its source (cpu_kernels/patches, and hip_kernels for HIP): give it a
    # private copy, never the shared tree
    src = Path(shutil.copytree(src, work / "llama.cpp", symlinks=True,
                               ignore=shutil.ignore_patterns(".git")))
    configure = ["cmake", "-S", str(SOURCE_ROOT), "-B", str(work / "b"),
                 f"-DDFLASH_LLAMA_SRC={src}", f"-DDFLASH_LLAMA_FLAVOR={flavor}",
                 f"-DDFLASH_LLAMA_PREFIX={staging}", f"-DDFLASH_GPU={gpu}",
                 "-DDFLASH_BUILD_KERNELS=OFF"]
    if gpu == "cuda":  # cuBLAS and the runtime from NVIDIA's wheels (fetched once), for any toolkit
        libs = cuda_libs.ensure(str(_nvcc()), _nvcc_version_text(), log)
        configure += [f"-DCUDA_ARCHITECTURES={cuda_architectures()}", *libs.cmake_args()]
    env = {**os.environ, **({"CUDACXX": str(_nvcc())} if gpu == "cuda" else {})}  # how CMake finds nvcc
    hint = {"hip": "; the HIP build needs ROCm >= 6.1 with its clang as HIP compiler",
            "cuda": "; the CUDA build needs the CUDA toolkit (nvcc)",
            "vulkan": "; the Vulkan build needs glslc, libvulkan-dev and spirv-headers"}.get(gpu, "")

    def cuda_hint(log_text: str) -> str:
        if gpu == "cuda" and "CUDA::cublas" in log_text:
            return (f"; CMake did not take cuBLAS from the wheel folder {cuda_libs.cache_folder()} "
                    f"(see dflash/native/cuda_libs.py)")
        return hint
    log(f"building llama.cpp ({flavor}, {LLAMA_CPP_COMMIT}) -> {dest} "
        f"({_BUILD_TIME.get(gpu, 'long')}, once)")
    _cmake_install(work, configure, "lib/libllama.so", dest, f"llama.cpp {flavor}", jobs, log, env, cuda_hint,
                   cache=gpu in ("none", "vulkan"))
    return library_dir(flavor, gpu)


def _build_variant(flavor: str, cpu: str, jobs: int | None, log: Log) -> Path:
    base = build_library(flavor, jobs=jobs, log=log).parent
    if shutil.which("cmake") is None:
        raise DflashError("cmake is not installed (apt-get install cmake)")
    from dflash.core.stage import stage
    stage(f"build of the {flavor} llama.cpp library's {cpu} CPU backend")
    with _work_tree(log) as work:
        if is_built(flavor, cpu=cpu):
            return library_dir(flavor, cpu=cpu)
        return _build_variant_in(flavor, cpu, base, work, jobs, log)


def _build_variant_in(flavor: str, cpu: str, base: Path, work: Path, jobs: int | None, log: Log) -> Path:
    dest = install_dir(flavor, cpu=cpu)
    src = Path(shutil.copytree(source_dir(log), work / "llama.cpp", symlinks=True,
                               ignore=shutil.ignore_patterns(".git")))
    configure = ["cmake", "-S", str(SOURCE_ROOT), "-B", str(work / "b"), f"-DDFLASH_LLAMA_SRC={src}",
                 f"-DDFLASH_LLAMA_FLAVOR={flavor}", f"-DDFLASH_LLAMA_PREFIX={work / 'install'}",
                 f"-DDFLASH_CPU_VARIANT={cpu}", "-DDFLASH_CPU_BACKEND_ONLY=ON", "-DDFLASH_GPU=none",
                 "-DDFLASH_BUILD_KERNELS=OFF"]

    def beside_native(staging: Path) -> None:
        """The native build's other files (libllama, libggml-base, libggml, libggml-rpc, headers)."""
        for f in sorted(base.rglob("*")):
            rel = f.relative_to(base)
            if f.name.startswith("libggml-cpu.so") or (staging / rel).exists() or (staging / rel).is_symlink():
                continue
            if f.is_dir() and not f.is_symlink():
                (staging / rel).mkdir(parents=True, exist_ok=True)
            else:
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, staging / rel, follow_symlinks=False)
        (staging / "dflash-variant.txt").write_text(f"cpu={cpu}\nflavor={flavor}\nbase={base.name}\n")
    log(f"building llama.cpp's CPU backend ({flavor}, {cpu}, {LLAMA_CPP_COMMIT}) -> {dest} "
        f"(about 1 minute on 2 cores, once)")
    _cmake_install(work, configure, "lib/libggml-cpu.so", dest, f"llama.cpp {flavor} {cpu}", jobs, log,
                   dict(os.environ), lambda text: "", complete=beside_native)
    return library_dir(flavor, cpu=cpu)


def build_server(jobs: int | None = None, log: Log = lambda s: None) -> Path:
    """Build llama-server (server/CMakeLists.txt) unless the keyed install exists; builds the exact
    library it links against first when that is missing. Returns the binary."""
    if server_built():
        return server_binary()
    lib = build_library("exact", jobs=jobs, log=log)
    if shutil.which("cmake") is None:
        raise DflashError("cmake is not installed (apt-get install cmake)")
    from dflash.core.stage import stage
    stage("build of llama-server")
    dest = server_dir()
    with _work_tree(log) as work:
        if server_built():
            return server_binary()
        src = Path(shutil.copytree(source_dir(log), work / "llama.cpp", symlinks=True,
                                   ignore=shutil.ignore_patterns(".git")))
        configure = ["cmake", "-S", str(SOURCE_ROOT / "server"), "-B", str(work / "b"), f"-DDFLASH_LLAMA_SRC={src}",
                     f"-DDFLASH_LLAMA_LIB={lib.parent}", f"-DDFLASH_SERVER_PREFIX={work / 'install'}"]
        log(f"building llama-server ({LLAMA_CPP_COMMIT}, against {lib.parent.name}) -> {dest} "
            f"(about 7 minutes on 2 cores, once)")
        _cmake_install(work, configure, "bin/llama-server", dest, "llama-server", jobs, log, dict(os.environ),
                       lambda text: "")
    return server_binary()


BUILD_TREE = "build-tree"  # under cache_root(): the one folder CPU builds and llama-server compile in
CCACHE_ENV = settings.ENV_CCACHE  # 0: compile without ccache even where it is installed


@contextlib.contextmanager
def _work_tree(log: Log) -> Iterator[Path]:
    """The build folder, emptied, held under an exclusive lock for the whole build. Every flavor,
    CPU variant and the server compile at the same absolute paths, so ccache can hand one build an
    object another compiled from the same bytes with the same flags (it hashes each source's and
    header's content, so a patched file is never served from an unpatched one). A second dflash
    build waits for the first."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another dflash build is running: waiting for it to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        work = root / BUILD_TREE
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)


def compiler_cache() -> str | None:
    """ccache's path when library builds use it: installed, and DFLASH_CCACHE is not 0."""
    return shutil.which("ccache") if settings.ccache_flag() else None


def ccache_dir() -> Path:
    """One ccache folder per host CPU and compiler (the native builds compile with -march=native,
    whose meaning ccache's key does not see): a cache carried to another machine never hands it
    objects built for other instructions."""
    host = hashlib.sha256(_host_fingerprint().encode()).hexdigest()[:16]
    return cache_root() / "ccache" / host


def _with_ccache(env: Mapping[str, str], stats: Path) -> dict[str, str]:
    """The build's environment for ccache. llama.cpp's ggml CMake (GGML_CCACHE, on by default)
    launches every compile of the library builds, ggml and llama alike, through a ccache it finds on
    PATH; dflash points it at ccache_dir() and a per-build stats log, or disables it
    (DFLASH_CCACHE=0). llama-server's build uses the installed ggml and compiles without it."""
    if compiler_cache() is None:
        return {**env, "CCACHE_DISABLE": "1"}
    return {**env, "CCACHE_DIR": str(ccache_dir()), "CCACHE_STATSLOG": str(stats)}


def _ccache_summary(stats: Path) -> str:
    """'ccache: H of N objects reused' from the build's stats log (ccache appends each compile's
    counters: a hit is counted once as direct_ or preprocessed_cache_hit, a miss as cache_miss)."""
    try:
        results = [ln.strip() for ln in stats.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    except OSError:
        return ""
    hits = sum(1 for r in results if r in ("direct_cache_hit", "preprocessed_cache_hit"))
    misses = sum(1 for r in results if r == "cache_miss")
    return f"ccache: {hits} of {hits + misses} objects reused from earlier builds" if hits + misses else ""


def _cmake_install(work: Path, configure: list[str], product: str, dest: Path, what: str, jobs: int | None,
                   log: Log, env: Mapping[str, str], hint: Callable[[str], str],
                   complete: Callable[[Path], None] | None = None, cache: bool = True) -> None:
    """Configure and build in `work` (its install folder: work/install; `complete` adds to it;
    through ccache when `cache` and compiler_cache()), then move the install to `dest` in one rename;
    a failed build keeps its log at <cache>/build-<what>-failed.log."""
    staging = work / "install"
    stats = work / "ccache-stats.log"
    if cache:
        env = _with_ccache(env, stats)
    build = ["cmake", "--build", str(work / "b"), "-j", str(jobs or os.cpu_count() or 2)]
    try:
        for cmd in (configure, build):
            rc = _run_logged(cmd, work / "build.log", log, progress=what if cmd is build else None, env=env)
            if rc != 0:
                keep = cache_root() / f"build-{what.replace(' ', '-')}-failed.log"
                shutil.copyfile(work / "build.log", keep)
                why = hint((work / "build.log").read_text(errors="replace"))
                raise DflashError(f"{what} build failed (rc={rc}){why}; log: {keep}")
        if not (staging / product).is_file():
            raise DflashError(f"{what} build produced no {Path(product).name}")
        if complete is not None:
            complete(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)  # atomic: a half-built tree never sits at the keyed path
        summary = _ccache_summary(stats)
        if summary:
            log(f"{what}: {summary}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- compile-only ggml-hip (no ROCm): `dflash build --gpu hip --compile-only` ----
# Every ggml-cuda source of the patched tree, compiled for each architecture by Debian's clang 19 in
# HIP mode against HIP 6.2 headers from the triton wheel and Debian's ROCm device libraries, linked
# into libggml-hip.so against ggml-base (real) and the project's link stubs for libamdhip64 and
# libhipblas (abort if called). Proves the patched backend compiles and links; it runs only where
# ROCm's real libraries replace the stubs. See hip_kernels/README.md, "Compiling ggml-hip without ROCm".

HIP_ARCHS = ("gfx1151", "gfx1201")
# what the compile-only build reads beyond the patch set (_hip_kernels_inputs): the link stubs and
# the stub hipBLAS header, its CMake project and the header it forces into softmax.cu, its flags,
# the ROCm-shaped root, the fetch script (which pins the triton wheel of the HIP headers)
_HIP_KEY_INPUTS = ("hip_kernels/stubs/include", "hip_kernels/stubs/src", "hip_kernels/ggml_hip/CMakeLists.txt",
                   "hip_kernels/ggml_hip/grid_sync_trap.h", "hip_kernels/cmake/ggml_hip_flags.cmake",
                   "hip_kernels/cmake/hip_root.cmake", "hip_kernels/tools/fetch_hip_headers.py")


def _hip_kernels_inputs() -> tuple[str, ...]:
    """The paths under hip_kernels/ that the patch set's application reads, relative to the checkout:
    apply_patch.cmake (cmake/llama.cmake's PATCH_COMMAND for the hip and cuda builds, also the
    compile-only build's first step), the patches it applies (patches/*.patch) and what it copies
    into ggml-cuda (every entry of ggml/, include/dflash_mmvq/*.h), picked as its globs pick them.
    Not the README, the tests or the code-object build: editing those rebuilds nothing."""
    k = SOURCE_ROOT / "hip_kernels"
    groups = ([k / "apply_patch.cmake"], sorted((k / "patches").glob("*.patch")), sorted((k / "ggml").glob("*")),
              sorted((k / "include" / "dflash_mmvq").glob("*.h")))
    return tuple(str(p.relative_to(SOURCE_ROOT)) for group in groups for p in group)


_DEVICE_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode", "/usr/lib/aarch64-linux-gnu/amdgcn/bitcode",
                    "/usr/lib/amdgcn/bitcode", "/opt/rocm/amdgcn/bitcode")
_APT_CLANG = "apt-get install clang-19 lld-19 llvm-19"


def _hip_tools() -> dict[str, str]:
    """clang 19 and the LLVM tools of the compile-only build, or a one-line error."""
    tools = {}
    for name in ("clang++-19", "clang-19", "llvm-as-19"):
        path = shutil.which(name)
        if path is None:
            raise DflashError(f"{name} is not installed ({_APT_CLANG}): the compile-only HIP build needs clang 19")
        tools[name] = path
    if shutil.which("cmake") is None:
        raise DflashError("cmake is not installed (apt-get install cmake)")
    return tools


def _device_libs() -> Path:
    for d in _DEVICE_LIB_DIRS:
        if (Path(d) / "ocml.bc").is_file() and (Path(d) / "ockl.bc").is_file():
            return Path(d)
    raise DflashError("ROCm device libraries (ocml.bc, ockl.bc) not found: apt-get install rocm-device-libs")


def hip_headers(log: Log = lambda s: None) -> Path:
    """HIP 6.2 headers from the pinned triton wheel (pip, once, into the user cache)."""
    script = SOURCE_ROOT / "hip_kernels" / "tools" / "fetch_hip_headers.py"
    cmd = [sys.executable, str(script), "--python", sys.executable, "--cache", str(cache_root())]
    r = subprocess.run(cmd, capture_output=True, text=True)
    include = Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    if include is None or not (include / "hip" / "hip_runtime.h").is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DflashError(f"HIP headers missing: {script.name} failed: {tail[0]}")
    return include


def hip_compile_key(archs: tuple[str, ...] = HIP_ARCHS) -> str:
    """Hash of every input of the compile-only ggml-hip build: the pinned source, the patch set and
    glue, stubs, vendored headers, build scripts, the headers' version (fetch script), the device
    libraries, the compiler and the architectures."""
    tools = _hip_tools()
    h = hashlib.sha256(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}|{','.join(archs)}|".encode())
    _hash_files(h, ("cmake/patch_set.cmake", *_hip_kernels_inputs(), *_HIP_KEY_INPUTS))
    for name in ("ocml.bc", "ockl.bc"):
        h.update(name.encode() + (_device_libs() / name).read_bytes())
    cc = subprocess.run([tools["clang++-19"], "--version"], capture_output=True, text=True).stdout
    h.update(cc.encode())
    return h.hexdigest()[:16]


# a compile or link step: ninja's "[n/N] Building ...", make's "[ NN%] Building ..." (not the outer
# ExternalProject steps, whose own percentages count its handful of steps)
_STEP = re.compile(r"^\[\s*(?:(\d+)/(\d+)|(\d+)%)\]\s+(?:Building|Linking)")


def _run_logged(cmd: list[str], logfile: Path, log: Log, progress: str | None = None,
                env: Mapping[str, str] | None = None) -> int:
    """Run cmd with its output appended to logfile; with `progress` (a label), report the build's
    steps (ninja's [n/N] or make's [ NN%]) every 5%."""
    with open(logfile, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        last = -5
        for line in proc.stdout:
            out.write(line)
            m = _STEP.match(line) if progress else None
            if m is None:
                continue
            pct = 100 * int(m[1]) // max(int(m[2]), 1) if m[1] else int(m[3])
            if pct >= last + 5:
                last = pct
                log(f"{progress}: {pct}% built" + (f" ({m[1]}/{m[2]} steps)" if m[1] else ""))
        return proc.wait()


def build_hip_compile_only(archs: tuple[str, ...] = HIP_ARCHS, jobs: int | None = None,
                           log: Log = lambda s: None) -> Path:
    """Compile the whole patched ggml-hip (every ggml-cuda source, each of archs) without ROCm and
    link libggml-hip.so against the stubs; returns the library. Cached under
    ~/.cache/dflash/ggml-hip/<key>/; an interrupted build resumes in its work folder."""
    tools = _hip_tools()
    device_libs = _device_libs()
    include = hip_headers(log)
    key = hip_compile_key(archs)
    root = cache_root() / "ggml-hip"
    dest = root / key
    library = dest / "lib" / "libggml-hip.so"
    if library.is_file():
        return library
    src = source_dir(log)
    work = root / f"work-{key}"
    work.mkdir(parents=True, exist_ok=True)
    logfile = work / "build.log"
    tree = work / "llama.cpp"
    if not (tree / ".dflash-patched").is_file():  # a private patched copy of what the build reads
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        shutil.copy2(src / "CMakeLists.txt", tree / "CMakeLists.txt")
        shutil.copytree(src / "ggml", tree / "ggml", symlinks=True)
        steps = [["cmake", f"-DSRC={tree}", f"-DPATCH_DIR={SOURCE_ROOT / 'hip_kernels'}",
                  "-P", str(SOURCE_ROOT / "hip_kernels" / "apply_patch.cmake")]]
    else:
        steps = []
    steps.append(["cmake", f"-DHEADERS={include}", f"-DDEVICE_LIBS={device_libs}", f"-DLLVM_AS={tools['llvm-as-19']}",
                  f"-DARCHS={','.join(archs)}", f"-DOUT={work / 'hip-root'}",
                  "-P", str(SOURCE_ROOT / "hip_kernels" / "cmake" / "hip_root.cmake")])
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    steps.append(["cmake", "-S", str(SOURCE_ROOT / "hip_kernels" / "ggml_hip"), "-B", str(work / "b"), *gen,
                  f"-DCMAKE_CXX_COMPILER={tools['clang++-19']}", f"-DCMAKE_C_COMPILER={tools['clang-19']}",
                  f"-DDFLASH_GGML={tree / 'ggml'}", f"-DDFLASH_HIP_ROOT={work / 'hip-root'}",
                  f"-DGPU_TARGETS={';'.join(archs)}", "-DCMAKE_BUILD_TYPE=Release"])
    log(f"compile-only ggml-hip for {', '.join(archs)} ({LLAMA_CPP_COMMIT}, no ROCm) -> {dest}; "
        f"about 145 sources per architecture: long, once (log: {logfile})")
    for cmd in steps:
        if _run_logged(cmd, logfile, log) != 0:
            raise DflashError(f"compile-only ggml-hip: {Path(cmd[-1]).name if cmd[-2] == '-P' else 'configure'} "
                              f"failed; log: {logfile}")
        if cmd[-1].endswith("apply_patch.cmake"):
            (tree / ".dflash-patched").write_text("ok\n")
    build = ["cmake", "--build", str(work / "b"), "-j", str(jobs or os.cpu_count() or 2)]
    if _run_logged(build, logfile, log, progress="ggml-hip") != 0:
        raise DflashError(f"compile-only ggml-hip build failed; log: {logfile}")
    staging = work / "out"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "lib").mkdir(parents=True)
    (staging / "stubs").mkdir()
    b = work / "b"
    for pattern, sub in (("lib/libggml-hip.so*", "lib"), ("ggml/src/libggml-base.so*", "lib"),
                         ("stubs/lib*.so*", "stubs")):
        for f in b.glob(pattern):
            shutil.copy2(f, staging / sub / f.name, follow_symlinks=False)
    if not (staging / "lib" / "libggml-hip.so").exists():
        raise DflashError(f"compile-only ggml-hip build produced no libggml-hip.so; log: {logfile}")
    shutil.copy2(logfile, staging / "build.log")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(staging, dest)  # atomic: a half-built tree never sits at the keyed path
    shutil.rmtree(work, ignore_errors=True)
    return library
