"""`dflash qualify`: which band widths are bit-identical to q1 on this model and build."""
from __future__ import annotations

import os
import sys
from typing import cast

import click
from rich.console import JustifyMethod
from rich.markup import escape
from rich.table import Table

from dflash import serve as serve_lib
from dflash.cli import output
from dflash.cli.options import (
    Command,
    device_option,
    lib_option,
    model_option,
    open_session,
    parse_widths,
    prompt_options,
    read_prompt,
    threads_option,
)
from dflash.core import settings
from dflash.core.errors import NotExactError, UsageError
from dflash.core.results import QualifyResult, RunCheck
from dflash.model import gguf_meta
from dflash.proof import qualify, records
from dflash.serving import serve_config, serve_workload
from dflash.serving.serve_check import ServeQualifyResult


@click.command("qualify", cls=Command, short_help="Which band widths are bit-identical to q1 (per-width verdicts, a "
               "recommended cap, evidence).")
@model_option
@prompt_options
@click.option("--widths", default=",".join(map(str, qualify.DEFAULT_WIDTHS)), show_default=True,
              help="Planner caps to qualify, comma-separated (q1 always runs).")
@click.option("--resume-at", type=click.IntRange(min=1), default=None,
              help="Resume point of the second part [default: first p > n/3 with p % 4 != 0 and p % 128 != 0].")
@threads_option
@lib_option
@click.option("--n-predict", type=click.IntRange(min=0), default=8, show_default=True,
              help="Greedy response tokens after each prefill (their SHA-256 must match q1's).")
@click.option("--evidence", "evidence_dir", default=None,
              help="Evidence directory to write [default: evidence/runs/qualify-<UTC time>-<hex>].")
@device_option
@click.option("--serve", is_flag=True,
              help="Qualify llama-server configurations instead of band widths (see below; --widths, --prompt, "
                   "--resume-at and --n-predict do not apply).")
@click.option("--parallel", type=click.IntRange(1, serve_config.MAX_PARALLEL), default=4, show_default=True,
              help="With --serve: the slots to qualify (1 is always qualified too).")
@click.option("--ubatch", type=click.IntRange(1, settings.MAX_CHUNK), default=512, show_default=True,
              help="With --serve: tokens per llama_decode (-b/-ub).")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="With --serve: tokens per response.")
@click.option("--prefix-words", type=click.IntRange(1, 100_000), default=300, show_default=True,
              help="With --serve: words of the prompt prefix the requests share.")
@click.option("--ctx", type=click.IntRange(16, 1 << 24), default=4096, show_default=True,
              help="With --serve: context per slot.")
