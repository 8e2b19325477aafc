"""`dflash prefill`: one request through the band schedule, with fingerprints and timings."""
from __future__ import annotations

import click

from .. import bands as B
from .. import engine as E
from .. import prefill as P
from ..errors import DflashError, UsageError
from ..settings import ENV_BANDS
from . import output
from .options import device_option, model_option, prompt_options, run_options, run_settings


def result_dict(eng: E.Engine, r: P.Result, n_ctx: int) -> dict:
    s = eng.settings
    return {
        "model": str(eng.info.path), "architecture": eng.info.architecture,
        "library": {"flavor": s.lib, "dir": str(eng.lib_dir)},
        "bands_on": s.bands, "chunk": s.chunk, "chunk_requested": s.chunk_requested,
        "band_mode": "fixed" if s.fixed else "planner", "mmvq_max_ncols": s.mmvq_max_ncols,
        "qualification": s.qualified.to_json() if s.qualified else None,
        "threads": eng.threads, "n_ctx": n_ctx, "device": eng.device,
        "widths": r.widths, "n_prompt_tokens": r.n_prompt_tokens,
        "prefill_seconds": r.prefill_seconds, "prefill_tokens_per_second": r.prefill_tokens_per_second,
        "decode_seconds": r.decode_seconds,
        "prompt_sha256": r.prompt_sha256, "logits_sha256": r.logits_sha256,
        "response_tokens": r.response_tokens, "response_tokens_sha256": r.response_tokens_sha256,
        "response_text": r.response_text.decode("utf-8", errors="replace"),
        "response_sha256": r.response_sha256, "warnings": s.warnings(),
    }


@click.command("prefill")
@model_option
@prompt_options
@run_options
@click.option("--n-predict", type=click.IntRange(min=0), default=16, show_default=True,
              help="Greedy response tokens after the prefill.")
@click.option("--ctx", type=int, default=None, help="Context size [default: prompt + n-predict].")
@click.option("--resume-at", type=click.IntRange(min=0), default=0, show_default=True,
              help="Plan the prompt as two parts, the second resumed from this unaligned position.")
@click.option("--logits", "logits_mode", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="Logits hashed: every prompt position, or the last only.")
@device_option
@click.option("--compare-q1", is_flag=True,
              help="Also run the q1 schedule and require identical logits and response hashes (exit 1 if not).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model, weights, prompt, prompt_file, chunk, bands, threads, lib, n_predict, ctx,
            resume_at, logits_mode, device, compare_q1, as_json):
    """Prefill a prompt in exact bands and print widths, speed and SHA-256 fingerprints."""
    s = run_settings(bands, chunk, lib, model=model, weights=weights, device=device)
    if compare_q1 and not s.bands:
        raise UsageError(f"--compare-q1 compares a band schedule with q1, but bands are off "
                         f"(set {ENV_BANDS}=1 or pass --bands)")
    text = E.read_prompt(prompt, prompt_file)
    for w in s.warnings():
        output.warn(w)
    eng = E.open_engine(s, model, threads=threads, weights=weights, device=device, log=output.note)
    tokens = eng.tokenize(text)
    n_ctx = eng.context_size(len(tokens), n_predict, ctx)
    bands_ = eng.request_bands(len(tokens), resume_at)
    c = eng.context(n_ctx, max(b.width for b in bands_))
    try:
        with output.progress_bar("prefill", enabled=len(tokens) >= 256) as progress:
            r = P.run(c, P.Request(tokens, bands_, n_predict, logits_mode), progress)
        q1 = None
        if compare_q1:
            q1 = P.run(c, P.Request(tokens, eng.request_bands(len(tokens), resume_at, bands_on=False),
                                    n_predict, logits_mode))
    finally:
        c.close()
    d = result_dict(eng, r, n_ctx)
    same = None
    if q1 is not None:
        same = (q1.logits_sha256, q1.response_sha256) == (r.logits_sha256, r.response_sha256)
        d["q1"] = {"logits_sha256": q1.logits_sha256, "response_sha256": q1.response_sha256,
                   "prefill_seconds": q1.prefill_seconds,
                   "prefill_tokens_per_second": q1.prefill_tokens_per_second}
        d["identical_to_q1"] = same
        d["speedup_vs_q1"] = q1.prefill_seconds / r.prefill_seconds if r.prefill_seconds else None
    if as_json:
        output.emit_json(d)
    else:
        _print_human(eng, r, d)
    if same is False:
        raise DflashError("the band schedule's hashes differ from q1: this build/schedule is not exact")


def _print_human(eng: E.Engine, r: P.Result, d: dict) -> None:
    s = eng.settings
    o = output.out
    o.print(f"model     {d['model']} ({d['architecture']}), library {s.lib}", highlight=False)
    o.print(f"bands     {'on, cap ' + str(s.cap) if s.bands else 'off (q1)'}; widths {B.summarize_widths(r.widths)}",
            highlight=False)
    if s.qualified:
        q = s.qualified
        o.print(f"proven    width {q.width} ({'fixed-width bands' if s.fixed else 'planner bands'}) by "
                f"qualification record {q.path}", highlight=False)
    o.print(f"prefill   {r.n_prompt_tokens} tokens in {r.prefill_seconds:.3f} s = "
            f"{r.prefill_tokens_per_second:.1f} tok/s ({eng.threads} threads)", highlight=False)
    o.print(f"logits    sha256 {r.logits_sha256}", highlight=False)
    o.print(f"response  sha256 {r.response_sha256}  ({len(r.response_tokens)} tokens)", highlight=False)
    if "q1" in d:
        q = d["q1"]
        o.print(f"q1        logits {q['logits_sha256'][:16]}…  response {q['response_sha256'][:16]}…  "
                f"{q['prefill_tokens_per_second']:.1f} tok/s", highlight=False)
        verdict = "[green]identical to q1[/green]" if d["identical_to_q1"] else "[red]DIFFERS from q1[/red]"
        o.print(f"verdict   {verdict}; prefill speedup vs q1 {d['speedup_vs_q1']:.2f}x")
