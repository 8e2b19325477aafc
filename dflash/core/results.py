"""The commands' results as frozen dataclasses, each with exactly one JSON form (`to_json()`).

`--json` prints `to_json()` of one of these (through cli.output.emit_json, which turns NaN and
infinities into null); the human views read the same objects. Every key of a type is always
present: a part that does not apply is null (e.g. prefill's `q1` without --compare-q1, a matrix
row's hashes when its process did not run, `fixed_width` at width 1).

    PrefillResult   dflash prefill      (+ Q1Comparison with --compare-q1; PrefillResult.from_json
                                         reads a child's `prefill --json` back, for matrix)
    BenchResult     dflash bench        (BenchSummary is what the evidence's summary.json holds)
    QualifyResult   dflash qualify      (QualifyReport is what the evidence's results.json holds)
    DiffResult      dflash diff
    MatrixResult    dflash matrix
    RpcServerResult dflash rpc-server   (printed once the server answers its own handshake)
    MemoryResult    dflash memory       (rows: dflash.run.memory.MemoryRow)

`library` has one shape everywhere: Library, {"flavor": "exact"|"stock", "dir": <folder>|null}.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dflash.core.errors import DflashError, NotExactError
from dflash.core.settings import Qualified
from dflash.core.trace import NodeDiff

Json = dict[str, Any]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Library:
    """The llama.cpp library a result ran on: its flavor and the folder it was loaded from (None
    where no process loaded it, e.g. a matrix row that failed to start)."""
    flavor: str
    dir: str | None
    cpu: str = "native"  # the CPU build variant (--cpu)

    def to_json(self) -> Json:
        return {"flavor": self.flavor, "dir": self.dir, "cpu": self.cpu}


def _qualification(q: Qualified | None) -> Json | None:
    return q.to_json() if q is not None else None


# ---------------------------------------------------------------------------------------------
# prefill

@dataclass(frozen=True)
class Q1Run:
    """The q1 (one token per decode) run of the same request."""
    logits_sha256: str
    response_sha256: str
    prefill_seconds: float
    prefill_tokens_per_second: float

    def to_json(self) -> Json:
        return {"logits_sha256": self.logits_sha256, "response_sha256": self.response_sha256,
                "prefill_seconds": self.prefill_seconds,
                "prefill_tokens_per_second": self.prefill_tokens_per_second}


@dataclass(frozen=True)
class Q1Comparison:
    """A band run against the q1 run of the same request (prefill --compare-q1)."""
    q1: Q1Run
    identical: bool         # q1's logits and response hashes equal the band run's
    speedup: float | None   # q1 prefill seconds / band prefill seconds (None: the band run took 0 s)

    def to_json(self) -> Json:
        """The keys it adds to the prefill result."""
        return {"q1": self.q1.to_json(), "identical_to_q1": self.identical, "speedup_vs_q1": self.speedup}


_NO_COMPARISON: Json = {"q1": None, "identical_to_q1": None, "speedup_vs_q1": None}


@dataclass(frozen=True)
class SpecComparison:
    """The same request decoded with speculation (prefill --spec) against plain greedy decoding:
    the speculative response's tokens hash and that of the logits each token was chosen from (the
    verification batches' rows, against plain decoding's one-token rows), how many drafted tokens
    were accepted, how rejected ones were undone (cache cut to a prefix, or a saved state
    restored), and both decode times."""
    spec: str
    response_tokens_sha256: str
    response_logits_sha256: str  # the logits each response token was chosen from (verification batch rows)
    identical: bool              # tokens and those logits equal plain greedy decoding's, bit for bit
    drafted: int
    accepted: int
    batches: int
    truncations: int
    restores: int
    decode_seconds: float        # with speculation
    plain_decode_seconds: float  # the plain run of the same request, just before

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def decode_speedup(self) -> float | None:
        return self.plain_decode_seconds / self.decode_seconds if self.decode_seconds else None

    def to_json(self) -> Json:
        return {"spec": self.spec, "response_tokens_sha256": self.response_tokens_sha256,
                "response_logits_sha256": self.response_logits_sha256, "identical_to_plain": self.identical,
                "drafted": self.drafted, "accepted": self.accepted,
                "rejected": self.drafted - self.accepted, "acceptance_rate": self.acceptance_rate,
                "batches": self.batches, "truncations": self.truncations, "restores": self.restores,
                "decode_seconds": self.decode_seconds, "plain_decode_seconds": self.plain_decode_seconds,
                "decode_speedup": self.decode_speedup}

    @classmethod
    def from_fields(cls, f: _Fields) -> SpecComparison:
        return cls(f.text("spec"), f.text("response_tokens_sha256"), f.text("response_logits_sha256"),
                   f.boolean("identical_to_plain"),
                   f.integer("drafted"), f.integer("accepted"), f.integer("batches"), f.integer("truncations"),
                   f.integer("restores"), f.number("decode_seconds"), f.number("plain_decode_seconds"))


@dataclass(frozen=True)
class PrefillResult:
    model: str
    architecture: str
    library: Library
    bands_on: bool
    chunk: int
    chunk_requested: int | str   # an int, or "auto"
    band_mode: str               # "planner" or "fixed"
    mmvq_max_ncols: int
    qualification: Qualified | None
    threads: int
    n_ctx: int
    device: str
    widths: tuple[int, ...]
    n_prompt_tokens: int
    prefill_seconds: float
    prefill_tokens_per_second: float
    decode_seconds: float
    prompt_sha256: str
    logits_sha256: str
    response_tokens: tuple[int, ...]
    response_tokens_sha256: str
    response_text: str
    response_sha256: str
    warnings: tuple[str, ...]
    comparison: Q1Comparison | None = None  # with --compare-q1
    uncovered_weight_types: dict[str, int] = field(default_factory=dict)  # outside the narrow path (hip only)
    devices: tuple[Json, ...] = ({"id": "cpu"},)  # every --device part; RPC ones with endpoint and build
    repack: bool = True   # weights in llama.cpp's extra CPU buffer types (AMX, repacked); --no-repack, RPC: no
    indexer_shortcut: bool = False  # the loaded library applies DeepSeek-V4's all-pooled indexer shortcut
    indexer_tile: int = 0           # the DeepSeek-V4 indexer tile the loaded library applies (0: none)
    memory_budget: Json | None = None  # --memory-budget: the budget, the width and its no_alloc estimate
    speculation: SpecComparison | None = None  # with --spec

    def to_json(self) -> Json:
        return {
            "model": self.model, "architecture": self.architecture, "library": self.library.to_json(),
            "bands_on": self.bands_on, "chunk": self.chunk, "chunk_requested": self.chunk_requested,
            "band_mode": self.band_mode, "mmvq_max_ncols": self.mmvq_max_ncols,
            "qualification": _qualification(self.qualification),
            "threads": self.threads, "n_ctx": self.n_ctx, "device": self.device,
            "widths": list(self.widths), "n_prompt_tokens": self.n_prompt_tokens,
            "prefill_seconds": self.prefill_seconds, "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "decode_seconds": self.decode_seconds,
            "prompt_sha256": self.prompt_sha256, "logits_sha256": self.logits_sha256,
            "response_tokens": list(self.response_tokens), "response_tokens_sha256": self.response_tokens_sha256,
            "response_text": self.response_text, "response_sha256": self.response_sha256,
            "warnings": list(self.warnings),
            "uncovered_weight_types": dict(self.uncovered_weight_types),
            "devices": [dict(d) for d in self.devices], "repack": self.repack,
            "indexer_shortcut": self.indexer_shortcut, "indexer_tile": self.indexer_tile,
            "memory_budget": self.memory_budget,
            "speculation": self.speculation.to_json() if self.speculation is not None else None,
            **(self.comparison.to_json() if self.comparison is not None else _NO_COMPARISON),
        }

    def check_exact(self) -> None:
        """NotExactError when the q1 comparison (compare_q1) found different hashes, or the
        speculative response differs from plain greedy decoding's."""
        if self.comparison is not None and not self.comparison.identical:
            raise NotExactError("the band schedule's hashes differ from q1: this build/schedule is not exact")
        if self.speculation is not None and not self.speculation.identical:
            raise NotExactError(f"the response with --spec {self.speculation.spec} differs from plain greedy "
                                f"decoding's: this library's verification batches are not exact")

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any], what: str = "prefill result") -> PrefillResult:
        """Read `prefill --json` output (text or parsed) back; a missing key, a wrong type or text
        that is not JSON is one DflashError line naming the key."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise DflashError(f"{what} is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        f = _Fields(data, what)
        lib = f.obj("library")
        q = f.opt_obj("qualification")
        q1 = f.opt_obj("q1")
        comparison = None
        if q1 is not None:
            comparison = Q1Comparison(
                Q1Run(q1.text("logits_sha256"), q1.text("response_sha256"), q1.number("prefill_seconds"),
                      q1.number("prefill_tokens_per_second")),
                f.boolean("identical_to_q1"), f.opt_number("speedup_vs_q1"))
        requested = f.get("chunk_requested", (int, str))
        return cls(
            model=f.text("model"), architecture=f.text("architecture"),
            library=Library(lib.text("flavor"), lib.opt_text("dir"), lib.opt_text("cpu") or "native"),
            bands_on=f.boolean("bands_on"), chunk=f.integer("chunk"),
            chunk_requested=requested, band_mode=f.text("band_mode"), mmvq_max_ncols=f.integer("mmvq_max_ncols"),
            qualification=None if q is None else Qualified(q.text("path"), q.text("key"), q.integer("width"),
                                                           q.text("mode")),
            threads=f.integer("threads"), n_ctx=f.integer("n_ctx"), device=f.text("device"),
            widths=f.integers("widths"), n_prompt_tokens=f.integer("n_prompt_tokens"),
            prefill_seconds=f.number("prefill_seconds"),
            prefill_tokens_per_second=f.number("prefill_tokens_per_second"),
            decode_seconds=f.number("decode_seconds"), prompt_sha256=f.text("prompt_sha256"),
            logits_sha256=f.text("logits_sha256"), response_tokens=f.integers("response_tokens"),
            response_tokens_sha256=f.text("response_tokens_sha256"), response_text=f.text("response_text"),
            response_sha256=f.text("response_sha256"), warnings=f.texts("warnings"), comparison=comparison,
            uncovered_weight_types=f.counts("uncovered_weight_types") if "uncovered_weight_types" in f.d else {},
            devices=tuple(f.objects("devices")), repack=f.boolean("repack"),
            indexer_shortcut=f.boolean("indexer_shortcut"),
            indexer_tile=f.integer("indexer_tile") if "indexer_tile" in f.d else 0,
            memory_budget=f.get("memory_budget", (dict,), nullable=True),
            speculation=SpecComparison.from_fields(spec) if "speculation" in f.d
            and (spec := f.opt_obj("speculation")) is not None else None)


# ---------------------------------------------------------------------------------------------
# bench

@dataclass(frozen=True)
class ArmStats:
    """One arm's measured (not warm-up) requests: prefill tokens/s."""
    name: str
    samples: tuple[float, ...]
    median: float
    mad: float
    n: int

    def to_json(self) -> Json:
        return {"name": self.name, "samples": list(self.samples), "median": self.median, "mad": self.mad,
                "n": self.n}


