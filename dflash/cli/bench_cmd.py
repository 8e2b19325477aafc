"""`dflash bench`: A/B/A benchmark of the band schedule against q1, written as evidence."""
from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from .. import bench, engine, evidence, records
from ..errors import DflashError
from ..results import BenchResult
from . import output
from .options import (
    Command,
    budgeted_settings,
    chunk_option,
    connect_remote,
    device_option,
    lib_option,
    memory_budget_option,
    model_option,
    prompt_options,
    threads_option,
)


@click.command("bench", cls=Command)
@model_option
@prompt_options
@chunk_option
@threads_option
@lib_option
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Warm-up requests per arm.")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Measured requests per arm.")
@click.option("--interleave", is_flag=True, help="Alternate A, candidate, B per request instead of arm after arm.")
@click.option("--n-predict", type=click.IntRange(min=0), default=8, show_default=True)
@click.option("--logits", "logits_mode", type=click.Choice(["all", "last"]), default="all", show_default=True)
@device_option
@memory_budget_option
@click.option("--evidence", "evidence_dir", default=None,
              help="Evidence directory to create [default: evidence/runs/bench-<time>-<id>].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model, weights, prompt, prompt_file, chunk, threads, lib, warmup, runs, interleave,
            n_predict, logits_mode, device, rpc, allow_mixed_builds, no_repack, memory_budget, evidence_dir, as_json):
    """A/B/A: q1, the band schedule, q1 again; medians, MAD, gain, drift, hash equality.

    Exits 1 (after writing the evidence) when any request's response or logits hash differs."""
    # the candidate arm is a band schedule whatever the env says
    remote = connect_remote(device, rpc, allow_mixed_builds)
    text = engine.read_prompt(prompt, prompt_file)
    s, budget_json = budgeted_settings(memory_budget, text, True, chunk, lib, model=model, weights=weights,
                                       device=device, remote=remote, repack=not no_repack, threads=threads,
                                       n_predict=n_predict, ctx=None)
    dest = Path(evidence_dir) if evidence_dir else records.default_evidence_dir("bench")
    for w in s.warnings():
        output.warn(w)
    eng = engine.open_engine(s, model, threads=threads, weights=weights, device=device, remote=remote,
                             repack=not no_repack, log=output.note)
    tokens = eng.tokenize(text)
    with evidence.EvidenceWriter(dest, "bench") as writer:  # a bad --evidence fails before the runs
        with output.progress_bar("bench") as progress:
            result = bench.bench(eng, text, tokens, writer, warmup=warmup, runs=runs, interleave=interleave,
                                 n_predict=n_predict, logits=logits_mode, device=device, progress=progress,
                                 memory_budget=budget_json)
    if as_json:
        output.emit_json(result.to_json())
    else:
        show(result)
    if not result.summary.hashes_identical:
        raise DflashError(f"hashes differ between requests: the candidate is not exact "
                          f"(evidence {result.evidence_dir})")


def show(r: BenchResult) -> None:
    t = Table("arm", "median tok/s", "MAD", "n", title=f"A/B/A prefill, {r.n_prompt_tokens} tokens, "
              f"{r.threads} threads, {r.library.flavor} library, {output.describe_devices(r.devices)}")
    s = r.summary
    for a in s.arms:
        t.add_row(a.name, f"{a.median:.1f}", f"{a.mad:.1f}", str(a.n))
    o = output.out
    o.print(t)
    o.print(f"gain vs pooled q1 median: {s.gain_percent:+.1f}% ({s.speedup:.2f}x); "
            f"bracket drift A->B: {s.drift_percent:+.1f}%")
    ok = "[green]identical[/green]" if s.hashes_identical else "[red]DIFFER[/red]"
    o.print(f"response and logits SHA-256 across every request: {ok}")
    o.print(f"evidence {r.evidence_dir}", highlight=False, markup=False)
    o.print(f"manifest sha256 {r.manifest_sha256}", highlight=False, markup=False)
