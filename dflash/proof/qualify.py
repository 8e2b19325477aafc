"""Qualify a model and llama.cpp build for band widths: is each width bit-identical to q1?

For every width w the prompt is prefilled with the band planner at cap w, planned as two parts
split at a resume point (so the run holds boundary downshifts, an unaligned resumed start and a
tail), then n_predict tokens are decoded greedily. Each run is compared with one q1 reference:
  - logits of every prompt position, bit for bit (uint32 views); max |delta| is a diagnostic only,
  - the SHA-256 of the response text,
  - for MoE models, the routed expert ids (`ffn_moe_topk-<layer>`) and their final weights
    (`ffn_moe_weights_scaled-<layer>`) of every prompt position and layer, bit for bit.
Width 1 is a second q1 run: it shows the reference is reproducible at all.

Each width w >= 2 also runs a fixed-width schedule: bands of exactly w tokens over both parts,
ignoring compressor boundaries (only the tail of each part is shorter). The planner never
decodes a band wider than the smallest compress ratio, so on DeepSeek V4 this is the run that
really exercises widths 5..8, i.e. the kernels a LUCE_MMVQ_MAX_NCOLS above 4 would use. A width
is exact only when both its planner run and its fixed-width run match q1.

Default resume point: the first position p > n/3 with p % 4 != 0 and p % 128 != 0, i.e. a
resumed start that is aligned to neither compressor ratio of DeepSeek V4.

Recommendation: the largest exact cap is the largest w such that every cap 1..w was run and is
exact (0 when even the q1 repeat differs); a cap that was not run is never vouched for. The
recommended cap (`--chunk`, and the LUCE_MMVQ_MAX_NCOLS value) is that cap limited to band
mode's maximum (4), and at least 1 (q1). The largest exact width is the widest band those exact
runs really decoded: the planner never exceeds the smallest compress ratio (4 on DeepSeek V4),
so on such a model the planner runs of caps 5..8 use the same bands as cap 4; their fixed-width
runs decode w-wide bands, so the largest exact width is the widest band of either run.

Wide bands: widths up to 4096 can be qualified; the per-width verdicts become a qualification
record (dflash/proof/records.py) that --chunk auto and --chunk N > 4 run from. The recommended
chunk is the widest width this run proves (what --chunk auto picks from its record), with the
band mode: fixed-width bands across compressor boundaries when the fixed-width runs prove it,
else the planner. A fixed-width run must really decode a band of its width: the prompt parts
before and after the resume point must be long enough (the default prompt is repeated until it
has more than 2 * widest + 8 tokens).

Length: the record's verdicts cover prompts of up to this prompt's length (records: `positions`);
a longer prompt is not vouched for (--chunk auto falls back, records.for_prompt). The coverage lists
the architecture's graph switches that flip at a position (dflash/native/graph_switches.py) among the
crossings: the compress ratios and the sliding window must be crossed; the others need not, and a
record whose prompt stops short of one covers nothing past it.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core import settings
from dflash.core.errors import UsageError, arg
from dflash.core.results import (
    Library,
    QualificationRef,
    QualifyReport,
    QualifyResult,
    RecordRef,
    RunCheck,
    WidthResult,
)
from dflash.core.trace import Row, Trace, bit_equal, comparable, first_differing_row
from dflash.native import graph_switches, llama
from dflash.proof import diff, provenance, records
from dflash.proof.evidence import EvidenceWriter
from dflash.run import prefill
from dflash.run.bands import BOUNDARY, START, TAIL, Band, fixed_bands, positive_ratios
from dflash.run.engine import Engine

DEFAULT_WIDTHS = (2, 3, 4, 5, 6, 7, 8)
ROUTING_NODE = re.compile(r"ffn_moe_(topk|weights_scaled)-(\d+)")
ROUTING_FIELD = {"topk": "expert_ids", "weights_scaled": "weights"}


def default_resume_point(n_tokens: int, ratios: Iterable[int] = (4, 128)) -> int:
    """The first position p > n/3 aligned to no compress ratio (p % 4 != 0 and p % 128 != 0 on
    DeepSeek V4)."""
    rs = positive_ratios(ratios)
    p = n_tokens // 3 + 1
    while any(p % r == 0 for r in rs):
        p += 1
    return p


def long_prompt(base: str, tokenize: Callable[[str], list[int]], widest: int) -> tuple[str, list[int]]:
    """`base` repeated until it has more than 2 * widest + 8 tokens (so that the part after the
    default resume point, about two thirds of the prompt, holds a band of the widest width)."""
    text = base
    tokens = tokenize(text)
    while len(tokens) <= 2 * widest + 8:
        text = f"{text} {base}"
        tokens = tokenize(text)
    return text, tokens


def verdicts(results: Iterable[WidthResult], evidence_dir: str | None = None,
             positions: int = 0) -> tuple[records.Verdict, ...]:
    """The qualification record's per-width verdicts from qualify's results (width 1: both runs
    are the q1 repeat); `positions`: the prompt's length, what they cover."""
    out = []
    for r in results:
        p, f = r.planner, r.fixed or r.planner
        out.append(records.Verdict(r.width, p.exact, p.widest_band, f.exact, f.widest_band, evidence_dir, positions))
    return tuple(out)


