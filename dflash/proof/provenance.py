"""Provenance of a run, for evidence directories: what ran, on what, with which inputs."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.core import paths
from dflash.core.fileio import sha256_file
from dflash.core.paths import REPO_ROOT
from dflash.core.paths import VERSION as __version__
from dflash.core.sha_cache import file_sha256
from dflash.native import llama
from dflash.native.devices import cpu_model
from dflash.proof.evidence import default_dir

if TYPE_CHECKING:
    from dflash.run.engine import Engine


def machine_facts() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, logical cores, platform, Python."""
    return {"cpu_model": cpu_model(), "logical_cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}


def git_revision(repo_root: str | os.PathLike[str]) -> str | None:
    """HEAD's commit, plus "-dirty" when `git status --porcelain` lists anything; None if unknown."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True, text=True,
                               timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
        return p.stdout if p.returncode == 0 else None

    head = git("rev-parse", "--verify", "HEAD")
    if not head or not head.strip():
        return None
    status = git("status", "--porcelain")
    return head.strip() + ("-dirty" if status is None or status.strip() else "")


def default_evidence_dir(kind: str) -> Path:
    """A new evidence/runs/<kind>-<time>-<id> under the checkout, or under the working directory
    when dflash runs from an installed package."""
    root = REPO_ROOT if (REPO_ROOT / "evidence").is_dir() else Path.cwd()
    return default_dir(root / "evidence" / "runs", kind)


def library_identity() -> dict[str, Any]:
    return {"dir": str(llama.library_dir()), "llama_cpp_python": paths.LLAMA_CPP_PYTHON_VERSION,
            "llama_cpp_commit": paths.LLAMA_CPP_COMMIT,
            "files": {p.name: sha256_file(p) for p in llama.library_files()}}


def provenance(eng: Engine, argv: list[str] | None, prompt: str, tokens: list[int]) -> dict[str, dict[str, Any]]:
    """Records keyed by evidence file name (command.json, library.json, ...)."""
    from dflash.run.prefill import sha256_tokens
    s = eng.settings
    return {
        "command.json": {"argv": list(sys.argv if argv is None else argv), "cwd": os.getcwd(),
                         "dflash_version": __version__, "git_revision": git_revision(REPO_ROOT)},
        "library.json": library_identity(),
        "model.json": {"path": eng.info.path, "sha256": file_sha256(eng.info.path),
                       "bytes": eng.info.file_size, "architecture": eng.info.architecture,
                       "compress_ratios": list(eng.info.compress_ratios),
                       "sliding_window": eng.info.sliding_window,
                       "weight_types": eng.info.weight_types},
        "prompt.json": {"text_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
                        "tokens_sha256": sha256_tokens(tokens), "n_tokens": len(tokens)},
        "settings.json": {"bands": s.bands, "chunk": s.chunk, "cap": s.cap, "lib": s.lib, "cpu": s.cpu,
                          "chunk_requested": s.chunk_requested, "band_mode": "fixed" if s.fixed else "planner",
                          "qualification": s.qualified.to_json() if s.qualified else None,
                          "mmvq_max_ncols": s.mmvq_max_ncols, "bands_from": s.bands_from,
                          "threads": eng.threads,
                          "flash_attn": {None: "auto", True: "on", False: "off"}[eng.flash_attn],
                          "extra_buffer_types": eng.repack,
                          "indexer_shortcut": {"mode": s.indexer_shortcut, "applied": eng.indexer_shortcut},
                          "indexer_tile": {"requested": s.indexer_tile, "planted": s.indexer_tile_plant,
                                           "applied": eng.indexer_tile},
                          "raw_window": s.raw_window,
                          "mmvq_from": s.mmvq_from, "env_as_given": dict(s.env_raw),
                          "env_exported": s.library_env()},
        "machine.json": machine_facts(),
        "devices.json": {"device": eng.device, "devices": [dict(d) for d in eng.placement],
                         "rpc_servers": [srv.to_json() for srv in eng.remote.servers] if eng.remote else [],
                         "allow_mixed_builds": bool(eng.remote and eng.remote.allow_mixed_builds)},
    }