@dataclass(frozen=True)
class BenchSummary:
    """The A/B/A statistics and hash equality (the evidence's summary.json)."""
    arms: tuple[ArmStats, ...]
    q1_pooled_median: float
    gain_percent: float
    speedup: float
    drift_percent: float
    response_hashes_identical: bool
    logits_hashes_identical: bool
    hashes_identical: bool
    response_sha256: str    # the first request's
    logits_sha256: str
    unit: str = "prefill tokens/s"

    def to_json(self) -> Json:
        return {"unit": self.unit, "arms": [a.to_json() for a in self.arms],
                "q1_pooled_median": self.q1_pooled_median, "gain_percent": self.gain_percent,
                "speedup": self.speedup, "drift_percent": self.drift_percent,
                "response_hashes_identical": self.response_hashes_identical,
                "logits_hashes_identical": self.logits_hashes_identical, "hashes_identical": self.hashes_identical,
                "response_sha256": self.response_sha256, "logits_sha256": self.logits_sha256}


@dataclass(frozen=True)
class BenchResult:
    summary: BenchSummary
    n_prompt_tokens: int
    threads: int
    library: Library
    chunk: int
    qualification: Qualified | None
    evidence_dir: str
    manifest_sha256: str
    devices: tuple[Json, ...] = ({"id": "cpu"},)
    memory_budget: Json | None = None

    def to_json(self) -> Json:
        return {**self.summary.to_json(), "n_prompt_tokens": self.n_prompt_tokens, "threads": self.threads,
                "library": self.library.to_json(), "chunk": self.chunk, "devices": [dict(d) for d in self.devices],
                "memory_budget": self.memory_budget,
                "qualification": _qualification(self.qualification),
                "evidence_dir": self.evidence_dir, "manifest_sha256": self.manifest_sha256}