def recommend(exact_by_cap: dict[int, bool], widest_by_cap: dict[int, int] | None = None,
              max_cap: int = settings.MAX_BAND) -> dict:
    """The recommendation from per-cap verdicts (see the module doc); `widest_by_cap` is the widest
    band each cap's schedule really decoded (the planner may never reach a large cap)."""
    largest = 0
    while exact_by_cap.get(largest + 1) is True:
        largest += 1
    widest = max(((widest_by_cap or {}).get(w, w) for w in range(1, largest + 1)), default=0)
    cap = max(1, min(largest, max_cap))
    return {"largest_exact_cap": largest, "largest_exact_width": widest, "recommended_cap": cap,
            "recommended_bands": cap > 1, "recommended_mmvq_max_ncols": cap,
            "recommended_env": {settings.ENV_BANDS: "1" if cap > 1 else "0", settings.ENV_MMVQ: str(cap)}}


def coverage(n_tokens: int, ratios: Iterable[int], sliding_window: int | None, resume_at: int,
             plans: dict[int, list[Band]], fixed: dict[int, list[Band]] | None = None,
             switches: Iterable[tuple[str, int]] = ()) -> dict:
    """What the prompt and schedules cover; `missing` lists what a qualification needs but lacks.
    `switches`: the architecture's other position switches (graph_switches.position_switches):
    listed among the crossings, not required (a record covers no prompt longer than its own, so one
    the prompt does not cross is not vouched for)."""
    rs = positive_ratios(ratios)
    # crossed: the prompt holds the first position a boundary changes: r, the first to see a
    # ratio-r compressed row (emitted at r - 1), and sw, the first whose window drops position 0
    crossings = [{"what": f"compress ratio {r}", "position": r, "crossed": n_tokens > r} for r in rs]
    if sliding_window:
        crossings.append({"what": f"sliding window {sliding_window}", "position": sliding_window,
                          "crossed": n_tokens > sliding_window})
    crossings += [{"what": what, "position": p, "crossed": n_tokens > p} for what, p in switches]
    with_reason = {reason: sorted(w for w, plan in plans.items() if any(b.reason == reason for b in plan))
                   for reason in (START, TAIL, BOUNDARY)}
    unaligned = 0 < resume_at < n_tokens and all(resume_at % r for r in rs)
    required = len(rs) + (1 if sliding_window else 0)
    missing = [f"the prompt ({n_tokens} tokens) does not cross the {c['what']}" for c in crossings[:required]
               if not c["crossed"]]
    if not unaligned:
        missing.append(f"resume point {resume_at} is not an unaligned position inside the prompt")
    if rs and not with_reason[START]:
        missing.append(f"no cap's plan cuts a 'start' band at the resume point {resume_at} (pick "
                       f"--resume-at nearer below a boundary than the smallest cap, e.g. p % 4 == 3)")
    if not with_reason[TAIL]:
        missing.append("no cap's plan ends a part with a 'tail' band")
    short = sorted(w for w, bands in (fixed or {}).items() if max(b.width for b in bands) < w)
    if short:
        missing.append(f"no fixed-width run of width {_ws(short)} decodes a band that wide (the parts before "
                       f"and after the resume point {resume_at} are shorter)")
    return {"n_tokens": n_tokens, "ratios": list(rs), "sliding_window": sliding_window,
            "crossings": crossings, "resume_at": resume_at, "resume_unaligned": unaligned,
            "widths_with_start_band": with_reason[START], "widths_with_tail_band": with_reason[TAIL],
            "widths_with_boundary_band": with_reason[BOUNDARY], "widths_not_decoded": short,
            "missing": missing}


def _ws(ws: list[int]) -> str:
    return ",".join(map(str, ws))


def schedule_summary(bands: list[Band]) -> dict:
    return {"n_bands": len(bands),
            "widths": {str(w): c for w, c in sorted(Counter(b.width for b in bands).items(), reverse=True)},
            "reasons": dict(sorted(Counter(b.reason for b in bands).items()))}


