"""dflash: exact, faster prefill for llama.cpp models.

The public API (loaded on first use, so `import dflash` stays light for the CLI's parent):

    Session          one model, library and device; prefill, generate, qualify, bench, memory
    Settings         the resolved flags and options (Settings.from_env() reads the environment)
    Token            one generated token (Session.generate)
    PrefillResult, BenchResult, QualifyResult, MemoryResult   typed results, one to_json() each
    Worker           a Session in a supervised child process (one library per process)
    DflashError, UsageError, ModelError, LlamaError, LibraryNotBuilt, NotExactError, NoDeviceError
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .core.paths import VERSION as __version__

_PUBLIC = {
    "Session": "session", "Token": "session", "Settings": "core.settings", "Worker": "worker",
    "PrefillResult": "core.results", "BenchResult": "core.results", "QualifyResult": "core.results",
    "MemoryResult": "core.results", "DflashError": "core.errors", "UsageError": "core.errors",
    "ModelError": "core.errors", "LlamaError": "core.errors", "LibraryNotBuilt": "core.errors",
    "NotExactError": "core.errors", "NoDeviceError": "core.errors",
}
__all__ = ["__version__", "Session", "Token", "Settings", "Worker", "PrefillResult", "BenchResult", "QualifyResult",
           "MemoryResult", "DflashError", "UsageError", "ModelError", "LlamaError", "LibraryNotBuilt", "NotExactError",
           "NoDeviceError"]

if TYPE_CHECKING:
    from .core.errors import (
        DflashError,
        LibraryNotBuilt,
        LlamaError,
        ModelError,
        NoDeviceError,
        NotExactError,
        UsageError,
    )
    from .core.results import BenchResult, MemoryResult, PrefillResult, QualifyResult
    from .core.settings import Settings
    from .session import Session, Token
    from .worker import Worker


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
