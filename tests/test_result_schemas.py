"""The JSON of every command's result, pinned: keys and JSON types, nested (dflash/core/results.py).

Each schema below is checked against (a) `to_json()` of a result built here in Python and (b) the
real `--json` output of the command on the built-in tiny model. The checker is strict (a missing
key, an unexpected key or a wrong type is a problem), and the tests show that it rejects a
result with a key removed or a value of the wrong type. `library` has one shape everywhere."""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from dflash.core.errors import DflashError
from dflash.core.results import (
    ArmStats,
    BenchResult,
    BenchSummary,
    DiffResult,
    DiffSide,
    Library,
    MatrixResult,
    MatrixRow,
    MemoryResult,
    PrefillResult,
    Q1Comparison,
    Q1Run,
    QualificationRef,
    QualifyReport,
    QualifyResult,
    RecordRef,
    RpcServerResult,
    RunCheck,
    Skipped,
    SpecComparison,
    WidthResult,
)
from dflash.core.settings import Qualified
from dflash.core.trace import NodeDiff
from dflash.run import memory

from .conftest import run_dflash

# ---------------------------------------------------------------------------------------------
# A small strict checker. A schema is: a type name (below); a tuple of alternatives; a dict of
# keys (every key required unless wrapped in Opt, no other key allowed); [schema] for an array
# of items; MapOf(schema) for an object with free string keys.

TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "num": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "sha256": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
}
STR, INT, NUM, BOOL, NULL, SHA = "str", "int", "num", "bool", "null", "sha256"


class Opt:
    """A key that may be absent."""

    def __init__(self, schema):
        self.schema = schema


class MapOf:
    """An object whose keys are free strings and whose values all match `schema`."""

    def __init__(self, schema):
        self.schema = schema


def problems(v, schema, path="$") -> list[str]:
    if isinstance(schema, tuple):
        found = [problems(v, alt, path) for alt in schema]
        if any(not f for f in found):
            return []
        # an object or array that fails its structured alternative: say what is wrong inside it
        inner = [f for alt, f in zip(schema, found, strict=True) if not isinstance(alt, str)]
        if isinstance(v, (dict, list)) and inner:
            return min(inner, key=len)
        return [f"{path}: {json.dumps(v, default=repr)[:60]} matches none of its alternatives"]
    if isinstance(schema, str):
        return [] if TYPES[schema](v) else [f"{path}: expected {schema}, got {type(v).__name__} {v!r:.60}"]
    if isinstance(schema, list):
        if not isinstance(v, list):
            return [f"{path}: expected an array, got {type(v).__name__}"]
        return [p for i, x in enumerate(v) for p in problems(x, schema[0], f"{path}[{i}]")]
    if isinstance(schema, MapOf):
        if not isinstance(v, dict):
            return [f"{path}: expected an object, got {type(v).__name__}"]
        return [p for k, x in v.items()
                for p in ([f"{path}: key {k!r} is not a string"] if not isinstance(k, str)
                          else problems(x, schema.schema, f"{path}.{k}"))]
    if isinstance(schema, dict):
        if not isinstance(v, dict):
            return [f"{path}: expected an object, got {type(v).__name__} {v!r:.60}"]
        out = [f"{path}: unexpected key {k!r}" for k in v if k not in schema]
        for k, s in schema.items():
            if k in v:
                out += problems(v[k], s.schema if isinstance(s, Opt) else s, f"{path}.{k}")
            elif not isinstance(s, Opt):
                out.append(f"{path}: missing key {k!r}")
        return out
    raise TypeError(f"not a schema: {schema!r}")


def check(v, schema) -> None:
    found = problems(v, schema)
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------------
# The schemas

LIBRARY = {"flavor": STR, "dir": STR, "cpu": STR}
# a --device part: local ones by id (GPUs with name and arch), RPC ones with endpoint and build
MEMORY_ROW = {"width": INT, "total_bytes": INT, "weights_bytes": INT, "context_bytes": INT, "kv_bytes": INT,
              "compressed_kv_bytes": INT, "indexer_cache_bytes": INT,
              "compressor_state_bytes": INT, "compute_bytes": INT, "indexer_scores_bytes": (INT, NULL)}
