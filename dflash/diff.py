"""`dflash diff`: two prefill schedules traced node by node, and the first graph node whose output
differs (see trace.py for how nodes become per-position rows and how rows are compared)."""
from __future__ import annotations

from collections.abc import Callable

from . import llama, prefill
from .bands import Band, from_widths, parse_schedule, summarize_widths
from .engine import Engine
from .results import DiffResult, DiffSide, Library
from .trace import Trace, TraceDiff, add_decode, compare, first_differing_row, new_trace


def traced_request(eng: Engine, tap: llama.GraphTap, tokens: list[int], bands: list[Band], n_predict: int,
                   progress: Callable[[int, int], None] = lambda done, total: None,
                   strict: bool = True) -> tuple[prefill.RequestOutput, Trace]:
    """One request on a fresh context with every band's tapped nodes recorded per position.

    A fresh context per schedule means cache cells not yet written (masked, but visible in
    nodes such as kq) hold the same bytes in both runs rather than the previous run's values."""
    ctx = eng.context(eng.context_size(len(tokens), n_predict, None), max(b.width for b in bands),
                      eval_callback=tap.callback)
    trace = new_trace(len(tokens))
    with ctx:
        tap.take()
        r = prefill.run(ctx, prefill.Request(tokens, bands, n_predict, keep_logits=True), progress,
                        on_band=lambda b: add_decode(trace, tap.take(), b.start, b.width, strict),
                        library=str(eng.lib_dir))
        tap.take()  # the response decodes' nodes are not compared (a copy error still raises)
    return r, trace


def diff_report(spec_a: str, spec_b: str, wa: list[int], wb: list[int], ra: prefill.RequestOutput,
                rb: prefill.RequestOutput,
                d: TraceDiff, show: int, eng: Engine, ignore: str | None = None) -> DiffResult:
    assert ra.logits is not None and rb.logits is not None  # traced requests keep their logits
    first_pos, n_rows, max_d = first_differing_row(ra.logits, rb.logits)
    return DiffResult(
        a=DiffSide(spec_a, summarize_widths(wa), len(wa)), b=DiffSide(spec_b, summarize_widths(wb), len(wb)),
        n_tokens=sum(wa), first_diff_position=first_pos, n_positions_differing=n_rows, logits_max_abs_diff=max_d,
        first_node=d.first, n_compared=d.n_compared, node_positions_differing=len(d.positions_differing),
        differing=tuple(d.differing[:show]), n_differing_at_first_position=len(d.differing),
        model=eng.info.path, library=Library(eng.settings.lib, str(eng.lib_dir), eng.settings.cpu), threads=eng.threads,
        ignore=ignore, devices=eng.placement)


def run(eng: Engine, tokens: list[int], spec_a: str, spec_b: str, *, ignore: str | None = None, show: int = 10,
        progress: Callable[[int, int], None] = lambda done, total: None) -> DiffResult:
    """Trace schedules `spec_a` and `spec_b` (grammar: bands.SCHEDULE_HELP) over `tokens` on fresh
    contexts and compare them; the result names the first differing node and position."""
    wa = parse_schedule(spec_a, len(tokens), eng.info.compress_ratios)
    wb = parse_schedule(spec_b, len(tokens), eng.info.compress_ratios)
    tap = llama.GraphTap(lambda name: True)
    ra, ta = traced_request(eng, tap, tokens, from_widths(wa), 0, lambda d, n: progress(d, 2 * n))
    rb, tb = traced_request(eng, tap, tokens, from_widths(wb), 0, lambda d, n: progress(n + d, 2 * n))
    return diff_report(spec_a, spec_b, wa, wb, ra, rb, compare(ta, tb, ignore), show, eng, ignore)
