"""`dflash sweep`: prefill throughput per llama.cpp library and band width, side by side.

One worker process per library (dflash.worker: a Session in a child; a process loads one library). The parent
sends one request at a time and waits for its answer, so at most one worker computes at any
moment (ggml's threads spin while they work: two busy llama.cpp processes on a few cores slow
each other down many times over); an idle worker blocks on its stdin and uses no CPU.

Order: per library, one untimed verification request per width (logits of every position and a
short response; a width is exact when both SHA-256 equal that library's width-1 request), then
`warmup` untimed rounds and `runs` timed rounds. In a round every library runs every width once,
the libraries of a width back to back, their order alternating width by width and round by round.
Every request is cache-cold and prefills the whole prompt in fixed-width bands (compressor
boundaries ignored); timed requests keep the last
position's logits only. The timing window is the band loop: every llama_decode of the prompt
plus copying and hashing its logits (as prefill.run measures).

With `decode` N > 0 every round also has, per library, a decode request: the prompt prefilled at
the widest width, then N greedy tokens one llama_decode each, timed over those decodes alone
(decode tokens/s after a prompt of that length, the step a served response repeats).
"""
from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.core import stats
from dflash.core.errors import DflashError, UsageError, arg
from dflash.core.paths import FLAVORS
from dflash.core.results import PrefillResult
from dflash.core.settings import Settings
from dflash.model.tiny_model import DEFAULT_WEIGHTS
from dflash.proof.evidence import EvidenceWriter
from dflash.run.prefill import sha256_tokens
from dflash.worker import Worker

DEFAULT_WIDTHS = "1,4,64,512"
DEFAULT_LIBS = "exact,stock"
VERIFY_N_PREDICT = 4
REFERENCE_LIB = "stock"  # speedups are against this library's q1 (width 1)

Log = Callable[[str], None]


def parse_widths(text: str) -> tuple[int, ...]:
    """'1,4,64,512' -> (1, 4, 64, 512): sorted, distinct, each >= 1. Width 1 (q1, the exactness
    reference) is always measured, so it is added when missing."""
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"{arg('widths')} {text!r} must be comma-separated positive integers, e.g. 1,4,64,512")
    widths = {int(p) for p in parts}
    if 0 in widths:
        raise UsageError(f"{arg('widths')} {text!r}: every width must be >= 1")
    return tuple(sorted(widths | {1}))


def parse_libs(text: str) -> tuple[str, ...]:
    """'exact,stock' -> ('exact', 'stock'), in the order given, each once."""
    libs = [p.strip() for p in str(text).split(",")]
    if not any(libs):
        raise UsageError(f"{arg('libs')} is empty (use {', '.join(FLAVORS)})")
    unknown = [lib for lib in libs if lib not in FLAVORS]
    if unknown:
        raise UsageError(f"{arg('libs')} {text!r}: unknown library {unknown[0]!r} (use {', '.join(FLAVORS)})")
    return tuple(dict.fromkeys(libs))


def clamp_widths(widths: tuple[int, ...], n_tokens: int) -> tuple[tuple[int, ...], list[str]]:
    """Widths wider than the prompt decode fewer tokens than they name: clamp them to it."""
    if max(widths) <= n_tokens:
        return widths, []
    clamped = tuple(sorted({min(w, n_tokens) for w in widths}))
    return clamped, [f"the prompt has {n_tokens} tokens: widths "
                     f"{', '.join(str(w) for w in widths if w > n_tokens)} clamped to {n_tokens}"]


