"""`dflash diff`: two prefill schedules traced node by node, and the first graph node whose output
differs (see trace.py for how nodes become per-position rows and how rows are compared).

A tap sees what the backend computes node by node, and a backend that fuses nodes into one dispatch
when nothing watches (ggml-vulkan: RMS_NORM+MUL, multi-add, top-k routing, ...) computes otherwise
untapped. So both schedules also run untapped, and "identical" needs the untapped runs to agree
too: a difference that only the untapped runs show is inside fused work, reported as such (its
first position) and never called identical. Whether each tapped run reproduced its untapped logits
is reported as well (tap_faithful): where it did not, the node comparison describes the unfused
graph."""
from __future__ import annotations

from collections.abc import Callable

from dflash.core.results import DiffResult, DiffSide, Library
from dflash.core.trace import Trace, TraceDiff, add_decode, compare, first_differing_row, new_trace
from dflash.native import llama
from dflash.run import prefill
from dflash.run.bands import Band, from_widths, parse_schedule, summarize_widths
from dflash.run.engine import Engine

Progress = Callable[[int, int], None]


def _fresh_context(eng: Engine, tokens: list[int], bands: list[Band], n_predict: int,
                   eval_callback: object = None) -> llama.Context:
    """A context of its own for one request. A fresh context per schedule means cache cells not
    yet written (masked, but visible in nodes such as kq) hold the same bytes in both runs rather
    than the previous run's values."""
    return eng.context(eng.context_size(len(tokens), n_predict, None), max(b.width for b in bands),
                       eval_callback=eval_callback)


def traced_request(eng: Engine, tap: llama.GraphTap, tokens: list[int], bands: list[Band], n_predict: int,
                   progress: Progress = lambda done, total: None,
                   strict: bool = True) -> tuple[prefill.RequestOutput, Trace]:
    """One request on a fresh context with every band's tapped nodes recorded per position."""
    ctx = _fresh_context(eng, tokens, bands, n_predict, tap.callback)
    trace = new_trace(len(tokens))
    with ctx:
        tap.take()
        r = prefill.run(ctx, prefill.Request(tokens, bands, n_predict, keep_logits=True), progress,
                        on_band=lambda b: add_decode(trace, tap.take(), b.start, b.width, strict),
                        library=str(eng.lib_dir))
        tap.take()  # the response decodes' nodes are not compared (a copy error still raises)
    return r, trace


def untapped_request(eng: Engine, tokens: list[int], bands: list[Band],
                     progress: Progress = lambda done, total: None) -> prefill.RequestOutput:
    """The same request on a fresh context without a tap: what the backend computes when it may fuse."""
    with _fresh_context(eng, tokens, bands, 0) as ctx:
        return prefill.run(ctx, prefill.Request(tokens, bands, 0, keep_logits=True), progress,
                           library=str(eng.lib_dir))


def diff_report(spec_a: str, spec_b: str, wa: list[int], wb: list[int], ra: prefill.RequestOutput,
                rb: prefill.RequestOutput,
                ua: prefill.RequestOutput, ub: prefill.RequestOutput,
                d: TraceDiff, show: int, eng: Engine, ignore: str | None = None) -> DiffResult:
    """`ra`/`rb` the tapped runs, `ua`/`ub` the untapped ones (all keep their logits)."""
    assert ra.logits is not None and rb.logits is not None and ua.logits is not None and ub.logits is not None
    first_pos, n_rows, max_d = first_differing_row(ra.logits, rb.logits)
    return DiffResult(
        a=DiffSide(spec_a, summarize_widths(wa), len(wa)), b=DiffSide(spec_b, summarize_widths(wb), len(wb)),
        n_tokens=sum(wa), first_diff_position=first_pos, n_positions_differing=n_rows, logits_max_abs_diff=max_d,
        first_node=d.first, n_compared=d.n_compared, node_positions_differing=len(d.positions_differing),
        differing=tuple(d.differing[:show]), n_differing_at_first_position=len(d.differing),
        model=eng.info.path, library=Library(eng.settings.lib, str(eng.lib_dir), eng.settings.cpu), threads=eng.threads,
        ignore=ignore, devices=eng.placement,
        untapped_first_diff_position=first_differing_row(ua.logits, ub.logits)[0],
        tap_changed_logits=tuple(name for name, t, u in (("a", ra, ua), ("b", rb, ub))
                                 if t.logits_sha256 != u.logits_sha256))


def run(eng: Engine, tokens: list[int], spec_a: str, spec_b: str, *, ignore: str | None = None, show: int = 10,
        progress: Progress = lambda done, total: None) -> DiffResult:
    """Trace schedules `spec_a` and `spec_b` (grammar: bands.SCHEDULE_HELP) over `tokens` on fresh
    contexts and compare them; the result names the first differing node and position. Both also
    run untapped (see the module's doc)."""
    wa = parse_schedule(spec_a, len(tokens), eng.info.compress_ratios)
    wb = parse_schedule(spec_b, len(tokens), eng.info.compress_ratios)
    tap = llama.GraphTap(lambda name: True)
    ba, bb = from_widths(wa), from_widths(wb)

    def part(k: int) -> Progress:  # the k-th of the four requests
        return lambda done, n: progress(k * n + done, 4 * n)
    ra, ta = traced_request(eng, tap, tokens, ba, 0, part(0))
    rb, tb = traced_request(eng, tap, tokens, bb, 0, part(1))
    ua, ub = untapped_request(eng, tokens, ba, part(2)), untapped_request(eng, tokens, bb, part(3))
    return diff_report(spec_a, spec_b, wa, wb, ra, rb, ua, ub, compare(ta, tb, ignore), show, eng, ignore)