@click.option("--spec", default=serve_config.NO_SPEC, show_default=True, metavar="none|ngram|mtp|draft:MODEL",
              help="With --serve: the servers speculate (see `dflash serve --spec`); the solo cold references do not, "
                   "and the workload adds a prompt that repeats itself.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED, metavar="[-- LLAMA-SERVER OPTIONS]")
def command(model: str | None, weights: str, prompt: str | None, prompt_file: str | None, widths: str,
            resume_at: int | None, threads: int | None, lib: str, n_predict: int, evidence_dir: str | None,
            device: str, rpc: str | None, allow_mixed_builds: bool, no_repack: bool, serve: bool, parallel: int,
            ubatch: int, max_tokens: int, prefix_words: int, ctx: int, spec: str, as_json: bool,
            extra: tuple[str, ...]) -> None:
    """Run q1 once and the band planner at every cap in --widths over a prompt that crosses the
    compressor boundaries and the sliding window, with a resumed (unaligned) start and a tail; report
    per width whether the logits of every position are bit-identical to q1's (and the first
    position that is not), whether the response SHA-256 matches and, for MoE models, whether the
    routed expert ids and weights of every position and layer match. Then recommend the largest
    exact cap (at most 4) and the LUCE_MMVQ_MAX_NCOLS value, and the widest exact width (what
    --chunk auto runs), write an evidence directory, and store the per-width verdicts as the
    qualification record of this library, CPU variant, model, device and run-time conditions (the
    CPU buffer types offered, AMX among them or not, and the kernel switches set in the
    environment), in the user cache, merged with the widths it already held; a copy of this run's
    verdicts goes into the evidence directory. The verdicts cover prompts of up to this prompt's
    length: --chunk auto on a longer one falls back (docs/concepts/qualification.md).
    Without --prompt/--prompt-file the built-in prompt is repeated until it has more than
    2 * widest + 8 tokens, so that a band of the widest width is really decoded.

    Width 1 is a repeat of q1 (reproducibility). The largest exact cap is the largest w with every
    cap 1..w run and exact (a cap not run is not vouched for); the recommended cap is that, at
    most 4. The planner never decodes a band wider than the smallest compress ratio, so on
    DeepSeek V4 caps above 4 run the same bands as cap 4: the widest band really decoded is
    reported separately as the largest exact width.

    qualify reports, it is not a gate: it exits 0 when it ran, whether or not every width is
    exact (read `all_exact` or the table); 2 when the prompt is too short to cross the boundaries
    or to decode the widest width, or too long for the model's context.

    With --serve: start llama-server (`dflash serve`'s configuration) with --parallel 1 and N slots
    in turn on a free loopback port, send each a fixed mixed workload (prompts of different lengths
    arriving while others decode, a shared prefix, repeats and second turns that hit the prompt
    cache, streaming and not; chat when the model has a chat template or `-- --chat-template NAME`
    gives one), and check every response's token ids, logprobs and fingerprints against the same
    request run alone on a cold one-slot server, and against dflash prefill (q1) of the same prompt.
    Writes evidence and the serve record `dflash serve` reads. Exit 0 when every response is
    identical, 4 when one is not."""
    if serve:
        click_ctx = click.get_current_context()
        given = [n for n in ("widths", "prompt", "prompt_file", "resume_at", "n_predict", "rpc")
                 if click_ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} does not apply to --serve")
        _serve(model, weights, lib, device, threads, parallel, ubatch, max_tokens, prefix_words, ctx, list(extra),
               evidence_dir, as_json, spec)
        return
    if spec != serve_config.NO_SPEC:
        raise UsageError("--spec applies to --serve only (band qualification has no decoding to speculate)")
    if extra:
        raise UsageError(f"unexpected argument {extra[0]!r} (llama-server options go with --serve)")
    ws = parse_widths(widths)
    text = None if prompt is None and prompt_file is None else read_prompt(prompt, prompt_file)
    with open_session(model=model, weights=weights, lib=lib, device=device, rpc=rpc,
                      allow_mixed_builds=allow_mixed_builds, no_repack=no_repack, threads=threads,
                      chunk=settings.MAX_BAND, bands=True) as session:
        with output.progress_bar("qualify", enabled=not as_json) as bar:
            result = session.qualify(ws, prompt=text, resume_at=resume_at, n_predict=n_predict,
                                     evidence_dir=evidence_dir, progress=bar)
    output.emit(result, as_json, _print_human)


def _serve(model: str | None, weights: str, lib: str, device: str, threads: int | None, parallel: int, ubatch: int,
           max_tokens: int, prefix_words: int, ctx: int, extra: list[str], evidence_dir: str | None,
           as_json: bool, spec: str = serve_config.NO_SPEC) -> None:
    serve_config.check_extra(extra, allow_inexact=False)
    target = serve_lib.target(model, weights=weights, lib=lib, device=device, extra=extra,
                              settings=settings.Settings.from_env(lib=lib), build_missing=True, log=output.note)
    chat = "--chat-template" in extra or "--chat-template-file" in extra or gguf_meta.has_chat_template(
        target.check.model)
    spec = serve_lib.check_spec(target, spec)
    shape = serve_workload.Shape(prefix_words=prefix_words, max_tokens=max_tokens, chat=chat,
                                 repeat=spec != serve_config.NO_SPEC)
    n_threads = threads or min(os.cpu_count() or 1, 8)
    result = serve_lib.qualify(target, sorted({1, parallel}), ubatch, ctx, n_threads, shape, evidence_dir,
                               argv=sys.argv, log=output.note, spec=spec)
    output.emit(result, as_json, _print_serve)
    for c in result.configs:
        drafted, accepted = c.drafts
        if c.config.spec != serve_config.NO_SPEC and (accepted == 0 or accepted == drafted):
            output.warn(f"--parallel {c.config.parallel}: {drafted} tokens drafted, {accepted} accepted: the workload "
                        f"did not exercise both an accepted and a rejected draft")
    if not result.exact:
        raise NotExactError(f"not every response of llama-server ({lib}) was identical to its solo cold run and "
                            f"to dflash prefill (see {result.evidence_dir})")


def _print_serve(result: ServeQualifyResult) -> None:
    o = output.out
    o.print(f"model     {escape(result.model)}, llama-server {result.flavor}, system_fingerprint "
            f"{result.fingerprint}", highlight=False)
    t = Table()
    spec = any(c.config.spec != serve_config.NO_SPEC for c in result.configs)
    for name in ("parallel", "ubatch", "responses", "identical to solo cold", "identical to prefill",
                 "cache hits", *(("spec", "drafted", "accepted") if spec else ()), "exact"):
        t.add_column(name, justify="right")
    for c in result.configs:
        e = c.entry(None)
        drafted, accepted = c.drafts
        t.add_row(str(c.config.parallel), str(c.config.ubatch), str(e.responses), str(e.identical_to_solo),
                  str(e.identical_to_prefill), str(e.cache_hits),
                  *((c.config.spec, str(drafted), str(accepted)) if spec else ()), _yes(c.exact))
    o.print(t)
    for c in result.configs:
        for v in c.verdicts:
            if v.why:
                o.print(f"[red]parallel {c.config.parallel}, {escape(v.call)}:[/red] {escape(v.why)}", highlight=False)
    o.print(f"record    {escape(result.record_path)}", highlight=False)
    o.print(f"evidence  {escape(result.evidence_dir)}  manifest sha256 {result.manifest_sha256}", highlight=False)


def _yes(ok: bool | None, good: str = "yes", bad: str = "NO") -> str:
    if ok is None:
        return "[dim]n/a[/dim]"
    return f"[green]{good}[/green]" if ok else f"[red]{bad}[/red]"


def _print_human(result: QualifyResult) -> None:
    o = output.out
    r = result.report
    o.print(f"model     {escape(r.model)} ({r.architecture}), library {r.library.flavor}, "
            f"{r.threads} threads", highlight=False)
    c = r.coverage
    crossed = ", ".join(x["what"] for x in c["crossings"] if x["crossed"]) or "none"
    o.print(f"prompt    {r.n_tokens} tokens, resumed at {r.resume_at} (unaligned); crosses {crossed}; "
            f"start band in caps {_ws(c['widths_with_start_band'])}, tail band in caps "
            f"{_ws(c['widths_with_tail_band'])}", highlight=False, markup=False)
    uncrossed = [f"{x['what']} at {x['position']}" for x in c["crossings"] if not x["crossed"]]
    o.print(f"covers    prompts of up to {r.n_tokens} tokens (this prompt's length)"
            + (f"; stops short of the {', '.join(uncrossed)}" if uncrossed else ""), highlight=False, markup=False)
    ref = r.reference
    o.print(f"q1        logits {ref['logits_sha256'][:16]}…  response {ref['response_sha256'][:16]}…  "
            f"({r.n_predict} tokens)", highlight=False, markup=False)
    t = Table()
    for name, j in (("cap", "right"), ("bands", "right"), ("widths used", "left"), ("exact", "left"),
                    ("logits", "left"), ("first diff", "right"), ("max |Δ|", "right"),
                    ("response", "left"), ("routing", "left"), ("fixed width", "left")):
        t.add_column(name, justify=cast(JustifyMethod, j))
    for x in r.results:
        p = x.planner
        sched = p.schedule
        rd = p.first_routing_diff
        routing = _yes(p.routing_identical, "same", "DIFFERS")
        if rd:
            routing += f" (pos {rd['position']}, layer {rd['layer']} {rd['field'].replace('_', ' ')})"
        t.add_row(str(x.width) + (" (q1)" if x.width == 1 else ""), str(sched["n_bands"]),
                  " ".join(f"{w}x{n}" for w, n in sched["widths"].items()),
                  _yes(x.exact), _yes(p.logits_identical, "identical", "differ"),
                  "-" if x.first_diff_position is None else str(x.first_diff_position),
                  f"{p.max_abs_diff:.2e}" if p.max_abs_diff is not None else "nan",
                  _yes(p.response_identical, "same", "DIFFERS"), routing, _fixed(x.fixed))
    o.print(t)
    short = [x.width for x in r.results
             if x.planner.schedule["widths"] and max(map(int, x.planner.schedule["widths"])) < x.width]
    if short:
        o.print(f"[dim]the planner cuts caps {_ws(short)} at compressor boundaries (same bands as a smaller "
                f"cap); their 'fixed width' runs decode bands of exactly that width[/dim]", highlight=False)
    env = " ".join(f"{k}={v}" for k, v in r.recommended_env.items())
    o.print(f"largest exact cap    {r.largest_exact_cap} (widest band decoded by the exact runs: "
            f"{r.largest_exact_width})", highlight=False, markup=False)
    rec = f"--chunk {r.recommended_cap}" if r.recommended_bands else "q1 (bands off)"
    o.print(f"recommended          {rec}  ({env}; needs no record)", highlight=False, markup=False)
    q = result.qualification
    w, mode = r.recommended_chunk, r.recommended_band_mode
    widest = f"--chunk {w} ({mode} bands)" if w > 1 else "q1 (no wider width is exact)"
    o.print(f"widest exact width   {widest}; with the record, --chunk auto runs {q.auto_width} "
            f"(recorded widths {_ws(list(q.widths))})", highlight=False, markup=False)
    o.print(f"record    {escape(q.record.path)}", highlight=False)
    try:
        stored = records.read(q.record.path)
        o.print(f"vouches   for {records.describe_runtime(stored.identity)}, prompts up to {r.n_tokens} tokens",
                highlight=False, markup=False)
    except records.RecordError:  # replaced meanwhile: the path says where it is
        pass
    if not r.all_exact:
        o.print("[yellow]not every width is exact on this build[/yellow] (qualify reports; exit code 0)")
    o.print(f"evidence  {escape(result.evidence_dir)}  manifest sha256 {result.manifest_sha256}",
            highlight=False)


def _fixed(f: RunCheck | None) -> str:
    if f is None:
        return "[dim]-[/dim]"
    if f.exact:
        return "[green]exact[/green]"
    pos = f.first_diff_position
    return "[red]NO[/red]" + (f" (pos {pos})" if pos is not None else "")


def _ws(ws: list[int]) -> str:
    return ",".join(map(str, ws)) or "none"