BUDGET = {"budget_bytes": INT, "n_ctx": INT, "width": INT, "total_bytes": INT, "estimate": MEMORY_ROW}
DEVICE = {"id": STR, "name": Opt(STR), "arch": Opt(STR), "endpoint": Opt(STR), "server_device": Opt(INT),
          "build": Opt((STR, NULL)), "flavor": Opt((STR, NULL)), "served_device": Opt((STR, NULL))}
# positions: the longest prompt the record's proof covers (a lookup's Qualified states it)
QUALIFIED = ({"path": STR, "key": STR, "width": INT, "mode": STR, "positions": Opt(INT)}, NULL)

PREFILL = {
    "model": STR, "architecture": STR, "library": LIBRARY, "bands_on": BOOL, "chunk": INT,
    "chunk_requested": (INT, STR), "band_mode": STR, "mmvq_max_ncols": INT, "qualification": QUALIFIED,
    "threads": INT, "n_ctx": INT, "device": STR, "widths": [INT], "n_prompt_tokens": INT,
    "prefill_seconds": NUM, "prefill_tokens_per_second": NUM, "decode_seconds": NUM,
    "prompt_sha256": SHA, "logits_sha256": SHA, "response_tokens": [INT], "response_tokens_sha256": SHA,
    "response_text": STR, "response_sha256": SHA, "warnings": [STR], "uncovered_weight_types": MapOf(INT),
    "q1": ({"logits_sha256": SHA, "response_sha256": SHA, "prefill_seconds": NUM,
            "prefill_tokens_per_second": NUM}, NULL),
    "identical_to_q1": (BOOL, NULL), "speedup_vs_q1": (NUM, NULL), "devices": [DEVICE], "repack": BOOL,
    "indexer_shortcut": BOOL, "indexer_tile": INT, "memory_budget": (BUDGET, NULL),
    "speculation": ({"spec": STR, "response_tokens_sha256": SHA, "response_logits_sha256": SHA,
                     "identical_to_plain": BOOL, "drafted": INT, "accepted": INT, "rejected": INT,
                     "acceptance_rate": (NUM, NULL), "batches": INT, "truncations": INT, "restores": INT,
                     "decode_seconds": NUM, "plain_decode_seconds": NUM, "decode_speedup": (NUM, NULL)}, NULL),
}

BENCH_SUMMARY = {  # the evidence's summary.json
    "unit": STR, "arms": [{"name": STR, "samples": [NUM], "median": NUM, "mad": NUM, "n": INT}],
    "q1_pooled_median": NUM, "gain_percent": NUM, "speedup": NUM, "drift_percent": NUM,
    "response_hashes_identical": BOOL, "logits_hashes_identical": BOOL, "hashes_identical": BOOL,
    "response_sha256": SHA, "logits_sha256": SHA,
}
BENCH = BENCH_SUMMARY | {
    "n_prompt_tokens": INT, "threads": INT, "library": LIBRARY, "chunk": INT, "qualification": QUALIFIED,
    "evidence_dir": STR, "manifest_sha256": SHA, "devices": [DEVICE], "memory_budget": (BUDGET, NULL),
}

SCHEDULE = {"n_bands": INT, "widths": MapOf(INT), "reasons": MapOf(INT)}
ROUTING_DIFF = {"position": INT, "layer": INT, "field": STR, "problem": STR,
                "reference": Opt([NUM]), "value": Opt([NUM])}
RUN_CHECK = {
    "width": INT, "label": STR, "schedule": SCHEDULE, "widest_band": INT, "exact": BOOL,
    "logits_identical": BOOL, "first_diff_position": (INT, NULL), "n_positions_differing": INT,
    "max_abs_diff": (NUM, NULL), "logits_sha256": SHA, "response_sha256": SHA, "response_identical": BOOL,
    "routing_identical": (BOOL, NULL), "first_routing_diff": (ROUTING_DIFF, NULL), "prefill_seconds": NUM,
}
WIDTH_RESULT = RUN_CHECK | {"planner_exact": BOOL, "fixed_width": (RUN_CHECK, NULL)}
COVERAGE = {
    "n_tokens": INT, "ratios": [INT], "sliding_window": (INT, NULL),
    "crossings": [{"what": STR, "position": INT, "crossed": BOOL}], "resume_at": INT, "resume_unaligned": BOOL,
    "widths_with_start_band": [INT], "widths_with_tail_band": [INT], "widths_with_boundary_band": [INT],
    "widths_not_decoded": [INT], "missing": [STR],
}
REFERENCE = {"label": STR, "width": INT, "n_bands": INT, "prompt_sha256": SHA, "logits_sha256": SHA,
             "response_sha256": SHA, "response_tokens_sha256": SHA, "prefill_seconds": NUM, "exact": BOOL,
             "response_tokens": [INT]}
