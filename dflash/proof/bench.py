"""A/B/A qualification of a band schedule against q1, with every request recorded.

Arms: q1 reference A, the candidate band schedule, q1 reference B. Each arm runs `warmup` then
`runs` cache-cold requests on the same prompt and context, in arm order (A..., C..., B...) or
interleaved (A C B, A C B, ...). What the timing window holds: the band loop of one request,
i.e. every llama_decode of the prompt plus copying and hashing its logits; not the memory clear
before it, nor the response decode after it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash.core import stats
from dflash.core.results import ArmStats, BenchResult, BenchSummary, Library
from dflash.proof import provenance
from dflash.proof.evidence import EvidenceWriter
from dflash.run import prefill
from dflash.run.engine import Engine

Q1_A, CANDIDATE, Q1_B = "q1_a", "candidate", "q1_b"
ARMS = (Q1_A, CANDIDATE, Q1_B)


@dataclass(frozen=True)
class Sample:
    arm: str
    index: int
    warmup: bool
    prefill_seconds: float
    tokens_per_second: float
    logits_sha256: str
    response_sha256: str
    response_tokens_sha256: str


def order(warmup: int, runs: int, interleave: bool) -> Iterator[tuple[str, int]]:
    if interleave:
        for i in range(warmup + runs):
            for arm in ARMS:
                yield arm, i
    else:
        for arm in ARMS:
            for i in range(warmup + runs):
                yield arm, i


def run(eng: Engine, tokens: list[int], *, warmup: int = 2, runs: int = 5,
        interleave: bool = False, n_predict: int = 8, logits: str = "all",
        progress: Callable[[int, int], None] = lambda d, t: None) -> tuple[list[Sample], dict]:
    """Run all requests; the candidate is the band plan at the engine's --chunk. Returns the
    samples and the per-arm widths."""
    n_ctx = eng.context_size(len(tokens), n_predict, None)
    schedules = {Q1_A: eng.request_bands(len(tokens), bands_on=False),
                 CANDIDATE: eng.request_bands(len(tokens), bands_on=True),
                 Q1_B: eng.request_bands(len(tokens), bands_on=False)}
    ctx = eng.context(n_ctx, max(b.width for b in schedules[CANDIDATE]))
    todo = list(order(warmup, runs, interleave))
    samples = []
    try:
        for k, (arm, i) in enumerate(todo):
            r = prefill.run(ctx, prefill.Request(tokens, schedules[arm], n_predict, logits), library=str(eng.lib_dir))
            samples.append(Sample(arm, i, i < warmup, r.prefill_seconds, r.prefill_tokens_per_second,
                                  r.logits_sha256, r.response_sha256, r.response_tokens_sha256))
            progress(k + 1, len(todo))
    finally:
        ctx.close()
    return samples, {arm: [b.width for b in s] for arm, s in schedules.items()}


def summarize(samples: list[Sample]) -> BenchSummary:
    measured = {arm: [s.tokens_per_second for s in samples if s.arm == arm and not s.warmup]
                for arm in ARMS}
    arms = []
    for arm in ARMS:
        st = stats.summarize(measured[arm])
        arms.append(ArmStats(arm, tuple(st["samples"]), st["median"], st["mad"], st["n"]))
    q1_pooled = stats.median(measured[Q1_A] + measured[Q1_B])
    cand = stats.median(measured[CANDIDATE])
    first = samples[0]
    return BenchSummary(
        arms=tuple(arms),
        q1_pooled_median=q1_pooled,
        gain_percent=stats.gain_percent(cand, q1_pooled),
        speedup=cand / q1_pooled,
        drift_percent=stats.drift_percent(stats.median(measured[Q1_A]), stats.median(measured[Q1_B])),
        response_hashes_identical=all(s.response_sha256 == first.response_sha256 for s in samples),
        logits_hashes_identical=all(s.logits_sha256 == first.logits_sha256 for s in samples),
        hashes_identical=all((s.response_sha256, s.logits_sha256) ==
                             (first.response_sha256, first.logits_sha256) for s in samples),
        response_sha256=first.response_sha256,
        logits_sha256=first.logits_sha256,
    )


def requests_record(samples: list[Sample]) -> dict:
    return {"requests": [asdict(s) for s in samples]}


def write_evidence(w: EvidenceWriter, provenance: dict[str, dict[str, Any]], options: dict[str, Any],
                   samples: list[Sample], widths: dict[str, list[int]],
                   summary: BenchSummary) -> tuple[Path, str]:
    """Fill an open EvidenceWriter and commit it; returns (dir, manifest sha256)."""
    for name, rec in provenance.items():
        w.write_json(name, rec)
    w.write_json("options.json", options)
    w.write_json("schedules.json", widths)
    w.write_json("requests.json", requests_record(samples))
    w.write_json("summary.json", summary.to_json())
    w.add_hash_check("requests.json", "requests", "response_sha256")
    w.add_hash_check("requests.json", "requests", "logits_sha256")
    return w.commit()


def bench(eng: Engine, text: str, tokens: list[int], writer: EvidenceWriter, *, warmup: int = 2, runs: int = 5,
          interleave: bool = False, n_predict: int = 8, logits: str = "all", device: str | None = None,
          progress: Callable[[int, int], None] = lambda d, t: None,
          memory_budget: dict[str, Any] | None = None) -> BenchResult:
    """Run the A/B/A requests, fill the open EvidenceWriter `writer` (provenance, options, every
    request, the summary) and commit it; the result names the evidence and its manifest SHA-256."""
    s = eng.settings
    samples, widths = run(eng, tokens, warmup=warmup, runs=runs, interleave=interleave, n_predict=n_predict,
                          logits=logits, progress=progress)
    summary = summarize(samples)
    options = {"chunk": s.chunk, "chunk_requested": s.chunk_requested,
               "band_mode": "fixed" if s.fixed else "planner", "warmup": warmup, "runs": runs,
               "interleave": interleave, "n_predict": n_predict, "logits": logits, "lib": s.lib,
               "threads": eng.threads, "n_prompt_tokens": len(tokens), "device": device,
               "memory_budget": memory_budget}
    path, manifest_sha = write_evidence(writer, provenance.provenance(eng, None, text, tokens), options, samples,
                                        widths, summary)
    return BenchResult(summary, len(tokens), eng.threads, Library(s.lib, str(eng.lib_dir), s.cpu), s.chunk, s.qualified,
                       str(path), manifest_sha, eng.placement, memory_budget)
