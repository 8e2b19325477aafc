"""Run one prompt across configurations and compare their fingerprints.

Each configuration runs `dflash prefill --compare-q1 --json` in its own process (one llama.cpp
library per process), whose output is read back as a PrefillResult: CPU with 1 and 2 threads on
the exact and stock libraries, each HIP device, and a layer split across two HIP devices when
two are present. Rows that cannot run here are listed with the reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import devices
from .errors import DflashError
from .results import Library, MatrixResult, MatrixRow, PrefillResult, Skipped
from .settings import ENV_LIB_DIR


@dataclass(frozen=True)
class Config:
    name: str
    device: str
    threads: int
    lib: str


@dataclass(frozen=True)
class Row:
    """One configuration's process: its prefill result (with the q1 comparison), or why it has none."""
    config: Config
    result: PrefillResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


def configurations(threads=(1, 2), libs=("exact", "stock")) -> tuple[list[Config], list[Skipped]]:
    """(configs to run, skipped rows with reasons)."""
    cfgs = [Config(f"cpu t{t} {lib}", "cpu", t, lib) for lib in libs for t in threads]
    hip, reason = devices.hip_devices()
    skipped = []
    if hip:
        cfgs += [Config(f"{d.id} {d.arch}", d.id, threads[0], "exact") for d in hip]
    else:
        skipped.append(Skipped("hip:N (each GPU)", reason or ""))
    if len(hip) >= 2:
        cfgs.append(Config(f"hip:0+hip:1 layer split ({hip[0].arch}+{hip[1].arch})", "hip:0,hip:1",
                           threads[0], "exact"))
    else:
        skipped.append(Skipped("hip:0+hip:1 layer split",
                               f"needs two HIP devices, {len(hip)} present" + (f" ({reason})" if reason else "")))
    cuda, cuda_reason = devices.cuda_devices()  # the CUDA flavor (built on first use of cuda:N)
    if cuda:
        cfgs += [Config(f"{d.id} {d.arch}", d.id, threads[0], "exact") for d in cuda]
    else:
        skipped.append(Skipped("cuda:N (each GPU)", cuda_reason or ""))
    return cfgs, skipped


def run_config(cfg: Config, passthrough: list[str]) -> Row:
    cmd = [sys.executable, "-m", "dflash", "prefill", "--compare-q1", "--json", "--bands",
           "--lib", cfg.lib, "--threads", str(cfg.threads), "--device", cfg.device, *passthrough]
    # DFLASH_LLAMA_LIB_DIR (e.g. a HIP build) stands for the exact library only
    drop = {"LLAMA_CPP_LIB_PATH"} | ({ENV_LIB_DIR} if cfg.lib != "exact" else set())
    env = {k: v for k, v in os.environ.items() if k not in drop}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if not r.stdout.strip():  # it failed before printing: its one-line error says why
        return Row(cfg, error=(r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1])
    try:
        result = PrefillResult.from_json(r.stdout, f"{cfg.name}: prefill output")
    except DflashError as e:
        return Row(cfg, error=str(e))
    if result.comparison is None:
        return Row(cfg, error=f"{cfg.name}: prefill output has no q1 comparison")
    return Row(cfg, result)


def compare(rows: Sequence[Row], skipped: Sequence[Skipped] = ()) -> MatrixResult:
    """Equality of every row's q1 and band hashes against the first exact row's q1 run."""
    ran = [r for r in rows if r.result is not None]
    ref = next((r for r in ran if r.config.lib == "exact"), ran[0] if ran else None)
    if ref is None or ref.result is None or ref.result.comparison is None:
        first = next((r.error for r in rows if r.error), None)
        raise DflashError("no configuration ran" + (f": {first}" if first else ""))
    ref_q1 = ref.result.comparison.q1
    out = []
    for r in rows:
        c = r.config
        res = r.result
        if res is None or res.comparison is None:
            out.append(MatrixRow(c.name, c.device, c.threads, c.lib, Library(c.lib, None),
                                 error=r.error or "no result"))
            continue
        q1 = res.comparison.q1
        out.append(MatrixRow(
            c.name, c.device, c.threads, c.lib, res.library,
            q1_logits_sha256=q1.logits_sha256, q1_response_sha256=q1.response_sha256,
            logits_sha256=res.logits_sha256, response_sha256=res.response_sha256,
            q1_equals_bands=res.comparison.identical,
            logits_equal_reference=q1.logits_sha256 == ref_q1.logits_sha256 == res.logits_sha256,
            response_equal_reference=q1.response_sha256 == ref_q1.response_sha256 == res.response_sha256))
    return MatrixResult(ref.config.name, tuple(out), tuple(skipped))


def run(n_predict: int, chunk: int | str, model: str | None = None, prompt: str | None = None,
        progress: Callable[[int, int], None] = lambda done, total: None) -> MatrixResult:
    """Every configuration that can run here, one process each, on the same prompt (`prompt`, or
    the built-in one) and model, compared (see compare)."""
    passthrough = ["--chunk", str(chunk), "--n-predict", str(n_predict)]
    if model:
        passthrough += ["--model", model]
    cfgs, skipped = configurations()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dflash-matrix-") as tmp:
        if prompt is not None:  # every row reads the same prompt, whatever --prompt-file was
            prompt_path = Path(tmp) / "prompt.txt"
            prompt_path.write_text(prompt, encoding="utf-8")
            passthrough += ["--prompt-file", str(prompt_path)]
        for i, cfg in enumerate(cfgs):
            rows.append(run_config(cfg, passthrough))
            progress(i + 1, len(cfgs))
    return compare(rows, skipped)
