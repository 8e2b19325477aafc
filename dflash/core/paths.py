"""Where things are, and the pinned versions: the source checkout, the user cache, the
llama.cpp that dflash builds. Imports nothing from the rest of dflash."""
from __future__ import annotations

import os
from pathlib import Path

VERSION = "0.1.0"  # dflash.__version__

# The llama.cpp dflash builds: the one llama-cpp-python 0.3.36 vendors (its ctypes structs mirror
# exactly that commit's llama.h).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098"
FLAVORS = ("exact", "stock")  # the llama.cpp libraries: batch-invariant, and llama.cpp's defaults

REPO_ROOT = Path(__file__).resolve().parents[2]  # the source checkout (an editable install): dflash/core/../..

# What dflash builds llama.cpp from beside the pinned source: the CMake project, the patch sets, the
# kernels. A checkout has them at its root; a wheel carries the same files at the same relative
# paths under dflash/_source/ (setup.py), so both reach the same build keys.
SOURCE_ENTRIES = ("CMakeLists.txt", "cmake", "cpu_kernels", "hip_kernels", "vulkan_kernels", "rpc", "server")
PACKAGED_SOURCE = Path(__file__).resolve().parents[1] / "_source"


def _source_root() -> Path:
    if (REPO_ROOT / "CMakeLists.txt").is_file():
        return REPO_ROOT
    return PACKAGED_SOURCE  # an installed wheel (build.build_key names it when it is missing too)


SOURCE_ROOT = _source_root()


def cache_root() -> Path:
    """~/.cache/dflash, or $XDG_CACHE_HOME/dflash: built libraries, models, records."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash"