# ---------------------------------------------------------------------------------------------
# qualify

@dataclass(frozen=True)
class RunCheck:
    """One qualify run (a planner cap, a fixed width, or the q1 repeat) against the q1 reference."""
    width: int
    label: str
    schedule: Json                    # {"n_bands", "widths": {width: count}, "reasons": {reason: count}}
    widest_band: int
    exact: bool                       # logits, response and routing identical
    logits_identical: bool
    first_diff_position: int | None
    n_positions_differing: int
    max_abs_diff: float | None
    logits_sha256: str
    response_sha256: str
    response_identical: bool
    routing_identical: bool | None    # None: not an MoE model
    first_routing_diff: Json | None
    prefill_seconds: float

    def to_json(self) -> Json:
        return {"width": self.width, "label": self.label, "schedule": self.schedule,
                "widest_band": self.widest_band, "exact": self.exact, "logits_identical": self.logits_identical,
                "first_diff_position": self.first_diff_position,
                "n_positions_differing": self.n_positions_differing, "max_abs_diff": self.max_abs_diff,
                "logits_sha256": self.logits_sha256, "response_sha256": self.response_sha256,
                "response_identical": self.response_identical, "routing_identical": self.routing_identical,
                "first_routing_diff": self.first_routing_diff, "prefill_seconds": self.prefill_seconds}


