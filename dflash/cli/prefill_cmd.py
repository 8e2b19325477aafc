"""`dflash prefill`: one request through the band schedule, with fingerprints and timings."""
from __future__ import annotations

import click

from dflash.cli import output
from dflash.cli.options import (
    Command,
    ctx_option,
    device_option,
    memory_budget_option,
    model_option,
    open_session,
    prompt_options,
    read_prompt,
    run_options,
)
from dflash.core.results import PrefillResult
from dflash.run import speculate
from dflash.run.bands import summarize_widths
from dflash.session import Session


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
              help="Also run the q1 schedule and require identical logits and response hashes (exit 4 if not).")
@click.option("--spec", default="none", show_default=True, metavar="none|ngram|ngram:N",
              help="Also decode the response with n-gram speculation (an N-token lookup, 4 by default) and require "
                   "its tokens and the logits they were chosen from to equal plain decoding's (exit 4 if not); "
                   "reports the acceptance rate and both decode times.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model: str | None, weights: str, prompt: str | None, prompt_file: str | None, chunk: str | None,
            bands: bool | None, threads: int | None, lib: str, n_predict: int, ctx: int | None, resume_at: int,
            logits_mode: str, device: str, rpc: str | None, allow_mixed_builds: bool, no_repack: bool,
            memory_budget: str | None, compare_q1: bool, spec: str, as_json: bool) -> None:
    """Prefill a prompt in exact bands and print widths, speed and SHA-256 fingerprints.

    Exit codes: 0 ok; 4 when --compare-q1 finds the band schedule's hashes differ from q1's, or
    --spec a response that differs from plain decoding's; 1 runtime error; 2 bad input; 3 no GPU;
    130 interrupted."""
    speculate.check_spec(spec)
    text = read_prompt(prompt, prompt_file)
    with open_session(model=model, weights=weights, lib=lib, device=device, rpc=rpc,
                      allow_mixed_builds=allow_mixed_builds, no_repack=no_repack, threads=threads, ctx=ctx,
                      chunk=chunk, bands=bands, memory_budget=memory_budget, budget_prompt=text,
                      budget_n_predict=n_predict) as session:
        tokens = session.tokenize(text)
        with output.progress_bar("prefill", enabled=len(tokens) >= 256) as progress:
            result = session.prefill(tokens, n_predict=n_predict, resume_at=resume_at, logits=logits_mode,
                                     compare_q1=compare_q1, progress=progress, spec=spec)
        output.emit(result, as_json, lambda r: _print_human(session, r))
    result.check_exact()


def _print_human(session: Session, r: PrefillResult) -> None:
    s = session.settings
    o = output.out
    o.print(f"model     {r.model} ({r.architecture}), library {r.library.flavor}", highlight=False, markup=False)
    o.print(f"bands     {'on, cap ' + str(s.cap) if s.bands else 'off (q1)'}; widths {summarize_widths(r.widths)}",
            highlight=False, markup=False)
    if session.remote is not None:
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
    sp = r.speculation
    if sp is not None:
        rate = f"{sp.acceptance_rate:.0%}" if sp.acceptance_rate is not None else "n/a (nothing drafted)"
        speed = f"{sp.decode_speedup:.2f}x" if sp.decode_speedup is not None else "n/a"
        verdict = ("[green]identical to plain decoding[/green]" if sp.identical
                   else "[red]DIFFERS from plain decoding[/red]")
        o.print(f"spec      {sp.spec}: tokens sha256 {sp.response_tokens_sha256[:16]}…  {verdict}; "
                f"{sp.accepted} of {sp.drafted} drafted tokens accepted ({rate}) in {sp.batches} batches; "
                f"decode {speed} plain")
