"""`dflash sweep`: prefill tokens/s per library and band width, one worker process per library."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import (
    Command,
    cpu_option,
    indexer_tile_option,
    model_option,
    prompt_options,
    read_prompt,
    threads_option,
)
from dflash.compare import sweep
from dflash.core import settings
from dflash.core.errors import DflashError, NotExactError, UsageError
from dflash.core.fileio import write_atomic
from dflash.native import devices
from dflash.proof import evidence, provenance


@click.command("sweep", cls=Command)
@cpu_option
@indexer_tile_option
@model_option
@prompt_options
@click.option("--widths", default=sweep.DEFAULT_WIDTHS, show_default=True,
              help="Band widths, comma-separated (1, the q1 reference, is always measured).")
@click.option("--libs", default=sweep.DEFAULT_LIBS, show_default=True, help="llama.cpp libraries, comma-separated.")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Timed rounds.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed rounds first.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Repeat the prompt to this many tokens and keep exactly those (long-prompt runs; at least "
                   "the widest width) [default: the widest width's tokens].")
@click.option("--decode", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also time N greedy decode tokens after the prompt, per library and round (0: off).")
@threads_option
@click.option("--plot", "plot_path", default=None, help="Also write the tokens/s-vs-width plot to this PNG.")
@click.option("--evidence", "evidence_dir", default=None,
              help="Evidence directory to create [default: evidence/runs/sweep-<time>-<id>].")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, hip:N, cuda:N or vulkan:N: every library runs every layer there (each library its "
                   "build for that device).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model: str | None, weights: str, prompt: str | None, prompt_file: str | None, widths: str, libs: str,
            runs: int, warmup: int, prompt_tokens: int | None, decode: int, threads: int | None,
            plot_path: str | None, evidence_dir: str | None, device: str, as_json: bool) -> None:
    """Prefill throughput of each library at each fixed band width, rounds interleaved.

    The prompt (default: the built-in one) is repeated until it has at least the widest width's
    tokens (--prompt-tokens: exactly that many). Each width is also checked once against its
    library's q1 (logits of every position and the response, bit for bit). With --decode N each
    round also times N greedy tokens after the prompt per library (decode tokens/s). Exits 4 (after
    writing the evidence) when a width of the exact library differs from its q1."""
    if devices.parse_spec(device).rpc_ids:
        raise UsageError(f"--device {device}: sweep runs local devices only (prefill --rpc runs RPC devices)")
    plan = sweep.Plan(sweep.parse_libs(libs), sweep.parse_widths(widths), runs, warmup,
                      read_prompt(prompt, prompt_file), model, weights, threads, settings.Settings.from_env(),
                      prompt_tokens, decode, str(devices.parse_spec(device)))
    if plot_path and not Path(plot_path).absolute().parent.is_dir():
        raise UsageError(f"--plot {plot_path}: its folder does not exist")
    dest = Path(evidence_dir) if evidence_dir else provenance.default_evidence_dir("sweep")
    with evidence.EvidenceWriter(dest, "sweep") as writer:  # a bad --evidence fails before the runs
        with output.progress_bar("sweep") as progress:
            m = sweep.measure(plan, progress, log=output.note)
        r = sweep.result(plan, m)
        for w in r.warnings:
            output.warn(w)
        png = sweep.plot_png(r)
        options = {"libs": list(plan.libs), "widths_asked": list(plan.widths), "widths": list(r.widths),
                   "runs": runs, "warmup": warmup, "threads": r.threads, "model": model, "weights": weights,
                   "verify_n_predict": sweep.VERIFY_N_PREDICT, "plot": plot_path, "prompt_tokens": prompt_tokens,
                   "decode": decode, "device": plan.device}
        path, manifest_sha = sweep.write_evidence(writer, sys.argv, options, m, r, png)
    if plot_path:
        try:
            write_atomic(plot_path, png)
        except OSError as e:
            raise DflashError(f"cannot write --plot {plot_path}: {e.strerror}") from None
    out = {**r.to_json(), "evidence_dir": str(path), "manifest_sha256": manifest_sha, "plot": plot_path}
    if as_json:
        output.emit_json(out)
    else:
        show(r, out)
    if not r.exact_library_exact:
        raise NotExactError(f"a width of the exact library differs from its q1 (evidence {path})")


def show(r: sweep.SweepResult, out: dict) -> None:
    yes = lambda b: "[green]yes[/green]" if b else "[red]no[/red]"
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"
    t = Table("library", "width", "median tok/s", "MAD", "= its q1", "vs stock q1", "vs its q1",
              title=f"prefill sweep, {r.n_prompt_tokens} tokens, {r.threads} threads, {r.runs} timed rounds")
    for x in r.rows:
        t.add_row(x.lib, str(x.width), f"{x.median:.1f}", f"{x.mad:.1f}", yes(x.exact),
                  fmt(x.speedup_vs_stock_q1), fmt(x.speedup_vs_lib_q1))
    o = output.out
    o.print(t)
    if r.taxes:
        o.print("exactness tax (exact / stock median): "
                + ", ".join(f"width {x.width} {x.ratio:.2f}x" for x in r.taxes), highlight=False, markup=False)
        o.print("median of the rounds' paired ratios (exact / stock, back to back): "
                + ", ".join(f"width {x.width} {fmt(x.paired_median)}" for x in r.taxes), highlight=False,
                markup=False)
    for d in r.decode:
        o.print(f"decode after {r.n_prompt_tokens} tokens, {d.lib}: {d.median:.1f} tok/s (MAD {d.mad:.1f}, "
                f"{len(d.samples)} rounds of {r.decode_tokens} tokens)", highlight=False, markup=False)
    if r.decode_ratio is not None:
        o.print(f"decode exact / stock: {r.decode_ratio:.2f}x (median of paired ratios "
                f"{fmt(r.decode_paired_median)})", highlight=False, markup=False)
    if out["plot"]:
        o.print(f"plot {out['plot']}", highlight=False, markup=False)
    o.print(f"evidence {out['evidence_dir']}", highlight=False, markup=False)
    o.print(f"manifest sha256 {out['manifest_sha256']}", highlight=False, markup=False)
