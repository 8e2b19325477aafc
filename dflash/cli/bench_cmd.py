"""`dflash bench`: A/B/A benchmark of the band schedule against q1, written as evidence."""
from __future__ import annotations

import click
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import (
    Command,
    chunk_option,
    device_option,
    lib_option,
    memory_budget_option,
    model_option,
    open_session,
    prompt_options,
    read_prompt,
    threads_option,
)
from dflash.core.errors import NotExactError
from dflash.core.results import BenchResult


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
def command(model: str | None, weights: str, prompt: str | None, prompt_file: str | None, chunk: str | None,
            threads: int | None, lib: str, warmup: int, runs: int, interleave: bool, n_predict: int, logits_mode: str,
            device: str, rpc: str | None, allow_mixed_builds: bool, no_repack: bool, memory_budget: str | None,
            evidence_dir: str | None, as_json: bool) -> None:
    """A/B/A: q1, the band schedule, q1 again; medians, MAD, gain, drift, hash equality.

    Exits 4 (after writing the evidence) when any request's response or logits hash differs."""
    text = read_prompt(prompt, prompt_file)
    with open_session(model=model, weights=weights, lib=lib, device=device, rpc=rpc,
                      allow_mixed_builds=allow_mixed_builds, no_repack=no_repack, threads=threads, chunk=chunk,
                      bands=True, memory_budget=memory_budget, budget_prompt=text,
                      budget_n_predict=n_predict) as session:  # the candidate arm is a band schedule
        with output.progress_bar("bench") as progress:
            result = session.bench(text, warmup=warmup, runs=runs, interleave=interleave, n_predict=n_predict,
                                   logits=logits_mode, evidence_dir=evidence_dir, progress=progress)
    output.emit(result, as_json, show)
    if not result.summary.hashes_identical:
        raise NotExactError(f"hashes differ between requests: the candidate is not exact "
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