def routing_rows(row_map: dict[str, Row]) -> dict[tuple[int, str], Row]:
    """(layer, field) -> row for the routing nodes among one position's rows."""
    out = {}
    for r in row_map.values():
        m = ROUTING_NODE.fullmatch(r.name)
        if m and r.key == r.name:
            out[(int(m.group(2)), ROUTING_FIELD[m.group(1)])] = r
    return out


def routing_layers(trace: Trace) -> list[int]:
    return sorted({layer for pos in trace for layer, _ in routing_rows(pos)})


def first_routing_diff(ref: Trace, other: Trace) -> dict | None:
    """The first (position, layer) whose expert ids or weights differ from ref, or are missing."""
    for p, (a, b) in enumerate(zip(ref, other, strict=False)):
        ra, rb = routing_rows(a), routing_rows(b)
        for layer, fld in sorted(ra):
            x, y = ra[(layer, fld)], rb.get((layer, fld))
            if y is None or not comparable(x, y):
                return {"position": p, "layer": layer, "field": fld, "problem": "missing"}
            if not bit_equal(x.values, y.values):
                return {"position": p, "layer": layer, "field": fld, "problem": "differs",
                        "reference": x.values.tolist(), "value": y.values.tolist()}
    return None


@dataclass
class Run:
    label: str
    width: int                # the planner's cap (1 for the q1 runs)
    bands: list[Band]
    result: prefill.RequestOutput
    routing: Trace


