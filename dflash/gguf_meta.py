"""Model facts from GGUF metadata, read with the `gguf` package without loading weights."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelError

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


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelError(f"model path is a directory, not a GGUF file: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"model file is empty: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic {magic!r}): {path}")


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def read(path: str | os.PathLike) -> ModelInfo:
    """Parse the header; every failure becomes a one-line ModelError naming the file."""
    from gguf import GGUFReader

    path = Path(path)
    _check_file(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf reader raises ValueError/IndexError/struct errors on bad bytes
        raise ModelError(f"corrupt or truncated GGUF {path}: {type(e).__name__}: {e}".splitlines()[0]) from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"truncated GGUF {path}: tensor {t.name} ends past the end of the file")
    arch = _field(reader, "general.architecture")
    if not arch:
        raise ModelError(f"GGUF has no general.architecture: {path}")

    def get(key):
        return _field(reader, f"{arch}.{key}")

    if _field(reader, "tokenizer.ggml.model") in ("none", "no_vocab"):
        raise ModelError(f"{path} has no vocabulary (tokenizer model 'none'): it cannot tokenize a prompt")
    ratios = get("attention.compress_ratios") or []
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
    return ModelInfo(
        path=str(path), file_size=size, architecture=str(arch), name=_field(reader, "general.name"),
        n_layers=get("block_count"), compress_ratios=tuple(int(r) for r in ratios),
        sliding_window=get("attention.sliding_window"), context_length=get("context_length"),
        vocab_size=vocab,
        weight_types=dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())),
    )