@dataclass(frozen=True)
class WidthResult:
    """One width: the planner at that cap and (width >= 2) bands of exactly that width. The top
    level of its JSON is the planner run's, except `exact`, `widest_band` and
    `first_diff_position`, which cover both runs."""
    planner: RunCheck
    fixed: RunCheck | None = None

    @property
    def width(self) -> int:
        return self.planner.width

    @property
    def exact(self) -> bool:
        return self.planner.exact and (self.fixed is None or self.fixed.exact)

    @property
    def widest_band(self) -> int:
        return max(self.planner.widest_band, self.fixed.widest_band if self.fixed else 0)

    @property
    def first_diff_position(self) -> int | None:
        p = self.planner.first_diff_position
        return p if p is not None or self.fixed is None else self.fixed.first_diff_position

    def to_json(self) -> Json:
        return {**self.planner.to_json(), "exact": self.exact, "widest_band": self.widest_band,
                "first_diff_position": self.first_diff_position, "planner_exact": self.planner.exact,
                "fixed_width": self.fixed.to_json() if self.fixed is not None else None}


@dataclass(frozen=True)
class QualifyReport:
    """What qualify measured and recommends (the evidence's results.json, with the record's place)."""
    model: str
    architecture: str
    library: Library
    threads: int
    n_tokens: int
    n_predict: int
    resume_at: int
    widths: tuple[int, ...]
    coverage: Json                    # qualify.coverage()
    moe: bool
    routing_layers: tuple[int, ...]
    reference: Json                   # the q1 reference's request record and response tokens
    results: tuple[WidthResult, ...]
    largest_exact_cap: int
    largest_exact_width: int
    recommended_cap: int
    recommended_bands: bool
    recommended_mmvq_max_ncols: int
    recommended_env: dict[str, str]
    recommended_chunk: int
    recommended_band_mode: str
    uncovered_weight_types: dict[str, int] = field(default_factory=dict)  # outside the narrow path (hip only)
    devices: tuple[Json, ...] = ({"id": "cpu"},)  # every --device part; RPC ones with endpoint and build

    @property
    def all_exact(self) -> bool:
        return all(r.exact for r in self.results)

    def to_json(self) -> Json:
        return {
            "model": self.model, "architecture": self.architecture, "library": self.library.to_json(),
            "threads": self.threads, "n_tokens": self.n_tokens, "n_predict": self.n_predict,
            "resume_at": self.resume_at, "widths": list(self.widths), "coverage": self.coverage, "moe": self.moe,
            "routing_layers": list(self.routing_layers), "reference": self.reference,
            "results": [r.to_json() for r in self.results], "all_exact": self.all_exact,
            "largest_exact_cap": self.largest_exact_cap, "largest_exact_width": self.largest_exact_width,
            "recommended_cap": self.recommended_cap, "recommended_bands": self.recommended_bands,
            "recommended_mmvq_max_ncols": self.recommended_mmvq_max_ncols,
            "recommended_env": dict(self.recommended_env), "recommended_chunk": self.recommended_chunk,
            "recommended_band_mode": self.recommended_band_mode,
            "uncovered_weight_types": dict(self.uncovered_weight_types),
            "devices": [dict(d) for d in self.devices],
        }


