"""`dflash prefill`: one request through the band schedule, with fingerprints and timings."""
from __future__ import annotations

import dataclasses

import click

from .. import engine, prefill
from ..bands import summarize_widths
from ..errors import DflashError, UsageError
from ..results import PrefillResult
from ..settings import ENV_BANDS
from . import output
from .options import (
    Command,
    budgeted_settings,
    connect_remote,
    ctx_option,
    device_option,
    memory_budget_option,
    model_option,
    prompt_options,
    run_options,
)


@click.command("prefill", cls=Command)
@model_option
@prompt_options
@run_options
@click.option("--n-predict", type=click.IntRange(min=0), default=16, show_default=True,
              help="Greedy response tokens after the prefill.")
@ctx_option
@click.option("--resume-at", type=click.IntRange(min=0), default=0, show_default=True,
              help="Plan the prompt as two parts, the second resumed from this unaligned position.")
@click.option("--logits", "logits_mode", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="Logits hashed: every prompt position, or the last only.")
@device_option
@memory_budget_option
@click.option("--compare-q1", is_flag=True,
              help="Also run the q1 schedule and require identical logits and response hashes (exit 1 if not).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model, weights, prompt, prompt_file, chunk, bands, threads, lib, n_predict, ctx,
            resume_at, logits_mode, device, rpc, allow_mixed_builds, no_repack, memory_budget, compare_q1, as_json):
    """Prefill a prompt in exact bands and print widths, speed and SHA-256 fingerprints."""
    remote = connect_remote(device, rpc, allow_mixed_builds)
    text = engine.read_prompt(prompt, prompt_file)
    s, budget_json = budgeted_settings(memory_budget, text, bands, chunk, lib, model=model, weights=weights,
                                       device=device, remote=remote, repack=not no_repack, threads=threads,
                                       n_predict=n_predict, ctx=ctx)
    if compare_q1 and not s.bands:
        raise UsageError(f"--compare-q1 compares a band schedule with q1, but bands are off "
                         f"(set {ENV_BANDS}=1 or pass --bands)")
    for w in s.warnings():
        output.warn(w)
    eng = engine.open_engine(s, model, threads=threads, weights=weights, device=device, remote=remote,
                             repack=not no_repack, log=output.note)
    for w in eng.narrow_warnings():
        output.warn(w)
    tokens = eng.tokenize(text)
    with output.progress_bar("prefill", enabled=len(tokens) >= 256) as progress:
        result = prefill.run_request(eng, tokens, n_predict=n_predict, resume_at=resume_at, logits=logits_mode, ctx=ctx,
                                     compare=compare_q1, progress=progress)
    result = dataclasses.replace(result, memory_budget=budget_json)
    if as_json:
        output.emit_json(result.to_json())
    else:
        _print_human(eng, result)
    if result.comparison is not None and not result.comparison.identical:
        raise DflashError("the band schedule's hashes differ from q1: this build/schedule is not exact")


def _print_human(eng: engine.Engine, r: PrefillResult) -> None:
    s = eng.settings
    o = output.out
    o.print(f"model     {r.model} ({r.architecture}), library {r.library.flavor}", highlight=False, markup=False)
    o.print(f"bands     {'on, cap ' + str(s.cap) if s.bands else 'off (q1)'}; widths {summarize_widths(r.widths)}",
            highlight=False, markup=False)
    if eng.remote is not None:
        o.print(f"devices   {output.describe_devices(r.devices)}", highlight=False, markup=False)
    if r.qualification:
        q = r.qualification
        o.print(f"proven    width {q.width} ({'fixed-width bands' if r.band_mode == 'fixed' else 'planner bands'}) by "
                f"qualification record {q.path}", highlight=False, markup=False)
    o.print(f"prefill   {r.n_prompt_tokens} tokens in {r.prefill_seconds:.3f} s = "
            f"{r.prefill_tokens_per_second:.1f} tok/s ({r.threads} threads)", highlight=False, markup=False)
    o.print(f"logits    sha256 {r.logits_sha256}", highlight=False, markup=False)
    o.print(f"response  sha256 {r.response_sha256}  ({len(r.response_tokens)} tokens)", highlight=False, markup=False)
    c = r.comparison
    if c is not None:
        o.print(f"q1        logits {c.q1.logits_sha256[:16]}…  response {c.q1.response_sha256[:16]}…  "
                f"{c.q1.prefill_tokens_per_second:.1f} tok/s", highlight=False, markup=False)
        verdict = "[green]identical to q1[/green]" if c.identical else "[red]DIFFERS from q1[/red]"
        speedup = f"{c.speedup:.2f}x" if c.speedup is not None else "n/a"
        o.print(f"verdict   {verdict}; prefill speedup vs q1 {speedup}")
