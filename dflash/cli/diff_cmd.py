"""`dflash diff`: name the first graph node whose output differs between two prefill schedules."""
from __future__ import annotations

import re
from typing import cast

import click
from rich.console import JustifyMethod
from rich.markup import escape
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import (
    Command,
    device_option,
    lib_option,
    model_option,
    open_session,
    prompt_options,
    read_prompt,
    threads_option,
)
from dflash.core import settings
from dflash.core.errors import UsageError
from dflash.core.results import DiffResult
from dflash.proof import diff
from dflash.run import bands


@click.command("diff", cls=Command, short_help="Name the first graph node that differs between two prefill schedules.",
               epilog="SCHEDULE is one of: " + bands.SCHEDULE_HELP + ".")
@model_option
@click.option("--a", "spec_a", default="q1", show_default=True, metavar="SCHEDULE", help="Reference schedule.")
@click.option("--b", "spec_b", default="w4", show_default=True, metavar="SCHEDULE", help="Candidate schedule.")
@prompt_options
@click.option("--n-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Compare the first N prompt tokens (the tokenized prompt is truncated).")
@threads_option
@lib_option
@click.option("--show", type=click.IntRange(min=0), default=10, show_default=True,
              help="List the first N differing nodes at the first differing position.")
@click.option("--ignore", default=None, metavar="REGEX",
              help="Do not compare nodes whose name matches this regular expression (re.search).")
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(model: str | None, weights: str, spec_a: str, spec_b: str, prompt: str | None, prompt_file: str | None,
            n_tokens: int, threads: int | None, lib: str, show: int, ignore: str | None, device: str, rpc: str | None,
            allow_mixed_builds: bool, no_repack: bool, as_json: bool) -> None:
    """Run two prefill schedules with a tap on every F32/I32 graph node and name the first node
    (name, op, position, max |delta|) whose output differs, walking positions in order and nodes
    in graph order. Comparison is bit for bit; max |delta| is a diagnostic.

    A node is compared per position when its outermost non-1 dimension is the band width (or the
    band is one token) and the token axis is unambiguous; a node that repeats a name in one
    decode is keyed name#k.

    A node can differ while the logits stay bit-identical: pre-softmax attention scores (kq-*)
    include masked KV cells, and the DeepSeek-V4 compressor-state gathers hold rows per state
    slot rather than per position, so both can depend on band alignment without reaching any
    output. Read such a node with the logits verdict next to it, or skip it with --ignore.

    A tap makes the backend run nodes one at a time, so work it fuses when untapped (ggml-vulkan
    fuses norms, adds and routing) is not what the tap sees. Both schedules therefore also run
    untapped: when those runs differ, the verdict is "differs" with the first untapped position
    that differs, even when every tapped node agrees (the difference is inside fused work;
    GGML_VK_DISABLE_FUSION=1 on Vulkan tells). When a tapped run's logits are not its untapped
    run's, the nodes describe the unfused graph, and the output says so.
    Exit code 0 whether or not the schedules differ."""
    if ignore is not None:
        try:
            re.compile(ignore)
        except re.error as e:
            raise UsageError(f"--ignore {ignore!r} is not a regular expression: {e}") from None
    text = read_prompt(prompt, prompt_file)
    with open_session(model=model, weights=weights, lib=lib, device=device, rpc=rpc,
                      allow_mixed_builds=allow_mixed_builds, no_repack=no_repack, threads=threads,
                      chunk=settings.MAX_BAND, bands=True) as session:
        tokens = session.tokenize(text)[:n_tokens]
        with output.progress_bar("trace", enabled=not as_json) as bar:
            result = diff.run(session.engine, tokens, spec_a, spec_b, ignore=ignore, show=show, progress=bar)
    output.emit(result, as_json, _print_human)


def _print_human(r: DiffResult) -> None:
    o = output.out
    o.print(f"model     {escape(r.model)}, library {r.library.flavor}, {r.n_tokens} tokens, "
            f"{r.threads} threads", highlight=False)
    for name, side in (("a", r.a), ("b", r.b)):
        o.print(f"{name}         {escape(side.schedule)}: {side.n_bands} decodes, widths "
                f"{escape(side.widths)}", highlight=False)
    if r.logits_identical:
        o.print("logits    [green]bit-identical[/green] at every position")
    else:
        o.print(f"logits    [red]differ[/red] from position {r.first_diff_position} "
                f"({r.n_positions_differing} positions, max |Δ| {r.logits_max_abs_diff:.3e})")
    if r.untapped_identical:
        o.print("untapped  [green]bit-identical[/green] at every position (no tap: what the backend fuses included)")
    else:
        o.print(f"untapped  [red]differ[/red] from position {r.untapped_first_diff_position}"
                + (" while the tapped runs agree: the difference is inside work the backend fuses when no tap "
                   "watches, which a node-by-node tap cannot show" if r.logits_identical else ""))
    if not r.tap_faithful:
        o.print(f"[yellow]note:[/yellow] the tap changed the logits of schedule {' and '.join(r.tap_changed_logits)} "
                "(tapped vs untapped run): the node comparison describes the unfused runs, not the real ones")
    f = r.first_node
    if f is None:
        o.print(f"nodes     [green]identical[/green]: no compared node differs "
                f"({r.n_compared} node rows compared)")
        return
    o.print(f"first differing node  [bold]{escape(f.key)}[/bold] ({f.op}) at position "
            f"{f.position}: max |Δ| {_num(f.max_abs_delta)}, {f.n_differing}/{f.n_values} "
            f"values differ; {r.n_compared} nodes compared at that position, "
            f"{r.n_differing_at_first_position} differ", highlight=False)
    if r.differing:
        t = Table(title=f"first {len(r.differing)} differing nodes at position {f.position} (graph order)",
                  title_justify="left")
        for c, j in (("node", "left"), ("op", "left"), ("max |Δ|", "right"), ("differ", "right")):
            t.add_column(c, justify=cast(JustifyMethod, j))
        for x in r.differing:
            t.add_row(escape(x.key), x.op, _num(x.max_abs_delta), f"{x.n_differing}/{x.n_values}")
        o.print(t)
    if r.logits_identical:
        o.print("[yellow]note:[/yellow] the logits are bit-identical, so this difference reaches no output "
                "(masked cache cells or state rows not indexed by position; see --help)")


def _num(x: object) -> str:
    return f"{x:.3e}" if isinstance(x, float) else str(x)