QUALIFY_REPORT = {
    "model": STR, "architecture": STR, "library": LIBRARY, "threads": INT, "n_tokens": INT, "n_predict": INT,
    "resume_at": INT, "widths": [INT], "coverage": COVERAGE, "moe": BOOL, "routing_layers": [INT],
    "reference": REFERENCE, "results": [WIDTH_RESULT], "all_exact": BOOL, "largest_exact_cap": INT,
    "largest_exact_width": INT, "recommended_cap": INT, "recommended_bands": BOOL,
    "recommended_mmvq_max_ncols": INT, "recommended_env": MapOf(STR), "recommended_chunk": INT,
    "recommended_band_mode": STR, "uncovered_weight_types": MapOf(INT), "devices": [DEVICE],
}
RECORD_REF = {"path": STR, "key": STR, "evidence_file": STR}
QUALIFY_RESULTS_JSON = QUALIFY_REPORT | {"qualification": RECORD_REF}  # the evidence's results.json
QUALIFY = QUALIFY_REPORT | {
    "qualification": RECORD_REF | {"auto": {"width": INT, "mode": STR}, "widths": [INT]},
    "evidence_dir": STR, "manifest_sha256": SHA,
}

NODE = {"position": INT, "key": STR, "name": STR, "op": STR, "max_abs_delta": (NUM, STR), "n_values": INT,
        "n_differing": INT}
SIDE = {"schedule": STR, "widths": STR, "n_bands": INT}
DIFF = {
    "a": SIDE, "b": SIDE, "n_tokens": INT, "logits_identical": BOOL, "first_diff_position": (INT, NULL),
    "n_positions_differing": INT, "logits_max_abs_diff": (NUM, NULL), "nodes_identical": BOOL,
    "identical": BOOL, "first_node": (NODE, NULL), "n_compared": INT, "node_positions_differing": INT,
    "differing": [NODE], "n_differing_at_first_position": INT, "model": STR, "library": LIBRARY,
    "threads": INT, "ignore": (STR, NULL), "devices": [DEVICE], "untapped_identical": BOOL,
    "untapped_first_diff_position": (INT, NULL), "tap_faithful": BOOL, "tap_changed_logits": [STR],
}

MATRIX_ROW = {
    "config": STR, "device": STR, "threads": INT, "lib": STR, "ran": BOOL, "error": (STR, NULL),
    "q1_logits_sha256": (SHA, NULL), "q1_response_sha256": (SHA, NULL), "logits_sha256": (SHA, NULL),
    "response_sha256": (SHA, NULL), "q1_equals_bands": (BOOL, NULL), "logits_equal_reference": (BOOL, NULL),
    "response_equal_reference": (BOOL, NULL),
    "library": {"flavor": STR, "dir": (STR, NULL), "cpu": STR},  # no folder for a row whose process did not run
    "reference": (STR, NULL), "devices": [DEVICE],
}
MATRIX = {"reference": STR, "rows": [MATRIX_ROW], "exact_all_equal": BOOL,
          "skipped": [{"config": STR, "reason": STR}]}
MEMORY = {"model": STR, "architecture": STR, "n_ctx": INT, "measured": BOOL, "library": LIBRARY, "device": STR,
          "indexer_rows": (INT, NULL), "indexer_tile": INT, "rows": [MEMORY_ROW]}
RPC_SERVER = {"endpoint": STR, "build": STR, "device": STR, "protocol": STR, "threads": INT, "library": LIBRARY,
              "remote_allowed": BOOL, "pid": INT}


# ---------------------------------------------------------------------------------------------
# Results built in Python

H = ["a" * 64, "b" * 64, "c" * 64, "d" * 64]
REMOTE = {"id": "rpc:0", "endpoint": "127.0.0.1:50052", "server_device": 0, "build": "exact-0123",
          "flavor": "exact", "served_device": "cpu"}