@dataclass(frozen=True)
class RecordRef:
    """Where this run's verdicts went: the stored qualification record and its copy in the evidence."""
    path: str
    key: str
    evidence_file: str

    def to_json(self) -> Json:
        return {"path": self.path, "key": self.key, "evidence_file": self.evidence_file}


@dataclass(frozen=True)
class QualificationRef:
    """The record after this run was merged into it: what --chunk auto runs, and every width it holds."""
    record: RecordRef
    auto_width: int
    auto_mode: str
    widths: tuple[int, ...]

    def to_json(self) -> Json:
        return {**self.record.to_json(), "auto": {"width": self.auto_width, "mode": self.auto_mode},
                "widths": list(self.widths)}


@dataclass(frozen=True)
class QualifyResult:
    report: QualifyReport
    qualification: QualificationRef
    evidence_dir: str
    manifest_sha256: str

    def to_json(self) -> Json:
        return {**self.report.to_json(), "qualification": self.qualification.to_json(),
                "evidence_dir": self.evidence_dir, "manifest_sha256": self.manifest_sha256}


# ---------------------------------------------------------------------------------------------
# diff

@dataclass(frozen=True)
class DiffSide:
    schedule: str     # as given (--a / --b)
    widths: str       # bands.summarize_widths
    n_bands: int

    def to_json(self) -> Json:
        return {"schedule": self.schedule, "widths": self.widths, "n_bands": self.n_bands}


