"""Provenance of a run, for evidence directories: what ran, on what, with which inputs."""
from __future__ import annotations

import hashlib
import os
import sys

from . import __version__, build, llama
from .build import REPO_ROOT
from .engine import Engine
from .evidence import git_revision, machine_facts, sha256_file
from .settings import ENV_BANDS, ENV_LIB_DIR, ENV_MMVQ


def library_identity() -> dict:
    return {"dir": str(llama.library_dir()), "llama_cpp_python": build.LLAMA_CPP_PYTHON_VERSION,
            "llama_cpp_commit": build.LLAMA_CPP_COMMIT,
            "files": {p.name: sha256_file(p) for p in llama.library_files()}}


def provenance(eng: Engine, argv: list[str] | None, prompt: str, tokens: list[int]) -> dict[str, dict]:
    """Records keyed by evidence file name (command.json, library.json, ...)."""
    from .prefill import sha256_tokens
    s = eng.settings
    return {
        "command.json": {"argv": list(sys.argv if argv is None else argv), "cwd": os.getcwd(),
                         "dflash_version": __version__, "git_revision": git_revision(REPO_ROOT)},
        "library.json": library_identity(),
        "model.json": {"path": eng.info.path, "sha256": sha256_file(eng.info.path),
                       "bytes": eng.info.file_size, "architecture": eng.info.architecture,
                       "compress_ratios": list(eng.info.compress_ratios),
                       "sliding_window": eng.info.sliding_window,
                       "weight_types": eng.info.weight_types},
        "prompt.json": {"text_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
                        "tokens_sha256": sha256_tokens(tokens), "n_tokens": len(tokens)},
        "settings.json": {"bands": s.bands, "chunk": s.chunk, "cap": s.cap, "lib": s.lib,
                          "mmvq_max_ncols": s.mmvq_max_ncols, "bands_from": s.bands_from,
                          "threads": eng.threads, "flash_attn": "off" if eng.exact else "auto",
                          "extra_buffer_types": not eng.exact,
                          "env": {k: os.environ[k] for k in (ENV_BANDS, ENV_MMVQ, ENV_LIB_DIR)
                                  if k in os.environ}},
        "machine.json": machine_facts(),
    }
