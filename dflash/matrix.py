"""Run one prompt across configurations and compare their fingerprints.

Each configuration runs `dflash prefill --compare-q1 --json` in its own process (one llama.cpp
library per process): CPU with 1 and 2 threads on the exact and stock libraries, each HIP
device, and a layer split across two HIP devices when two are present. Rows that cannot run
here are listed with the reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from . import devices as D
from .errors import DflashError
from .settings import ENV_LIB_DIR


@dataclass
class Config:
    name: str
    device: str
    threads: int
    lib: str


@dataclass
class Row:
    config: Config
    ok: bool
    data: dict = field(default_factory=dict)
    error: str | None = None


def configurations(threads=(1, 2), libs=("exact", "stock")) -> tuple[list[Config], list[dict]]:
    """(configs to run, skipped rows with reasons)."""
    cfgs = [Config(f"cpu t{t} {lib}", "cpu", t, lib) for lib in libs for t in threads]
    hip, reason = D.hip_devices()
    skipped = []
    if hip:
        cfgs += [Config(f"{d.id} {d.arch}", d.id, threads[0], "exact") for d in hip]
    else:
        skipped.append({"config": "hip:N (each GPU)", "reason": reason})
    if len(hip) >= 2:
        cfgs.append(Config(f"hip:0+hip:1 layer split ({hip[0].arch}+{hip[1].arch})", "hip:0,hip:1",
                           threads[0], "exact"))
    else:
        skipped.append({"config": "hip:0+hip:1 layer split",
                        "reason": f"needs two HIP devices, {len(hip)} present" + (f" ({reason})" if reason else "")})
    return cfgs, skipped


def run_config(cfg: Config, passthrough: list[str]) -> Row:
    cmd = [sys.executable, "-m", "dflash", "prefill", "--compare-q1", "--json", "--bands",
           "--lib", cfg.lib, "--threads", str(cfg.threads), "--device", cfg.device, *passthrough]
    # DFLASH_LLAMA_LIB_DIR (e.g. a HIP build) stands for the exact library only
    drop = {"LLAMA_CPP_LIB_PATH"} | ({ENV_LIB_DIR} if cfg.lib != "exact" else set())
    env = {k: v for k, v in os.environ.items() if k not in drop}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        data = json.loads(r.stdout) if r.stdout.strip() else {}
    except json.JSONDecodeError:
        data = {}
    if not data:
        return Row(cfg, False, error=(r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1])
    return Row(cfg, True, data)


def compare(rows: list[Row]) -> dict:
    """Equality of every row's q1 and band hashes against the first exact row's q1 run."""
    ran = [r for r in rows if r.ok]
    ref = next((r for r in ran if r.config.lib == "exact"), ran[0] if ran else None)
    if ref is None:
        raise DflashError("no configuration ran")
    ref_logits, ref_resp = ref.data["q1"]["logits_sha256"], ref.data["q1"]["response_sha256"]
    out = []
    for r in rows:
        d = {"config": r.config.name, "device": r.config.device, "threads": r.config.threads,
             "lib": r.config.lib, "ran": r.ok, "error": r.error}
        if r.ok:
            q1, b = r.data["q1"], r.data
            d.update(q1_logits_sha256=q1["logits_sha256"], q1_response_sha256=q1["response_sha256"],
                     logits_sha256=b["logits_sha256"], response_sha256=b["response_sha256"],
                     q1_equals_bands=bool(b["identical_to_q1"]),
                     logits_equal_reference=q1["logits_sha256"] == ref_logits == b["logits_sha256"],
                     response_equal_reference=q1["response_sha256"] == ref_resp == b["response_sha256"])
        out.append(d)
    exact = [d for d in out if d["lib"] == "exact"]
    return {"reference": ref.config.name, "rows": out,
            "exact_all_equal": all(d["ran"] and d["logits_equal_reference"] and d["response_equal_reference"]
                                   for d in exact)}