@dataclass(frozen=True)
class DiffResult:
    a: DiffSide
    b: DiffSide
    n_tokens: int
    first_diff_position: int | None   # of the logits
    n_positions_differing: int
    logits_max_abs_diff: float
    first_node: NodeDiff | None
    n_compared: int
    node_positions_differing: int
    differing: tuple[NodeDiff, ...]   # the first `--show` differing nodes at first_node's position
    n_differing_at_first_position: int
    model: str
    library: Library
    threads: int
    ignore: str | None
    devices: tuple[Json, ...] = ({"id": "cpu"},)
    untapped_first_diff_position: int | None = None  # of the two schedules run without a tap
    tap_changed_logits: tuple[str, ...] = ()  # "a"/"b": that schedule's tapped logits differ from its untapped ones

    @property
    def logits_identical(self) -> bool:
        return self.first_diff_position is None

    @property
    def nodes_identical(self) -> bool:
        return self.first_node is None

    @property
    def untapped_identical(self) -> bool:
        return self.untapped_first_diff_position is None

    @property
    def tap_faithful(self) -> bool:
        """Each tapped run computed its untapped logits: the node comparison describes the real runs
        (on a backend that fuses, it describes the unfused graph instead)."""
        return not self.tap_changed_logits

    @property
    def identical(self) -> bool:
        """Tapped and untapped, the two schedules agree (the untapped runs are the real ones)."""
        return self.logits_identical and self.nodes_identical and self.untapped_identical

    def to_json(self) -> Json:
        return {
            "a": self.a.to_json(), "b": self.b.to_json(), "n_tokens": self.n_tokens,
            "logits_identical": self.logits_identical, "first_diff_position": self.first_diff_position,
            "n_positions_differing": self.n_positions_differing, "logits_max_abs_diff": self.logits_max_abs_diff,
            "nodes_identical": self.nodes_identical, "identical": self.identical,
            "first_node": self.first_node.to_json() if self.first_node is not None else None,
            "n_compared": self.n_compared, "node_positions_differing": self.node_positions_differing,
            "differing": [x.to_json() for x in self.differing],
            "n_differing_at_first_position": self.n_differing_at_first_position,
            "model": self.model, "library": self.library.to_json(), "threads": self.threads, "ignore": self.ignore,
            "devices": [dict(d) for d in self.devices],
            "untapped_identical": self.untapped_identical,
            "untapped_first_diff_position": self.untapped_first_diff_position,
            "tap_faithful": self.tap_faithful, "tap_changed_logits": list(self.tap_changed_logits),
        }


# ---------------------------------------------------------------------------------------------
# matrix

@dataclass(frozen=True)
class MatrixRow:
    """One configuration's fingerprints; the hashes and verdicts are None when it did not run."""
    config: str
    device: str
    threads: int
    lib: str
    library: Library
    error: str | None = None
    q1_logits_sha256: str | None = None
    q1_response_sha256: str | None = None
    logits_sha256: str | None = None
    response_sha256: str | None = None
    q1_equals_bands: bool | None = None
    logits_equal_reference: bool | None = None
    response_equal_reference: bool | None = None
    reference: str | None = None       # the configuration whose q1 run this row is compared with
    devices: tuple[Json, ...] = ()     # as its prefill reported them (RPC: endpoint and build)

    @property
    def ran(self) -> bool:
        return self.error is None

    def to_json(self) -> Json:
        return {"config": self.config, "device": self.device, "threads": self.threads, "lib": self.lib,
                "ran": self.ran, "error": self.error, "q1_logits_sha256": self.q1_logits_sha256,
                "q1_response_sha256": self.q1_response_sha256, "logits_sha256": self.logits_sha256,
                "response_sha256": self.response_sha256, "q1_equals_bands": self.q1_equals_bands,
                "logits_equal_reference": self.logits_equal_reference,
                "response_equal_reference": self.response_equal_reference, "library": self.library.to_json(),
                "reference": self.reference, "devices": [dict(d) for d in self.devices]}


@dataclass(frozen=True)
class Skipped:
    config: str
    reason: str

    def to_json(self) -> Json:
        return {"config": self.config, "reason": self.reason}


@dataclass(frozen=True)
class MatrixResult:
    reference: str                 # the configuration whose q1 run every row is compared with
    rows: tuple[MatrixRow, ...]
    skipped: tuple[Skipped, ...]

    @property
    def exact_all_equal(self) -> bool:
        return all(r.ran and r.logits_equal_reference and r.response_equal_reference
                   for r in self.rows if r.lib == "exact")

    def to_json(self) -> Json:
        return {"reference": self.reference, "rows": [r.to_json() for r in self.rows],
                "exact_all_equal": self.exact_all_equal, "skipped": [s.to_json() for s in self.skipped]}


# ---------------------------------------------------------------------------------------------
# Reading JSON back