LIB = Library("exact", "/cache/llama/exact-0123/lib")


def prefill_result(compared: bool = True) -> PrefillResult:
    return PrefillResult(
        model="/m.gguf", architecture="deepseek4", library=LIB, bands_on=True, chunk=4, chunk_requested="auto",
        band_mode="planner", mmvq_max_ncols=4, qualification=Qualified("/q.json", "k" * 24, 4, "planner"),
        threads=1, n_ctx=64, device="cpu", widths=(4, 4, 1), n_prompt_tokens=9, prefill_seconds=0.5,
        prefill_tokens_per_second=18.0, decode_seconds=0.1, prompt_sha256=H[0], logits_sha256=H[1],
        response_tokens=(7, 8), response_tokens_sha256=H[2], response_text="hi", response_sha256=H[3],
        warnings=("a warning",), uncovered_weight_types={"Q6_K": 12, "IQ4_XS": 3},
        devices=({"id": "cpu"}, REMOTE), repack=False,
        comparison=Q1Comparison(Q1Run(H[1], H[3], 1.0, 9.0), identical=True, speedup=2.0) if compared else None,
        speculation=SpecComparison("ngram", H[2], H[0], True, 10, 7, 3, 1, 2, 0.05, 0.1) if compared else None)


def bench_result() -> BenchResult:
    arms = tuple(ArmStats(name, (10.0, 11.5), 10.75, 0.75, 2) for name in ("q1_a", "candidate", "q1_b"))
    summary = BenchSummary(arms, 10.75, 0.0, 1.0, 0.0, True, True, True, H[0], H[1])
    return BenchResult(summary, 9, 1, LIB, 4, None, "/ev", H[2])


def run_check(width: int, label: str, exact: bool = True) -> RunCheck:
    routing = None if exact else {"position": 3, "layer": 0, "field": "weights", "problem": "differs",
                                  "reference": [0.75, 0.25], "value": [0.5, 0.5]}
    return RunCheck(width=width, label=label, schedule={"n_bands": 5, "widths": {str(width): 4, "1": 1},
                                                        "reasons": {"full": 4, "tail": 1}},
                    widest_band=width, exact=exact, logits_identical=exact, first_diff_position=None if exact else 3,
                    n_positions_differing=0 if exact else 2, max_abs_diff=0.0 if exact else 1e-7,
                    logits_sha256=H[1], response_sha256=H[3], response_identical=True,
                    routing_identical=exact, first_routing_diff=routing, prefill_seconds=0.25)


def qualify_result() -> QualifyResult:
    coverage = {"n_tokens": 9, "ratios": [4, 128], "sliding_window": 64,
                "crossings": [{"what": "compress ratio 4", "position": 4, "crossed": True}], "resume_at": 5,
                "resume_unaligned": True, "widths_with_start_band": [2], "widths_with_tail_band": [2],
                "widths_with_boundary_band": [], "widths_not_decoded": [], "missing": []}
    reference = {"label": "q1 reference", "width": 1, "n_bands": 9, "prompt_sha256": H[0], "logits_sha256": H[1],
                 "response_sha256": H[3], "response_tokens_sha256": H[2], "prefill_seconds": 0.5, "exact": True,
                 "response_tokens": [7, 8]}
    report = QualifyReport(
        model="/m.gguf", architecture="deepseek4", library=LIB, threads=1, n_tokens=9, n_predict=2, resume_at=5,
        widths=(1, 2), coverage=coverage, moe=True, routing_layers=(0, 1), reference=reference,
        results=(WidthResult(run_check(1, "q1 repeat")),
                 WidthResult(run_check(2, "cap 2"), run_check(2, "fixed 2", exact=False))),
        largest_exact_cap=1, largest_exact_width=1, recommended_cap=1, recommended_bands=False,
        recommended_mmvq_max_ncols=1, recommended_env={"DFLASH_DS4_EXACT_PREFILL_BANDS": "0"},
        recommended_chunk=1, recommended_band_mode="planner", uncovered_weight_types={"IQ4_XS": 3})
    ref = QualificationRef(RecordRef("/q.json", "k" * 24, "qualification.json"), 1, "planner", (1, 2))
    return QualifyResult(report, ref, "/ev", H[2])