@dataclass(frozen=True)
class Sample:
    """One request's answer."""
    lib: str
    width: int
    kind: str  # "verify" (untimed, every position's logits), "warmup" or "timed"
    round: int
    prefill_seconds: float
    tokens_per_second: float
    logits_sha256: str
    response_sha256: str
    n_bands: int
    decode_tokens_per_second: float = 0.0  # kind "decode": response tokens / their decode time

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Row:
    lib: str
    width: int
    samples: tuple[float, ...]
    median: float
    mad: float
    exact: bool            # verification hashes equal this library's width-1 verification
    n_bands: int
    logits_sha256: str     # of the verification request (every position)
    response_sha256: str
    speedup_vs_stock_q1: float | None  # median / the stock library's width-1 median
    speedup_vs_lib_q1: float           # median / this library's width-1 median

    def to_json(self) -> dict:
        return {"lib": self.lib, "width": self.width, "median_tokens_per_second": self.median,
                "mad": self.mad, "exact": self.exact, "samples": list(self.samples), "n": len(self.samples),
                "n_bands": self.n_bands, "speedup_vs_stock_q1": self.speedup_vs_stock_q1,
                "speedup_vs_lib_q1": self.speedup_vs_lib_q1, "logits_sha256": self.logits_sha256,
                "response_sha256": self.response_sha256}


@dataclass(frozen=True)
class Tax:
    """What exactness costs at one width: the exact library's median over the stock one's, and per
    round the ratio of the two requests measured back to back (their median is the steadier figure
    on a machine whose speed drifts)."""
    width: int
    exact_median: float
    stock_median: float
    paired: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        return self.exact_median / self.stock_median

    @property
    def paired_median(self) -> float | None:
        return stats.median(list(self.paired)) if self.paired else None

    def to_json(self) -> dict:
        return {"width": self.width, "exact_median": self.exact_median, "stock_median": self.stock_median,
                "exact_over_stock": self.ratio, "paired_ratios": list(self.paired),
                "median_paired_ratio": self.paired_median}


@dataclass(frozen=True)
class DecodeRow:
    """Decode tokens/s after the prompt, per library (timed decode requests)."""
    lib: str
    samples: tuple[float, ...]
    median: float
    mad: float

    def to_json(self) -> dict:
        return {"lib": self.lib, "median_tokens_per_second": self.median, "mad": self.mad,
                "samples": list(self.samples), "n": len(self.samples)}


@dataclass
class SweepResult:
    libs: tuple[str, ...]
    widths: tuple[int, ...]
    runs: int
    warmup: int
    threads: int
    n_prompt_tokens: int
    prompt_repeats: int
    model: str
    rows: list[Row]
    taxes: list[Tax]
    stock_q1_median: float | None
    warnings: list[str] = field(default_factory=list)
    cpu: str = "native"  # the CPU build variant both libraries ran (--cpu)
    decode_tokens: int = 0  # --decode: greedy tokens per decode request (0: none measured)
    decode: list[DecodeRow] = field(default_factory=list)
    decode_paired: tuple[float, ...] = ()  # per round: exact decode tokens/s over stock's, back to back

    @property
    def decode_ratio(self) -> float | None:
        """Decode tokens/s of the exact library over the stock one's (medians), when both ran."""
        by = {d.lib: d.median for d in self.decode}
        return by["exact"] / by["stock"] if by.get("exact") and by.get("stock") else None

    @property
    def decode_paired_median(self) -> float | None:
        """The median of the rounds' paired decode ratios (exact / stock, back to back)."""
        return stats.median(list(self.decode_paired)) if self.decode_paired else None

    def row(self, lib: str, width: int) -> Row:
        return next(r for r in self.rows if r.lib == lib and r.width == width)

    @property
    def exact_library_exact(self) -> bool:
        """Every width of the exact library equals its q1 (vacuously true without it)."""
        return all(r.exact for r in self.rows if r.lib == "exact")

    def to_json(self) -> dict:
        return {"unit": "prefill tokens/s", "libs": list(self.libs), "widths": list(self.widths),
                "runs": self.runs, "warmup": self.warmup, "threads": self.threads,
                "n_prompt_tokens": self.n_prompt_tokens, "prompt_repeats": self.prompt_repeats,
                "model": self.model, "cpu": self.cpu, "rows": [r.to_json() for r in self.rows],
                "exactness_tax": [t.to_json() for t in self.taxes], "stock_q1_median": self.stock_q1_median,
                "exact_library_exact": self.exact_library_exact, "warnings": list(self.warnings),
                "decode_tokens": self.decode_tokens, "decode": [d.to_json() for d in self.decode],
                "decode_exact_over_stock": self.decode_ratio, "decode_paired_ratios": list(self.decode_paired),
                "decode_median_paired_ratio": self.decode_paired_median}


