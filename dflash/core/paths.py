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


def cache_root() -> Path:
    """~/.cache/dflash, or $XDG_CACHE_HOME/dflash: built libraries, models, records."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash"