def diff_result(differs: bool = True) -> DiffResult:
    node = NodeDiff(0, "x#2", "x", "MUL_MAT", 1e-7, 24, 3)
    nan_node = NodeDiff(0, "kq-0", "kq-0", "SOFT_MAX", float("nan"), 8, 8)  # max |delta| nan: "nan"
    return DiffResult(
        a=DiffSide("q1", "1x8", 8), b=DiffSide("w4", "4x2", 2), n_tokens=8,
        first_diff_position=0 if differs else None, n_positions_differing=8 if differs else 0,
        logits_max_abs_diff=1e-6 if differs else 0.0, first_node=node if differs else None,
        n_compared=100, node_positions_differing=8 if differs else 0,
        differing=(node, nan_node) if differs else (), n_differing_at_first_position=2 if differs else 0,
        model="/m.gguf", library=LIB, threads=1, ignore=None if differs else "^kq")


def matrix_result() -> MatrixResult:
    ran = MatrixRow("cpu t1 exact", "cpu", 1, "exact", LIB, None, H[0], H[1], H[0], H[1], True, True, True,
                    "cpu t1 exact", ({"id": "cpu"},))
    remote = MatrixRow("rpc:0 all layers", "rpc:0", 1, "exact", LIB, None, H[0], H[1], H[0], H[1], True, True, True,
                       "cpu t1 exact no-repack", (REMOTE,))
    failed = MatrixRow("hip:0 gfx1100", "hip:0", 1, "exact", Library("exact", None), error="no HIP device")
    return MatrixResult("cpu t1 exact", (ran, remote, failed), (Skipped("hip:0+hip:1 layer split", "needs two"),))


BUILT = {
    "prefill": (prefill_result, PREFILL),
    "prefill without --compare-q1": (lambda: prefill_result(compared=False), PREFILL),
    "bench": (bench_result, BENCH),
    "bench summary.json": (lambda: bench_result().summary, BENCH_SUMMARY),
    "qualify": (qualify_result, QUALIFY),
    "qualify report": (lambda: qualify_result().report, QUALIFY_REPORT),
    "diff": (diff_result, DIFF),
    "diff, identical": (lambda: diff_result(differs=False), DIFF),
    "matrix": (matrix_result, MATRIX),
    "memory": (lambda: MemoryResult("/m.gguf", "deepseek4", 2048, False, LIB, "cpu", 512, (
        memory.row(4, {"weights": 5, "context": 11, "compute": 3, "kv": 2, "compressed_kv": 3, "indexer_cache": 1,
                       "compressor_states": 1, "kv_unused_base": 4}, 512),)), MEMORY),
    "rpc-server": (lambda: RpcServerResult("127.0.0.1:50052", "exact-0123", "cpu", "7.0.0", 1, LIB, False, 42),
                   RPC_SERVER),
}


@pytest.mark.parametrize("name", list(BUILT))
def test_built_results_match_their_schema(name):
    make, schema = BUILT[name]
    d = make().to_json()
    check(d, schema)
    assert json.loads(json.dumps(d)) == d  # plain JSON: no tuples, paths or dataclasses inside


def test_derived_fields_follow_the_parts():
    q = qualify_result().to_json()
    one, two = q["results"]
    assert one["fixed_width"] is None and one["planner_exact"] is True and one["exact"] is True
    assert two["planner_exact"] is True and two["fixed_width"]["exact"] is False
    assert two["exact"] is False and two["first_diff_position"] == 3  # from the fixed-width run
    assert q["all_exact"] is False
    d = diff_result().to_json()
    assert (d["logits_identical"], d["nodes_identical"], d["identical"]) == (False, False, False)
    assert d["differing"][1]["max_abs_delta"] == "nan"
    assert diff_result(differs=False).to_json()["identical"] is True
    m = matrix_result().to_json()
    assert [r["ran"] for r in m["rows"]] == [True, True, False] and m["exact_all_equal"] is False
    p = prefill_result(compared=False).to_json()
    assert (p["q1"], p["identical_to_q1"], p["speedup_vs_q1"]) == (None, None, None)


# ---------------------------------------------------------------------------------------------
# The checker can fail

