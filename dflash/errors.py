"""Domain errors. The CLI turns them into one-line messages and exit codes at its edge."""
from __future__ import annotations


class DflashError(Exception):
    """A runtime failure the user can act on (exit code 1; a subclass or `exit_code=` may say
    otherwise, e.g. a model path that names no file is bad input: 2)."""

    exit_code = 1

    def __init__(self, *args: object, exit_code: int | None = None):
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(DflashError):
    """Bad input: a flag, an environment value or an argument (exit code 2)."""

    exit_code = 2


class ModelError(DflashError):
    """The model file is missing, unreadable or not a usable GGUF."""


class LlamaError(DflashError):
    """llama.cpp refused or failed: load, context creation, decode."""


class NoDeviceError(DflashError):
    """No GPU runtime or device is present (exit code 3)."""

    exit_code = 3