def _kind(v: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


class _Fields:
    """Typed reads of one parsed JSON object; each failure is one DflashError line naming the key."""

    def __init__(self, obj: object, what: str):
        if not isinstance(obj, dict):
            raise DflashError(f"{what} is {_kind(obj)}, not a JSON object")
        self.d, self.what = obj, what

    def get(self, key: str, types: tuple[type, ...], nullable: bool = False) -> Any:
        if key not in self.d:
            raise DflashError(f"{self.what} has no {key!r}")
        v = self.d[key]
        if v is None and nullable:
            return None
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if ok and isinstance(v, float) and not math.isfinite(v):
            ok = False
        if not ok:
            want = " or ".join(_kind(t()) for t in types) + (" or null" if nullable else "")
            raise DflashError(f"{self.what}: {key!r} is {_kind(v)}, not {want}")
        return v

    def text(self, key: str) -> str:
        return self.get(key, (str,))

    def opt_text(self, key: str) -> str | None:
        return self.get(key, (str,), nullable=True)

    def integer(self, key: str) -> int:
        return self.get(key, (int,))

    def number(self, key: str) -> float:
        return self.get(key, (int, float))

    def opt_number(self, key: str) -> float | None:
        return self.get(key, (int, float), nullable=True)

    def boolean(self, key: str) -> bool:
        return self.get(key, (bool,))

    def _items(self, key: str, t: type[_T]) -> tuple[_T, ...]:
        vs = self.get(key, (list,))
        for i, v in enumerate(vs):
            if not isinstance(v, t) or isinstance(v, bool):
                raise DflashError(f"{self.what}: {key}[{i}] is {_kind(v)}, not {_kind(t())}")
        return tuple(vs)

    def integers(self, key: str) -> tuple[int, ...]:
        return self._items(key, int)

    def texts(self, key: str) -> tuple[str, ...]:
        return self._items(key, str)

    def obj(self, key: str) -> _Fields:
        return _Fields(self.get(key, (dict,)), f"{self.what}.{key}")

    def counts(self, key: str) -> dict[str, int]:
        """An object of name -> integer."""
        o = self.obj(key)
        return {k: o.integer(k) for k in o.d}

    def objects(self, key: str) -> tuple[Json, ...]:
        """A list of objects, each with a string "id"."""
        items = self._items(key, dict)
        for i, d in enumerate(items):
            if not isinstance(d.get("id"), str):
                raise DflashError(f"{self.what}.{key}[{i}] has no string id")
        return items

    def opt_obj(self, key: str) -> _Fields | None:
        v = self.get(key, (dict,), nullable=True)
        return None if v is None else _Fields(v, f"{self.what}.{key}")


# ---------------------------------------------------------------------------------------------
# rpc-server

@dataclass(frozen=True)
class RpcServerResult:
    """A running `dflash rpc-server`: where it listens and what it serves."""
    endpoint: str
    build: str              # the library build id it reports to clients
    device: str             # cpu, hip:N, cuda:N or vulkan:N
    protocol: str           # the RPC protocol version it answered
    threads: int
    library: Library
    remote_allowed: bool    # bound to a non-loopback address (--allow-remote)
    pid: int

    def to_json(self) -> Json:
        return {"endpoint": self.endpoint, "build": self.build, "device": self.device, "protocol": self.protocol,
                "threads": self.threads, "library": self.library.to_json(), "remote_allowed": self.remote_allowed,
                "pid": self.pid}


# ---------------------------------------------------------------------------------------------
# memory

@dataclass(frozen=True)
class MemoryResult:
    """What llama.cpp allocates (or would) for a context at each band width."""
    model: str
    architecture: str
    n_ctx: int
    measured: bool                 # True: real allocations; False: llama.cpp's no_alloc estimate
    library: Library
    device: str
    indexer_rows: int | None       # pooled rows an indexer scores per token at the end of the context
    rows: tuple[Any, ...]          # dflash.run.memory.MemoryRow, one per width
    indexer_tile: int = 0          # the DeepSeek-V4 indexer tile the library applied (0: none)

    def to_json(self) -> Json:
        return {"model": self.model, "architecture": self.architecture, "n_ctx": self.n_ctx,
                "measured": self.measured, "library": self.library.to_json(), "device": self.device,
                "indexer_rows": self.indexer_rows, "indexer_tile": self.indexer_tile,
                "rows": [r.to_json() for r in self.rows]}