@pytest.mark.parametrize("name", list(BUILT))
def test_checker_rejects_a_removed_key_or_a_wrong_type_anywhere_at_the_top(name):
    make, schema = BUILT[name]
    good = make().to_json()
    for key in good:
        removed = {k: v for k, v in good.items() if k != key}
        assert any(f"missing key {key!r}" in p for p in problems(removed, schema)), key
        wrong = good | {key: [[]]}  # an array of arrays is no field's type
        assert problems(wrong, schema), key
    assert any("unexpected key" in p for p in problems(good | {"surprise": 1}, schema))


def test_checker_rejects_nested_and_typed_mistakes():
    good = prefill_result().to_json()
    q1 = {k: v for k, v in good["q1"].items() if k != "logits_sha256"}
    assert problems(good | {"q1": q1}, PREFILL)                              # a nested key removed
    assert problems(good | {"library": "exact"}, PREFILL)                    # the old bare-string library
    assert problems(good | {"logits_sha256": "not a hash"}, PREFILL)
    assert problems(good | {"n_ctx": True}, PREFILL)                         # a bool is not an int
    assert problems(good | {"prefill_seconds": "0.5"}, PREFILL)
    assert problems(replace(prefill_result(), widths=(4, "4")).to_json(), PREFILL)  # a wrongly typed field
    assert problems(replace(prefill_result(), chunk_requested=4.5).to_json(), PREFILL)
    q = qualify_result().to_json()
    q["results"][1]["fixed_width"].pop("exact")
    assert any("fixed_width" in p and "'exact'" in p for p in problems(q, QUALIFY))
    m = matrix_result().to_json()
    m["rows"][0]["library"] = "exact"
    assert problems(m, MATRIX)


# ---------------------------------------------------------------------------------------------
# PrefillResult.from_json: what matrix reads its rows with

def test_prefill_from_json_round_trips():
    for r in (prefill_result(), prefill_result(compared=False)):
        assert PrefillResult.from_json(r.to_json()) == r
        assert PrefillResult.from_json(json.dumps(r.to_json())) == r


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: "{not json", "is not JSON"),
    (lambda d: [], "not a JSON object"),
    (lambda d: {k: v for k, v in d.items() if k != "logits_sha256"}, "has no 'logits_sha256'"),
    (lambda d: d | {"library": "exact"}, "'library' is a string"),
    (lambda d: d | {"q1": {"logits_sha256": "x"}}, "prefill result.q1 has no 'response_sha256'"),
    (lambda d: d | {"widths": [4, "4"]}, "widths[1] is a string"),
    (lambda d: d | {"threads": True}, "'threads' is a boolean"),
    (lambda d: d | {"identical_to_q1": None}, "'identical_to_q1' is null"),
])
def test_prefill_from_json_rejects_bad_input_in_one_line(mutate, needle):
    with pytest.raises(DflashError) as e:
        PrefillResult.from_json(mutate(prefill_result().to_json()))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_matrix_compares_typed_prefill_results():
    from dflash.compare import matrix
    exact, stock, gpu = (matrix.Config("cpu t1 exact", "cpu", 1, "exact"),
                         matrix.Config("cpu t1 stock", "cpu", 1, "stock"),
                         matrix.Config("hip:0 gfx1100", "hip:0", 1, "exact"))
    differs = replace(prefill_result(), library=Library("stock", "/cache/llama/stock-4567/lib"), logits_sha256=H[0],
                      comparison=Q1Comparison(Q1Run(H[2], H[3], 1.0, 9.0), identical=False, speedup=2.0))
    res = matrix.compare([matrix.Row(exact, prefill_result()), matrix.Row(stock, differs),
                          matrix.Row(gpu, error="no HIP device")],
                         [Skipped("hip:0+hip:1 layer split", "needs two HIP devices")])
    d = res.to_json()
    check(d, MATRIX)
    rows = {r["config"]: r for r in d["rows"]}
    assert d["reference"] == "cpu t1 exact" and rows["cpu t1 exact"]["logits_equal_reference"] is True
    assert rows["cpu t1 stock"]["q1_equals_bands"] is False and rows["cpu t1 stock"]["library"]["flavor"] == "stock"
    gone = rows["hip:0 gfx1100"]
    assert gone["ran"] is False and gone["logits_sha256"] is None
    assert gone["library"] == {"flavor": "exact", "dir": None, "cpu": "native"}
    assert d["exact_all_equal"] is False  # an exact row that did not run is not equal
    with pytest.raises(DflashError, match="no configuration ran: no HIP device"):
        matrix.compare([matrix.Row(gpu, error="no HIP device")])