def run_schedule(eng: Engine, tap: llama.GraphTap, label: str, width: int, tokens: list[int],
                 bands: list[Band], n_predict: int,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> Run:
    """One cache-cold request with the routing nodes of every band tapped."""
    r, trace = diff.traced_request(eng, tap, tokens, bands, n_predict, progress, strict=False)
    return Run(label, width, bands, r, trace)


def compare(ref: Run, run: Run, moe: bool) -> RunCheck:
    assert ref.result.logits is not None and run.result.logits is not None  # kept by diff.traced_request
    first, n_rows, max_d = first_differing_row(ref.result.logits, run.result.logits)
    routing = first_routing_diff(ref.routing, run.routing) if moe else None
    same_response = run.result.response_sha256 == ref.result.response_sha256
    exact = first is None and same_response and routing is None
    return RunCheck(width=run.width, label=run.label, schedule=schedule_summary(run.bands),
                    widest_band=max(b.width for b in run.bands), exact=exact, logits_identical=first is None,
                    first_diff_position=first, n_positions_differing=n_rows,
                    max_abs_diff=max_d if math.isfinite(max_d) else None,
                    logits_sha256=run.result.logits_sha256, response_sha256=run.result.response_sha256,
                    response_identical=same_response, routing_identical=(routing is None) if moe else None,
                    first_routing_diff=routing, prefill_seconds=run.result.prefill_seconds)


def request_record(run: Run, exact: bool) -> dict:
    r = run.result
    return {"label": run.label, "width": run.width, "n_bands": len(run.bands),
            "prompt_sha256": r.prompt_sha256, "logits_sha256": r.logits_sha256,
            "response_sha256": r.response_sha256, "response_tokens_sha256": r.response_tokens_sha256,
            "prefill_seconds": r.prefill_seconds, "exact": exact}


def qualify(eng: Engine, tap: llama.GraphTap, tokens: list[int], widths: Iterable[int] = DEFAULT_WIDTHS,
            resume_at: int | None = None, n_predict: int = 8,
            progress: Callable[[int, int], None] = lambda done, total: None
            ) -> tuple[QualifyReport, dict[str, Any]]:
    """Run q1 and every width; returns (report, requests) for output and evidence."""
    n = len(tokens)
    ws = sorted({1, *widths})
    if ws[0] < 1:
        raise UsageError(f"{arg('widths')} must be >= 1, got {ws[0]}")
    resume_at = default_resume_point(n, eng.info.compress_ratios) if resume_at is None else resume_at
    if not 0 < resume_at < n:
        raise UsageError(f"the resume point {resume_at} must be inside the prompt (1..{n - 1}); "
                         f"the prompt has {n} tokens")
    plans = {w: eng.request_bands(n, resume_at, cap=w, bands_on=True) for w in ws}
    m = eng.settings.mmvq_max_ncols
    fixed = {w: fixed_bands(resume_at, w, mmvq_max_ncols=m) + fixed_bands(n - resume_at, w, resume_at, m)
             for w in ws if w > 1}
    eng.context_size(n, n_predict, None)  # fail early when it does not fit
    arch = eng.info.architecture
    switches = graph_switches.position_switches(arch, graph_switches.read_meta(eng.info.path, arch))
    cov = coverage(n, eng.info.compress_ratios, eng.info.sliding_window, resume_at, plans, fixed, switches)
    if cov["missing"]:
        raise UsageError("the prompt/schedules do not cover what qualify checks: " + "; ".join(cov["missing"])
                         + " (use a longer --prompt, other --widths or --resume-at)")
    total = n * (len(ws) + len(fixed) + 1)

    def step(i: int) -> Callable[[int, int], None]:
        return lambda done, _n: progress(i * n + done, total)

    ref = run_schedule(eng, tap, "q1 reference", 1, tokens, eng.request_bands(n, resume_at, bands_on=False),
                       n_predict, step(0))
    moe = bool(routing_layers(ref.routing))
    results, requests = [], [request_record(ref, True)]
    k = 0
    for w in ws:
        k += 1
        run = run_schedule(eng, tap, "q1 repeat" if w == 1 else f"cap {w}", w, tokens, plans[w],
                           n_predict, step(k))
        planner = compare(ref, run, moe)
        requests.append(request_record(run, planner.exact))
        del run  # its logits (GBs at wide widths on a large vocabulary) are not needed any more
        f = None
        if w in fixed:
            k += 1
            frun = run_schedule(eng, tap, f"fixed {w}", w, tokens, fixed[w], n_predict, step(k))
            f = compare(ref, frun, moe)
            requests.append(request_record(frun, f.exact))
            del frun
        results.append(WidthResult(planner, f))
    rec = recommend({r.width: r.exact for r in results}, {r.width: r.widest_band for r in results})
    chunk, mode = records.widest_proven(verdicts(results))
    report = QualifyReport(
        model=eng.info.path, architecture=eng.info.architecture,
        library=Library(eng.settings.lib, str(eng.lib_dir), eng.settings.cpu), threads=eng.threads, n_tokens=n,
        n_predict=n_predict, resume_at=resume_at, widths=tuple(ws), coverage=cov, moe=moe,
        routing_layers=tuple(routing_layers(ref.routing)),
        reference=request_record(ref, True) | {"response_tokens": ref.result.response_tokens},
        results=tuple(results), recommended_chunk=chunk, recommended_band_mode=mode,
        uncovered_weight_types=eng.uncovered_weight_types, devices=eng.placement, **rec)
    return report, {"requests": requests, "exact_requests": [q for q in requests if q["exact"]]}


def qualify_and_record(eng: Engine, text: str, tokens: list[int], writer: EvidenceWriter,
                       widths: Iterable[int] = DEFAULT_WIDTHS,
                       resume_at: int | None = None, n_predict: int = 8, device: str = "cpu",
                       progress: Callable[[int, int], None] = lambda done, total: None,
                       warn: Callable[[str], None] = lambda msg: None) -> QualifyResult:
    """qualify(), then its verdicts as the qualification record of this library, model and device:
    a copy goes into the open EvidenceWriter `writer` (committed here with the provenance, results
    and requests), the record in the user cache is merged with it."""
    ident = records.identity(eng.settings, eng.info.path, device, eng.remote, eng.repack)
    tap = llama.GraphTap(lambda name: ROUTING_NODE.fullmatch(name) is not None)
    report, requests = qualify(eng, tap, tokens, widths, resume_at, n_predict, progress)
    record = records.Record(ident, str(eng.info.path), records.now_utc(),
                           verdicts(report.results, str(writer.final_dir), len(tokens)))
    writer.write_bytes(records.FILE_NAME, records.render(record))
    ref = RecordRef(str(records.record_path(ident)), ident.key, records.FILE_NAME)
    directory, sha = write_evidence(writer, provenance.provenance(eng, None, text, tokens), report, ref, requests)
    stored = records.save(record, warn)
    width, mode = records.widest_proven(stored.widths)
    return QualifyResult(report, QualificationRef(ref, width, mode, tuple(v.width for v in stored.widths)),
                         str(directory), sha)


def write_evidence(ev: EvidenceWriter, provenance: dict[str, dict[str, Any]], report: QualifyReport,
                   record: RecordRef, requests: dict[str, Any]) -> tuple[Path, str]:
    """Fill an open EvidenceWriter with provenance records, results.json (the report and where its
    record went) and requests.json and commit it; returns (dir, manifest sha256)."""
    for name, rec in provenance.items():
        ev.write_json(name, rec)
    ev.write_json("results.json", {**report.to_json(), "qualification": record.to_json()})
    ev.write_json("requests.json", requests)
    ev.add_hash_check("requests.json", "requests", "prompt_sha256")
    ev.add_hash_check("requests.json", "exact_requests", "logits_sha256")
    ev.add_hash_check("requests.json", "exact_requests", "response_sha256")
    return ev.commit()