def summarize(samples: list[Sample], libs: Sequence[str], widths: Sequence[int]
              ) -> tuple[list[Row], list[Tax], float | None]:
    """Rows (per library and width: timed medians, MAD, exactness), taxes, the stock q1 median."""
    timed = {(lib, w): [s.tokens_per_second for s in samples if (s.lib, s.width, s.kind) == (lib, w, "timed")]
             for lib in libs for w in widths}
    verify = {(s.lib, s.width): s for s in samples if s.kind == "verify"}
    medians = {k: stats.median(v) for k, v in timed.items()}
    stock_q1 = medians.get((REFERENCE_LIB, 1))
    rows = []
    for lib in libs:
        ref = verify[(lib, 1)]
        for w in widths:
            v, med = verify[(lib, w)], medians[(lib, w)]
            rows.append(Row(lib, w, tuple(timed[(lib, w)]), med, stats.mad(timed[(lib, w)]),
                            (v.logits_sha256, v.response_sha256) == (ref.logits_sha256, ref.response_sha256),
                            v.n_bands, v.logits_sha256, v.response_sha256,
                            med / stock_q1 if stock_q1 else None, med / medians[(lib, 1)]))
    taxes = [Tax(w, medians[("exact", w)], medians[("stock", w)], paired_ratios(samples, "timed", w))
             for w in widths if ("exact", w) in medians and ("stock", w) in medians]
    return rows, taxes, stock_q1


def paired_ratios(samples: list[Sample], kind: str, width: int | None = None) -> tuple[float, ...]:
    """Per round (in round order) the exact library's tokens/s over the stock one's, for the
    requests of `kind` (and `width`) that round; rounds missing either library are left out."""
    def tps(s: Sample) -> float:
        return s.decode_tokens_per_second if kind == "decode" else s.tokens_per_second
    by = {(s.lib, s.round): tps(s) for s in samples if s.kind == kind and width in (None, s.width)}
    rounds = sorted({r for _, r in by})
    return tuple(by[("exact", r)] / by[("stock", r)] for r in rounds
                 if by.get(("exact", r)) and by.get(("stock", r)))


def summarize_decode(samples: list[Sample], libs: Sequence[str]) -> list[DecodeRow]:
    """Per library: the timed decode requests' tokens/s, median and MAD (none without them)."""
    out = []
    for lib in libs:
        tps = [s.decode_tokens_per_second for s in samples if (s.lib, s.kind) == (lib, "decode")]
        if tps:
            out.append(DecodeRow(lib, tuple(tps), stats.median(tps), stats.mad(tps)))
    return out


# --------------------------------------------------------------------------------------------
# worker processes


