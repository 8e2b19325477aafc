"""Model facts from GGUF metadata, read with the `gguf` package without loading weights."""
from __future__ import annotations

import errno
import os
import stat
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.core.errors import ModelError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    path: str
    file_size: int
    architecture: str
    name: str | None
    n_layers: int | None
    compress_ratios: tuple[int, ...]  # one per layer; () when the model has no compressors
    sliding_window: int | None
    context_length: int | None
    vocab_size: int | None
    weight_types: dict[str, int] = field(default_factory=dict)  # GGML type name -> tensor count
    # the same over the tensors a matrix product can use as weights: at least 2 dimensions, not
    # the token embedding table (read by GET_ROWS) and not an integer table (hash routing ids)
    matrix_types: dict[str, int] = field(default_factory=dict)
    nextn_layers: int = 0  # next-n (multi-token prediction) layers after the main ones: what --spec mtp drafts with


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def path_problem(path: Path) -> str | None:
    """Why `path` cannot be read as an input file ('not found', 'is a FIFO', ...), or None for a
    regular file. Nothing is opened: a FIFO or a device is refused before it can block or stream."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "not found"
        return f"cannot be read ({e.strerror})"
    for test, kind in _KINDS:
        if test(st.st_mode):
            return f"is {kind}, not a regular file"
    return None


def _check_file(path: Path) -> None:
    problem = path_problem(path)
    if problem:
        raise ModelError(f"model file {problem}: {path}", exit_code=2)
    if path.stat().st_size == 0:
        raise ModelError(f"model file is empty: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic {magic!r}): {path}")


DS4_ARCH = "deepseek4"
DS4_RATIOS = (0, 4, 128)  # the compressor ratios this llama.cpp's deepseek4 graph and cache implement


def _check_ds4_ratios(path: Path, ratios: list[int], n_layers: object) -> None:
    """Refuse what llama.cpp would crash on (SIGFPE without a ratio-4 layer) or misread."""
    if not ratios:
        return  # llama.cpp's loader requires the key and names it
    if isinstance(n_layers, int) and len(ratios) != n_layers:
        raise ModelError(f"{path}: {len(ratios)} compress ratios for {n_layers} layers")
    bad = sorted({r for r in ratios if r not in DS4_RATIOS})
    if bad:
        raise ModelError(f"{path}: compress ratio(s) {', '.join(map(str, bad))} are not supported by "
                         f"llama.cpp's deepseek4 (0, 4 or 128 only)")
    if 4 not in ratios:
        raise ModelError(f"{path}: no layer has compress ratio 4 (ratios {','.join(map(str, ratios))}); "
                         "llama.cpp's deepseek4 cannot run such a model (it divides by zero)")


# What gguf's reader raises on bad bytes: a wrong magic or version (ValueError), a short read
# (ValueError from numpy's memmap or reshape, IndexError, struct.error), a huge length (MemoryError,
# OverflowError), a field of the wrong type (KeyError, TypeError), bad UTF-8 in a string.
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, struct.error,
                  UnicodeDecodeError, OSError)


NOT_MATRIX_NAMES = ("token_embd.weight",)
INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def _is_matrix(t: ReaderTensor) -> bool:
    return (len(t.shape) >= 2 and t.name not in NOT_MATRIX_NAMES and t.tensor_type.name not in INTEGER_TYPES)


def _field(reader: GGUFReader, key: str) -> Any:  # a GGUF value: str, int, float, bool or a list
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def read(path: str | os.PathLike[str]) -> ModelInfo:
    """Parse the header; every failure becomes a one-line ModelError naming the file."""
    path = Path(path)
    _check_file(path)
    try:
        return _read(path)
    except _READER_ERRORS as e:  # the reader or a field's contents on bad bytes
        raise ModelError(f"corrupt or truncated GGUF {path}: {type(e).__name__}: {e}".splitlines()[0]) from None


def _read(path: Path) -> ModelInfo:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"truncated GGUF {path}: tensor {t.name} ends past the end of the file")
    arch = _field(reader, "general.architecture")
    if not arch:
        raise ModelError(f"GGUF has no general.architecture: {path}")

    def get(key: str) -> Any:
        return _field(reader, f"{arch}.{key}")

    if _field(reader, "tokenizer.ggml.model") in ("none", "no_vocab"):
        raise ModelError(f"{path} has no vocabulary (tokenizer model 'none'): it cannot tokenize a prompt")
    ratios = get("attention.compress_ratios") or []
    if arch == DS4_ARCH:
        _check_ds4_ratios(path, [int(r) for r in ratios], get("block_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
    return ModelInfo(
        path=str(path), file_size=size, architecture=str(arch), name=_field(reader, "general.name"),
        n_layers=get("block_count"), compress_ratios=tuple(int(r) for r in ratios),
        sliding_window=get("attention.sliding_window"), context_length=get("context_length"),
        vocab_size=vocab,
        weight_types=dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())),
        matrix_types=dict(sorted(Counter(t.tensor_type.name for t in reader.tensors if _is_matrix(t)).items())),
        nextn_layers=int(get("nextn_predict_layers") or 0),
    )


def has_chat_template(path: str | os.PathLike[str]) -> bool:
    """Whether the GGUF carries a chat template (tokenizer.chat_template), as llama-server applies it."""
    from gguf import GGUFReader
    try:
        return bool(_field(GGUFReader(Path(path)), "tokenizer.chat_template"))
    except _READER_ERRORS as e:
        raise ModelError(f"corrupt or truncated GGUF {path}: {type(e).__name__}: {e}".splitlines()[0]) from None
