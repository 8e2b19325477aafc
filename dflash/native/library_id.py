"""Which llama.cpp library a run loads, named without loading it: its folder, its key (the build key
of flavor, GPU backend and CPU variant, or the hash of a DFLASH_LLAMA_LIB_DIR folder, widened by the
flags that change its graph or kernels), the build id RPC peers compare, and the CPU buffer types it
offers (asked of the loaded library, or of a probe process). Qualification and serve records key on
these; the engine and `dflash rpc-server` name their builds with them."""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from dflash.core.cpu_isa import NATIVE, refuse_unrunnable
from dflash.core.errors import DflashError, UsageError
from dflash.core.fileio import sha256_file
from dflash.core.settings import ENV_LIB_DIR, Settings, tile_text
from dflash.native import build, llama


class RuntimeUnknown(DflashError):
    """Which CPU buffer types the run's library offers cannot be learned (not built, probe failed)."""


def library_files(d: Path) -> list[Path]:
    """libllama*/libggml* shared libraries of a folder (as dflash.native.llama.library_files picks them)."""
    return sorted(p for p in d.iterdir() if p.name.startswith(("libllama", "libggml")) and ".so" in p.name
                  and p.is_file() and not p.is_symlink())


def dir_key(d: Path) -> str:
    """SHA-256 over the names and bytes of a library folder's libllama*/libggml* files."""
    if not (d / "libllama.so").is_file():
        raise UsageError(f"{ENV_LIB_DIR}={d} has no libllama.so")
    h = hashlib.sha256()
    for p in library_files(d):
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def library_key(settings: Settings, kind: str = "cpu") -> tuple[str, str]:
    """(source, key) of the library a run loads: "build" and dflash.native.build.build_key of the flavor,
    GPU backend and CPU variant, or "dir" and dir_key of DFLASH_LLAMA_LIB_DIR. On HIP and CUDA the
    key also covers the narrow-MMVQ routing flags (they decide which kernels run there)."""
    if settings.lib_dir:
        source, key = "dir", dir_key(Path(settings.lib_dir))
    else:  # a GPU run loads that backend's build of the flavor (its CPU backend is the native one)
        gpu = "none" if kind == "cpu" else kind
        source, key = "build", build.build_key(settings.lib, gpu, cpu_variant(settings, kind))
    if kind in ("hip", "cuda"):  # the narrow-MMVQ routing flags decide which kernels run there: part of
        # the key (ggml-vulkan reads neither; its routing switches are kernel switches, see graph_switches)
        routing = f"{key}|narrow={int(settings.narrow)}|ncols={settings.mmvq_max_ncols}"
        key = hashlib.sha256(routing.encode()).hexdigest()[:16]
    if settings.indexer_shortcut != "on":  # another graph (off), or a planted bug (force): not vouched for
        key = hashlib.sha256(f"{key}|indexer_shortcut={settings.indexer_shortcut}".encode()).hexdigest()[:16]
    tile = getattr(settings, "indexer_tile", 0)
    if tile:  # another graph: a record proves the tile it ran (a planted one proves nothing else)
        text = tile_text(tile, getattr(settings, "indexer_tile_plant", False))
        key = hashlib.sha256(f"{key}|indexer_tile={text}".encode()).hexdigest()[:16]
    window = getattr(settings, "raw_window", "on")
    if window != "on":  # the whole raw cache (off), or a planted bug: not what the default run does
        key = hashlib.sha256(f"{key}|raw_window={window}".encode()).hexdigest()[:16]
    return source, key


def cpu_variant(settings: Settings, kind: str = "cpu") -> str:
    """The CPU build variant a run loads (--cpu; a GPU build and DFLASH_LLAMA_LIB_DIR: native)."""
    cpu = getattr(settings, "cpu", NATIVE)
    return cpu if kind == "cpu" and not settings.lib_dir else NATIVE


def run_library_dir(settings: Settings, kind: str = "cpu") -> Path:
    """The library folder a run loads (as dflash.run.engine.library_dir picks it, without building)."""
    if settings.lib_dir:
        return Path(settings.lib_dir)
    return build.library_dir(settings.lib, "none" if kind == "cpu" else kind, cpu_variant(settings, kind))


def offered_buffer_types(settings: Settings, kind: str = "cpu") -> tuple[str, ...]:
    """The CPU extra buffer types the run's library offers: asked in this process when it loaded that
    library, else in a probe process (llama.probe_cpu_extra_buffer_types) with the environment the
    run will have. RuntimeUnknown when the library is not built, or the probe fails."""
    d = run_library_dir(settings, kind)
    refuse_unrunnable(cpu_variant(settings, kind))  # its probe would die of an illegal instruction
    if not (d / "libllama.so").is_file():
        raise RuntimeUnknown(f"the library {d} is not built yet: which CPU buffer types it offers is not known")
    loaded = llama.library_dir()
    if loaded is not None and loaded == d.resolve():
        return llama.cpu_extra_buffer_types()
    env = {**os.environ, **settings.library_env()}
    return _probed(str(d.resolve()), tuple(sorted(env.items())))


@functools.lru_cache(maxsize=8)
def _probed(lib_dir: str, env: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    try:
        return llama.probe_cpu_extra_buffer_types(lib_dir, dict(env))
    except DflashError as e:
        raise RuntimeUnknown(str(e)) from None


def build_id(settings: Settings, kind: str = "cpu") -> str:
    """The library build a process runs, as `dflash rpc-server` reports it and an RPC client compares
    it: "exact-<build key>" (the folder name under ~/.cache/dflash/llama/ on the CPU), or
    "exact-dir-<16 hex>" for DFLASH_LLAMA_LIB_DIR."""
    source, key = library_key(settings, kind)
    return f"{settings.lib}-{key}" if source == "build" else f"{settings.lib}-dir-{key[:16]}"