def repeat_to(tokenize: Callable[[str], list[int]], text: str, need: int) -> tuple[str, list[int], int]:
    """The text repeated (joined by spaces) the fewest times that give at least `need` tokens:
    (text, tokens, repeats)."""
    rep = lambda k: " ".join([text] * k)
    tokens, k = tokenize(text), 1
    while len(tokens) < need:  # jump by the estimate, then step back to the fewest repeats
        k = max(k + 1, -(-k * need // max(len(tokens), 1)))
        tokens = tokenize(rep(k))
    while k > 1 and len(fewer := tokenize(rep(k - 1))) >= need:
        k, tokens = k - 1, fewer
    return rep(k), tokens, k


class LibraryRun:
    """One library's worker process (dflash.worker: a Session in a child) and the prompt it runs:
    the plan's text repeated to the widest width (or to `prompt_tokens`, then cut to exactly that
    many), cut to the model's context if need be."""

    def __init__(self, lib: str, plan: Plan):
        self.lib = lib
        self.worker = Worker(settings=plan.settings, lib=lib, model=plan.model,
                             weights=plan.weights or DEFAULT_WEIGHTS, threads=plan.threads,
                             bands=True, max_band=max(plan.widths), device=plan.device)
        try:
            need = max(max(plan.widths), plan.prompt_tokens or 0)
            text, tokens, repeats = repeat_to(self.worker.tokenize, plan.prompt, need)
            if plan.prompt_tokens:
                tokens = tokens[:need]
            info = self.worker.info
            self.decode = plan.decode
            limit = info["n_ctx_train"] or info["context_length"] or 0
            truncated_from = None
            tail = max(VERIFY_N_PREDICT, plan.decode)
            if limit and len(tokens) + tail > limit:
                truncated_from = len(tokens)
                tokens = tokens[:max(limit - tail, 1)]
            self.tokens = tokens
            self.ready = {"n_tokens": len(tokens), "tokens_sha256": sha256_tokens(tokens), "repeats": repeats,
                          "truncated_from": truncated_from, "threads": info["threads"],
                          "provenance": self.worker.provenance(text, tokens)}
        except BaseException:
            self.worker.close()
            raise

    def run(self, width: int, kind: str) -> PrefillResult:
        """One cache-cold request in fixed-width bands of `width`: "verify" hashes every position's
        logits and decodes a short response, the others the last position only and nothing."""
        verify = kind == "verify"
        decode = kind in ("decode", "decode-warmup")
        n_predict = self.decode if decode else VERIFY_N_PREDICT if verify else 0
        return self.worker.prefill(self.tokens, schedule=f"w{width}", n_predict=n_predict,
                                   logits="all" if verify else "last",
                                   ctx=len(self.tokens) + max(VERIFY_N_PREDICT, self.decode))

    def close(self) -> None:
        self.worker.close()


@dataclass
class Plan:
    libs: tuple[str, ...]
    widths: tuple[int, ...]
    runs: int
    warmup: int
    prompt: str
    model: str | None = None
    weights: str | None = None
    threads: int | None = None
    settings: Settings | None = None  # the environment flags (Settings.from_env()) for every worker
    prompt_tokens: int | None = None  # repeat the prompt to this many tokens (then cut to exactly them)
    decode: int = 0                   # greedy tokens per decode request (0: no decode requests)
    device: str = "cpu"               # --device of every worker (one GPU: no RPC, no split with the CPU)


@dataclass
class Measurement:
    samples: list[Sample]
    widths: tuple[int, ...]
    ready: dict[str, dict]  # lib -> the worker's ready answer (prompt, threads, provenance)
    warnings: list[str]


def schedule(libs: tuple[str, ...], widths: Sequence[int], warmup: int, runs: int,
             decode: bool = False) -> list[tuple[str, int, str, int]]:
    """(lib, width, kind, round) in run order: verification per library, then warm-up and timed
    rounds, each round every width once on every library, the libraries of one width back to back
    (a pair measured seconds apart, whatever a shared machine's speed does over a round) in an
    order that alternates width by width and round by round; with `decode`, each round ends with
    one decode request per library (prefilled at the widest width)."""
    todo = [(lib, w, "verify", 0) for lib in libs for w in widths]
    for i in range(warmup + runs):
        kind, rnd = ("warmup", i) if i < warmup else ("timed", i - warmup)
        for j, w in enumerate(widths):
            todo += [(lib, w, kind, rnd) for lib in (libs if (i + j) % 2 == 0 else tuple(reversed(libs)))]
        if decode:
            order = libs if (i + len(widths)) % 2 == 0 else tuple(reversed(libs))
            todo += [(lib, max(widths), "decode-warmup" if i < warmup else "decode", rnd) for lib in order]
    return todo


def measure(plan: Plan, progress: Callable[[int, int], None] = lambda d, t: None,
            log: Log = lambda s: None) -> Measurement:
    workers: dict[str, LibraryRun] = {}
    try:
        for lib in plan.libs:  # one after the other: the first may write the built-in model
            log(f"starting the {lib} worker")
            workers[lib] = LibraryRun(lib, plan)
        ready = {lib: w.ready for lib, w in workers.items()}
        prompts = {(r["n_tokens"], r["tokens_sha256"]) for r in ready.values()}
        if len(prompts) != 1:
            raise DflashError(f"the libraries tokenized the prompt differently: {sorted(prompts)}")
        first = next(iter(ready.values()))
        widths, warnings = clamp_widths(plan.widths, first["n_tokens"])
        if first["truncated_from"]:
            warnings.insert(0, f"the prompt ({first['truncated_from']} tokens) was cut to {first['n_tokens']} "
                               f"to fit the model's context")
        todo = schedule(plan.libs, widths, plan.warmup, plan.runs, decode=plan.decode > 0)
        samples = []
        for k, (lib, width, kind, rnd) in enumerate(todo):
            a = workers[lib].run(width, kind)
            timed_decode = kind.startswith("decode") and a.decode_seconds > 0
            dtps = len(a.response_tokens) / a.decode_seconds if timed_decode else 0.0
            samples.append(Sample(lib, width, kind, rnd, a.prefill_seconds, a.prefill_tokens_per_second,
                                  a.logits_sha256, a.response_sha256, len(a.widths), dtps))
            progress(k + 1, len(todo))
    finally:
        for worker in workers.values():
            worker.close()
    return Measurement(samples, widths, ready, warnings)


def result(plan: Plan, m: Measurement) -> SweepResult:
    rows, taxes, stock_q1 = summarize(m.samples, plan.libs, m.widths)
    first = m.ready[plan.libs[0]]
    return SweepResult(plan.libs, m.widths, plan.runs, plan.warmup, first["threads"], first["n_tokens"],
                       first["repeats"], first["provenance"]["model.json"]["path"], rows, taxes, stock_q1,
                       list(m.warnings), plan.settings.cpu if plan.settings else "native", plan.decode,
                       summarize_decode(m.samples, plan.libs), paired_ratios(m.samples, "decode"))


# --------------------------------------------------------------------------------------------
# plot and evidence


def plot_png(r: SweepResult) -> bytes:
    """Tokens/s against width (log2 axis), one line per library; non-exact widths marked x."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.add_subplot()
    for lib in r.libs:
        rows = [x for x in r.rows if x.lib == lib]
        line, = ax.plot([x.width for x in rows], [x.median for x in rows], marker="o", label=f"{lib} library")
        ax.errorbar([x.width for x in rows], [x.median for x in rows], yerr=[x.mad for x in rows],
                    fmt="none", ecolor=line.get_color(), capsize=3)
        bad = [x for x in rows if not x.exact]
        if bad:
            ax.scatter([x.width for x in bad], [x.median for x in bad], marker="x", s=90, color="red",
                       zorder=3, label=f"{lib}: differs from its q1")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(r.widths), [str(w) for w in r.widths])
    ax.set_xlabel("band width (tokens per llama_decode)")
    ax.set_ylabel("prefill tokens/s (median, MAD bars)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"prefill, {r.n_prompt_tokens} tokens, {r.threads} threads, {r.runs} timed rounds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def write_evidence(w: EvidenceWriter, argv: list[str], options: dict[str, Any], m: Measurement, r: SweepResult,
                   png: bytes) -> tuple[Path, str]:
    """Fill an open EvidenceWriter and commit it; returns (dir, manifest sha256)."""
    from dflash.proof.provenance import machine_facts
    first = m.ready[r.libs[0]]["provenance"]
    w.write_json("command.json", {**first["command.json"], "argv": list(argv)})
    w.write_json("machine.json", machine_facts())
    w.write_json("options.json", options)
    for lib in r.libs:
        for name, rec in m.ready[lib]["provenance"].items():
            if name not in ("command.json", "machine.json"):
                w.write_json(f"{lib}/{name}", rec)
    w.write_json("requests.json", {"requests": [s.to_json() for s in m.samples]})
    w.write_json("verification.json", {"libs": {lib: [s.to_json() for s in m.samples
                                                      if s.lib == lib and s.kind == "verify"]
                                                for lib in r.libs}})
    if "exact" in r.libs:  # the exact library's claim: every width equals its q1
        w.add_hash_check("verification.json", "libs.exact", "logits_sha256")
        w.add_hash_check("verification.json", "libs.exact", "response_sha256")
    w.write_json("results.json", r.to_json())
    w.write_bytes("sweep.png", png)
    return w.commit()
