"""Typed errors of the library. Each speaks of the library's arguments (`chunk`, `model`); the
CLI shows the same text with its flags (`--chunk`, `--model`) and maps the type to an exit code.

    DflashError        a runtime failure the caller can act on                     exit 1
      UsageError       bad input: an argument, an environment value, a file        exit 2
      ModelError       the model file is missing, unreadable or not a usable GGUF  exit 1
      LlamaError       llama.cpp refused or failed: load, context, decode          exit 1
      LibraryNotBuilt  the llama.cpp library is not built yet (`dflash build`)     exit 1
      NotExactError    an exactness check failed: results differ bit for bit       exit 4
      NoDeviceError    no GPU runtime or device is present                         exit 3

A message names an argument with `arg("chunk")`: `str(error)` reads "chunk 7 is out of range",
`error.render(flag)` lets the CLI say "--chunk 7 is out of range".
"""
from __future__ import annotations

import re
from collections.abc import Callable

_MARK = "\x1f"
_ARG = re.compile(f"{_MARK}([A-Za-z_][A-Za-z0-9_]*){_MARK}")


def arg(name: str) -> str:
    """An argument's name inside an error message (see the module doc)."""
    return f"{_MARK}{name}{_MARK}"


def cli_flag(name: str) -> str:
    """The CLI's flag for a library argument: resume_at -> --resume-at."""
    return "--" + name.replace("_", "-")


class DflashError(Exception):
    """A runtime failure the user can act on (exit code 1; a subclass or `exit_code=` may say
    otherwise, e.g. a model path that names no file is bad input: 2)."""

    exit_code = 1

    def __init__(self, *args: object, exit_code: int | None = None):
        self.template = str(args[0]) if args else ""
        super().__init__(*((_ARG.sub(r"\1", self.template), *args[1:]) if args else ()))
        if exit_code is not None:
            self.exit_code = exit_code

    def render(self, name: Callable[[str], str] = cli_flag) -> str:
        """The message with every argument named by `name` (the CLI's flags by default)."""
        return _ARG.sub(lambda m: name(m.group(1)), self.template)


class UsageError(DflashError):
    """Bad input: an argument, an environment value or a file (exit code 2)."""

    exit_code = 2


class ModelError(DflashError):
    """The model file is missing, unreadable or not a usable GGUF."""


class LlamaError(DflashError):
    """llama.cpp refused or failed: load, context creation, decode; also non-finite logits."""


class LibraryNotBuilt(DflashError):
    """The llama.cpp library a Session needs is not built: `dflash build` (or Session(build=True))
    builds it."""


class NotExactError(DflashError):
    """An exactness check failed: a band schedule, width or configuration that must be
    bit-identical to its reference is not (exit code 4, apart from runtime errors)."""

    exit_code = 4


class NoDeviceError(DflashError):
    """No GPU runtime or device is present (exit code 3)."""

    exit_code = 3