# ---------------------------------------------------------------------------------------------
# The real commands (subprocesses on the built-in tiny model, one thread)

def run_json_rc(*args, ok=(0,)):
    r = run_dflash(*args, "--json")
    assert r.returncode in ok, r.stderr
    return json.loads(r.stdout)


def libraries(obj):
    """Every value under a "library" key, at any depth."""
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "library"] + [x for v in obj.values() for x in libraries(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in libraries(v)]
    return []


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Each command's --json output, run once (one at a time: they run llama.cpp)."""
    tmp = tmp_path_factory.mktemp("schemas")
    return {
        "prefill": run_json_rc("prefill", "--threads", 1, "--n-predict", 2, "--bands", "--compare-q1"),
        "prefill without --compare-q1": run_json_rc("prefill", "--threads", 1, "--n-predict", 2,
                                                    "--memory-budget", "1GiB"),
        "bench": run_json_rc("bench", "--threads", 1, "--runs", 1, "--warmup", 0, "--n-predict", 2,
                             "--evidence", tmp / "bench"),
        # cap 2 is cut at resume point 127 (127 % 4 == 3): the plan has a 'start' band there
        "qualify": run_json_rc("qualify", "--threads", 1, "--widths", 2, "--resume-at", 127, "--n-predict", 2,
                               "--evidence", tmp / "qualify"),
        "diff": run_json_rc("diff", "--threads", 1, "--n-tokens", 16, "--lib", "stock", "--b", "w2", "--show", 3),
        "matrix": run_json_rc("matrix", "--n-predict", 2),
        "memory": run_json_rc("memory", "--threads", 1, "--ctx", 512, "--widths", "1,4"),
    }


REAL = {"prefill": PREFILL, "prefill without --compare-q1": PREFILL, "bench": BENCH, "qualify": QUALIFY,
        "diff": DIFF, "matrix": MATRIX, "memory": MEMORY}


@pytest.mark.parametrize("name", list(REAL))
def test_command_output_matches_its_schema(outputs, name):
    check(outputs[name], REAL[name])


def test_outputs_exercise_the_optional_parts(outputs):
    """The real runs fill the parts a schema allows to be null, so their types are checked too."""
    assert outputs["prefill"]["identical_to_q1"] is True and outputs["prefill"]["q1"] is not None
    assert outputs["prefill without --compare-q1"]["q1"] is None
    assert outputs["prefill without --compare-q1"]["memory_budget"]["budget_bytes"] == 2**30
    q = outputs["qualify"]
    assert [r["width"] for r in q["results"]] == [1, 2] and q["results"][1]["fixed_width"] is not None
    d = outputs["diff"]
    assert d["first_node"] is not None and 1 <= len(d["differing"]) <= 3
    assert {r["lib"] for r in outputs["matrix"]["rows"]} >= {"exact", "stock"}


def test_library_has_one_shape_everywhere(outputs):
    for name, out in outputs.items():
        libs = libraries(out)
        assert libs, name
        for lib in libs:
            assert set(lib) == {"flavor", "dir", "cpu"} and lib["flavor"] in ("exact", "stock"), (name, lib)
            assert lib["cpu"] == "native", (name, lib)
            assert isinstance(lib["dir"], str) and lib["dir"], (name, lib)
    assert outputs["diff"]["library"]["flavor"] == "stock"


def test_real_prefill_output_reads_back(outputs):
    for name in ("prefill", "prefill without --compare-q1"):
        r = PrefillResult.from_json(outputs[name])
        assert r.to_json() == outputs[name]
    assert PrefillResult.from_json(outputs["prefill"]).comparison is not None


def test_evidence_files_match_the_report_schemas(outputs):
    from pathlib import Path
    summary = json.loads((Path(outputs["bench"]["evidence_dir"]) / "summary.json").read_text())
    check(summary, BENCH_SUMMARY)
    results = json.loads((Path(outputs["qualify"]["evidence_dir"]) / "results.json").read_text())
    check(results, QUALIFY_RESULTS_JSON)
