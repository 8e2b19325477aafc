"""Op-level batch invariance of the exact library's CPU matrix products and flash attention
(cpu_kernels/).

cpu_kernels/tests/invariance.cpp computes every activation column (every query row) alone, width 1,
the q1 reference, and inside products of widths 1..512, with the weights placed as llama.cpp
places them (AMX, repacked, or plain memory), and reports any column that is not bit-identical.
Each check has twins that must fail: the planted bug (wide products walk K from another block, or
attention visits the cache cells in another order) on the exact library, and the stock library,
whose products change kernels with the width.

The whole module runs once per CPU build variant (dflash.native.build.CPU_VARIANTS, `dflash build --cpu
V`): a variant that is not built fails, it is never skipped. Tests marked with EVERY_VARIANT run on
every variant; the sampled cross product (threads 1 and 3, K 256/1280/4096, the AMX block sizes of
M, MoE 8/6, grouped K-quants, the flash-attention shapes) is marked with CROSS_VARIANTS, every
variant unless DFLASH_TEST_CROSS_VARIANTS names fewer (`pytest -k native` runs one variant).
"""
import json
import os
import shutil
import subprocess

import pytest

from dflash.native import build

from .conftest import cpu_variant_params, host_flags

try:  # lands with the CPU variants
    from dflash.core import cpu_isa
except ImportError:  # pragma: no cover
    cpu_isa = None

ROOT = build.SOURCE_ROOT
SOURCE = ROOT / "cpu_kernels" / "tests" / "invariance.cpp"
NATIVE = "native"
VARIANTS = tuple(getattr(build, "CPU_VARIANTS", (NATIVE,)))
# the variants that also run the sampled cross product (DFLASH_TEST_CROSS_VARIANTS: "all", the
# default, or a comma-separated list such as "native"); the others then run the core set only
# (every type at the default shape with its planted twin, the stock twins, flash attention at the
# default shape)
_cross = os.environ.get("DFLASH_TEST_CROSS_VARIANTS", "all")
CROSS = VARIANTS if _cross == "all" else tuple(v.strip() for v in _cross.split(",") if v.strip())
EVERY_VARIANT = pytest.mark.parametrize("harness", cpu_variant_params(VARIANTS), indirect=True, scope="module")
CROSS_VARIANTS = pytest.mark.parametrize("harness", cpu_variant_params([v for v in VARIANTS if v in CROSS]),
                                        indirect=True, scope="module")
# the widest checks (to 4,096): CI's job runs them on the native build, the long job on every variant
WIDE_VARIANTS = pytest.mark.parametrize("harness", cpu_variant_params([v for v in VARIANTS if v in CROSS],
                                                                      ci=(NATIVE,)), indirect=True, scope="module")

# the types the CPU backend must run on this pin: the harness enumerates them from the library
# (--list-types), and a listing without one of these is broken
MINIMUM_TYPES = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q2_K", "q3_K", "q4_K",
                 "q5_K", "q6_K", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s",
                 "iq1_m", "tq1_0", "tq2_0", "nvfp4", "q1_0", "q2_0"}
IMATRIX_TYPES = {"iq2_xxs", "iq2_xs", "iq1_s"}  # ggml_quantize_requires_imatrix on this pin
# a sample of the families for the cross product: tinyBLAS (f32, f16, bf16), plain vec_dot (q8_0,
# q5_1), repacked (q4_0, mxfp4, iq4_nl), the tiled K-quants and IQ quants (q4_K, q6_K, q2_K, iq4_xs,
# iq2_xxs with its importance matrix), ternary (tq2_0)
SAMPLE = ["f32", "f16", "bf16", "q8_0", "q5_1", "q4_0", "mxfp4", "iq4_nl", "q4_K", "q6_K", "q2_K", "iq4_xs",
          "iq2_xxs", "tq2_0"]
# the weight types AMX takes (ggml-cpu/amx: qtype_has_amx_kernels, and F16 through its AVX-512 kernel)
AMX_TYPES = ["f16", "q4_0", "q4_1", "q8_0", "q4_K", "q5_K", "q6_K", "iq4_xs"]
# weight rows (M) that reach every AMX block size: the one-token VNNI kernel takes 64-row blocks
# and a 32-row tail (M 32: 32; 64: 64; 96: 64 + 32), the F16 kernel 6-row blocks with a 2-, 4- or
# 6-row tail (32, 64, 96); the tile kernel 32 x 32 blocks with tails in the width (the widths
# 1..512). AMX takes only M a multiple of 32: 40 is the product it refuses.
AMX_M = [32, 64, 96]
WIDTHS = "1,2,3,4,5,7,8,9,15,16,17,63,64,65,127,128,129,257,512"
NARROW = "1,2,3,4,5,7,8,9,15,16,17,33,63"  # below the tiled flash-attention kernel (64 query rows)


# instruction sets each variant's libggml-cpu must be compiled for (ggml_cpu_has_*): the harness
# runs the variant it names
VARIANT_FEATURES = {
    "avx2": {"avx2": True, "fma": True, "f16c": True, "avx512": False, "avx512_vnni": False, "amx_int8": False},
    "avx512": {"avx2": True, "avx512": True, "avx512_vbmi": True, "avx512_vnni": True, "avx512_bf16": True,
               "amx_int8": True},
    "avx512-noamx": {"avx2": True, "avx512": True, "avx512_vbmi": True, "avx512_vnni": True, "avx512_bf16": True,
                     "amx_int8": False},
}


def _cpu_kwargs(cpu: str) -> dict:
    # until every build function takes cpu=, native calls them as before
    return {} if cpu == NATIVE else {"cpu": cpu}


def compile_harness(flavor: str, out_dir, cpu: str = NATIVE, gpu: str = "none") -> str:
    """invariance.cpp against one build (a CPU variant, or a GPU flavor: tests/test_vulkan.py)."""
    kw: dict = {"gpu": gpu} if gpu != "none" else _cpu_kwargs(cpu)
    if not build.is_built(flavor, **kw):
        if gpu != "none":
            pytest.fail(f"the {flavor} {gpu} llama.cpp library is not built: "
                        f"run `dflash build --lib {flavor} --gpu {gpu}`")
        if cpu == NATIVE:
            pytest.fail(f"the {flavor} llama.cpp library is not built: run scripts/setup")
        pytest.fail(f"the {flavor} llama.cpp library's {cpu} CPU backend is not built: run `dflash build --cpu {cpu}`")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (apt-get install g++)")
    prefix = build.install_dir(flavor, **kw)
    exe = out_dir / f"invariance-{flavor}-{cpu if gpu == 'none' else gpu}"
    # DT_RPATH (not RUNPATH) also serves libggml's own dependencies (libggml-rpc), which carry no rpath
    r = subprocess.run([cxx, "-O2", "-std=c++17", str(SOURCE), f"-I{prefix / 'include'}", f"-L{prefix / 'lib'}",
                        "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,--disable-new-dtags,-rpath,{prefix / 'lib'}",
                        "-o", str(exe)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"invariance.cpp does not build against {prefix}: {r.stderr[-2000:]}")
    return str(exe)


class Harness:
    """The harness of one CPU variant, compiled per flavor on first use (a flavor that is not built
    fails the tests that need it)."""

    def __init__(self, cpu: str, out_dir):
        self.cpu = cpu
        self.out_dir = out_dir
        self.exes: dict[str, str] = {}
        self.cache: dict = {}

    def __getitem__(self, flavor: str) -> str:
        if flavor not in self.exes:
            self.exes[flavor] = compile_harness(flavor, self.out_dir, self.cpu)
        return self.exes[flavor]


_HARNESSES: dict[str, Harness] = {}


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    cpu = getattr(request, "param", NATIVE)
    if cpu_isa is not None and cpu != NATIVE and (missing := cpu_isa.missing_flags(cpu)):
        pytest.skip(f"this host cannot run the {cpu} variant: its CPU lacks {', '.join(missing)}")
    if cpu not in _HARNESSES:
        _HARNESSES[cpu] = Harness(cpu, tmp_path_factory.mktemp(f"invariance-{cpu}"))
    return _HARNESSES[cpu]


class Result:
    def __init__(self, args: list[str], rows: list[dict], summary: dict):
        self.args, self.rows, self.summary = args, rows, summary

    @property
    def ok(self) -> bool:
        return self.summary["ok"]

    def differing(self) -> list[int]:
        return [x["width"] for x in self.rows if not x["identical"]]

    def describe(self) -> str:
        bad = [(x["width"], x["columns_differing"], x["max_ulp"]) for x in self.rows if not x["identical"]]
        return (f"[{' '.join(self.args)}] in {self.summary['buffer']} (threads {self.summary['threads']}): "
                f"widths differing (width, columns, ulp): {bad}")


# OpenMP workers that spin between the harness's 500+ small graphs take both cores of a small shared
# machine (ten times the run time there); passive waiting changes no kernel and no result
ENV = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive")}


def run_checks(exe: str, *checks, timeout: int = 600) -> tuple[int, list[Result]]:
    """Each check (a list of options) after the defaults (all widths, 2 threads), in one process."""
    argv: list[str] = []
    for i, c in enumerate(checks):
        argv += (["--then"] if i else []) + ["--widths", WIDTHS, "--threads", "2", *map(str, c)]
    r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=timeout, env=ENV)
    if r.returncode not in (0, 1):
        raise AssertionError(f"invariance {' '.join(argv)} crashed (rc={r.returncode}): {r.stderr[-2000:]}")
    results, rows = [], []
    for line in r.stdout.splitlines():
        if not line.startswith("{"):
            continue
        x = json.loads(line)
        if x.get("summary"):
            results.append(Result(list(map(str, checks[len(results)])), rows, x))
            rows = []
        else:
            rows.append(x)
    assert len(results) == len(checks), f"{len(checks)} checks, {len(results)} summaries: {r.stderr[-2000:]}"
    return r.returncode, results


def check(exe: str, *args) -> tuple[int, list[dict], dict]:
    rc, (res,) = run_checks(exe, list(args), timeout=300)
    return rc, res.rows, res.summary


def bound(summary: dict) -> float:
    """How far (relative) a width-1 result may be from the double-precision reference. Flash
    attention over an F16 or F32 cache: the exact flavor's kernel scores and accumulates in F32
    (about 1e-6 here); over other caches the per-row kernel converts the activations to the
    cache's dot type (about 1.2e-2 at 640 cells)."""
    if summary["op"] == "flash_attn_ext":
        return 1e-4 if summary["type"] in ("f16", "f32") else 3e-2
    return {"f32": 1e-5, "f16": 2e-3}.get(summary["type"], 3e-2)


def assert_invariant(results: list[Result], widths: int = len(WIDTHS.split(","))) -> None:
    bad = [r.describe() for r in results if not r.ok or r.differing()]
    assert not bad, "not batch-invariant:\n" + "\n".join(bad)
    for r in results:
        assert len(r.rows) == widths, r.describe()
        assert r.summary["reference_max_rel_err"] < bound(r.summary), r.summary


def assert_caught(results: list[Result]) -> None:
    """Planted twins: every width > 1 differs, width 1 never."""
    for r in results:
        assert r.ok and r.summary["planted"], r.summary
        assert all(not x["identical"] for x in r.rows if x["width"] > 1), r.describe()
        assert all(x["identical"] for x in r.rows if x["width"] == 1), r.describe()


def list_types(harness: Harness) -> dict:
    if "types" not in harness.cache:
        r = subprocess.run([harness["exact"], "--list-types"], capture_output=True, text=True, timeout=60, check=True,
                           env=ENV)
        harness.cache["types"] = json.loads(r.stdout)
    return harness.cache["types"]


def sweep(harness: Harness) -> dict[str, dict[str, Result]]:
    """Every listed type at the default shape (K 1024, M 256, threads 2) in one process (the IQ
    quantizers' tables are built once): MUL_MAT and MUL_MAT_ID placed as llama.cpp places them,
    the same in plain memory where that placement is an extra buffer type, and the planted twin."""
    if "sweep" not in harness.cache:
        types = list_types(harness)["types"]
        modes = {"mul_mat": [], "mul_mat_id": ["--op", "mul_mat_id"], "plant": ["--plant"]}
        checks = [["--type", t, *extra] for t in types for extra in modes.values()]
        _, results = run_checks(harness["exact"], *checks, timeout=1200)
        out = {mode: {} for mode in (*modes, "cpu mul_mat", "cpu mul_mat_id")}
        for c, res in zip(checks, results, strict=True):
            mode = next(m for m, extra in modes.items() if c[2:] == extra)
            out[mode][c[1]] = res
        plain = [["--type", t, "--placement", "cpu", *modes[op]] for op in ("mul_mat", "mul_mat_id")
                 for t in types if out[op][t].summary["buffer"] != "CPU"]
        if plain:
            _, results = run_checks(harness["exact"], *plain)
            for c, res in zip(plain, results, strict=True):
                out["cpu " + (c[5] if len(c) > 4 else "mul_mat")][c[1]] = res
        harness.cache["sweep"] = out
    return harness.cache["sweep"]


# ---------------------------------------------------------------- every type, default shape


@EVERY_VARIANT
def test_the_harness_runs_the_variant_it_names(harness):
    features = list_types(harness)["cpu_features"]
    flags = host_flags()
    # native: what the host has (-march=native)
    want = VARIANT_FEATURES.get(harness.cpu) or ({"avx2": "avx2" in flags, "avx512": "avx512f" in flags}
                                                 if flags else {})
    assert {k: features[k] for k in want} == want, features


@EVERY_VARIANT
def test_the_library_lists_every_weight_type(harness):
    listing = list_types(harness)
    assert MINIMUM_TYPES <= set(listing["types"]), f"missing from --list-types: {MINIMUM_TYPES - set(listing['types'])}"
    assert IMATRIX_TYPES <= set(listing["requires_imatrix"]), listing
    # what it refuses, it refuses for a reason (the activation-only quantizations, the integer types)
    assert {"q8_1", "q8_K", "i32"} <= set(listing["refused"]), listing


@EVERY_VARIANT
@pytest.mark.parametrize("op", ["mul_mat", "mul_mat_id"])
def test_every_type_is_bit_identical_to_width_one(harness, op):
    results = sweep(harness)[op]
    assert MINIMUM_TYPES <= set(results)
    assert_invariant(list(results.values()))
    # the types whose quantizer needs an importance matrix were quantized with one
    assert all(results[t].summary["imatrix"] for t in list_types(harness)["requires_imatrix"])


@EVERY_VARIANT
@pytest.mark.parametrize("op", ["mul_mat", "mul_mat_id"])
def test_every_type_in_plain_memory_is_invariant(harness, op):
    """Types llama.cpp places in an extra buffer type (repacked here), forced into plain memory."""
    placed = [t for t, r in sweep(harness)[op].items() if r.summary["buffer"] != "CPU"]
    assert placed or not list_types(harness)["extra_buffers"], "an extra buffer type that takes no weight type"
    results = sweep(harness)["cpu " + op]
    assert set(results) == set(placed)
    assert all(r.summary["buffer"] == "CPU" for r in results.values())
    assert_invariant(list(results.values()))


@EVERY_VARIANT
def test_planted_bug_is_caught_for_every_type(harness):
    """The twin: wide products that sum K in another block order must be reported at every width."""
    results = sweep(harness)["plant"]
    assert MINIMUM_TYPES <= set(results)
    assert_caught(list(results.values()))


# ---------------------------------------------------------------- placements and activations


@EVERY_VARIANT
@pytest.mark.parametrize("op", ["mul_mat", "mul_mat_id"])
@pytest.mark.parametrize("type_", ["q4_0", "iq4_nl", "mxfp4"])
def test_repacked_weights_are_invariant(harness, type_, op):
    """Repacked weights where AMX does not take them (rows not a multiple of 32, routed experts)."""
    rc, rows, summary = check(harness["exact"], "--type", type_, "--op", op, "--placement", "CPU_REPACK")
    assert rc == 0 and all(x["identical"] for x in rows), summary


@EVERY_VARIANT
@pytest.mark.parametrize("op", ["mul_mat", "mul_mat_id"])
@pytest.mark.parametrize("type_", ["q4_K", "q2_K"])
def test_repacked_kquants_are_invariant(harness, type_, op):
    """Q4_K (AVX2 and up) and Q2_K (AVX-512) repacked: the exact flavor's one-row gemv scales and
    sums each pair of subblocks as the 4-row gemm does (stock sums the whole block first), so every
    width, the gemm's 4-row groups and the gemv's leftover rows alike, is the width-1 product; also
    on 3 threads against references on 1, and at K 1280."""
    if type_ == "q2_K" and not list_types(harness)["cpu_features"]["avx512"]:
        r = subprocess.run([harness["exact"], "--type", type_, "--placement", "CPU_REPACK", "--widths", "1"],
                           capture_output=True, text=True, timeout=60, env=ENV)
        assert r.returncode == 2 and "no extra buffer type named CPU_REPACK accepts" in r.stderr, r.stderr
        return
    base = ["--type", type_, "--op", op, "--placement", "CPU_REPACK"]
    _, results = run_checks(harness["exact"], base, [*base, "--threads", 3, "--ref-threads", 1, "--k", 1280])
    assert_invariant(results)
    assert all(r.summary["buffer"] == "CPU_REPACK" for r in results)
    _, planted = run_checks(harness["exact"], [*base, "--plant"])
    assert_caught(planted)
    if op == "mul_mat":  # stock's gemv sums a block before scaling it: the twin must differ
        _, (stock,) = run_checks(harness["stock"], base)
        assert not stock.ok and stock.differing(), stock.describe()


@EVERY_VARIANT
@pytest.mark.parametrize("type_", ["f32", "q8_0", "q4_0", "mxfp4"])
def test_grouped_product_is_invariant(harness, type_):
    """A stack of matrices times permuted activations (DeepSeek-V4's grouped output projection)."""
    rc, rows, summary = check(harness["exact"], "--type", type_, "--groups", 2, "--k", 256, "--m", 64)
    assert rc == 0 and all(x["identical"] for x in rows), summary
    assert summary["reference_max_rel_err"] < 3e-2, summary


@EVERY_VARIANT
@pytest.mark.parametrize("src1", ["strided", "broadcast"])
@pytest.mark.parametrize("type_", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_K", "q6_K", "mxfp4"])
def test_strided_and_broadcast_activations_are_invariant(harness, type_, src1):
    """Activations with strided rows (a view) or a batch dimension one matrix is broadcast over,
    placed as llama.cpp places the weights. Broadcast over AMX-placed weights read past the matrix
    (heap corruption, both flavors) until AMX refused such products; the repacked Q4_0 kernels
    differed across widths for them until the exact flavor refused them too."""
    rc, rows, summary = check(harness["exact"], "--type", type_, "--src1", src1, "--k", 256, "--m", 64)
    assert rc == 0 and all(x["identical"] for x in rows), summary
    assert summary["reference_max_rel_err"] < 3e-2, summary


@EVERY_VARIANT
@pytest.mark.parametrize("type_", ["f16", "bf16"])
def test_stock_library_is_caught_on_broadcast_activations(harness, type_):
    rc, rows, _ = check(harness["stock"], "--type", type_, "--src1", "broadcast", "--k", 256, "--m", 64)
    assert rc == 1 and any(not x["identical"] for x in rows)


@EVERY_VARIANT
@pytest.mark.parametrize("type_,placement,op", [
    ("f32", "auto", "mul_mat"), ("f16", "cpu", "mul_mat"), ("bf16", "auto", "mul_mat"), ("iq4_nl", "cpu", "mul_mat"),
    ("q4_K", "cpu", "mul_mat"), ("q6_K", "cpu", "mul_mat"), ("q2_K", "auto", "mul_mat"),
    ("q4_K", "CPU_REPACK", "mul_mat"),
    ("iq2_xxs", "auto", "mul_mat"), ("iq3_s", "auto", "mul_mat"), ("q6_K", "auto", "mul_mat_id"),
    ("iq4_xs", "auto", "mul_mat_id")])
def test_stock_library_is_caught_changing_kernels(harness, type_, placement, op):
    """The stock library runs vec_dot for one token and tinyBLAS, the tiled K-quant and IQ kernels
    (from 8 rows, per expert for MUL_MAT_ID) or a repacked gemm for more: the same check fails
    there. (On this pin stock Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the ternary and FP4 types in plain
    memory and the AMX kernels happen to agree across widths; they are not twins.)"""
    rc, rows, _ = check(harness["stock"], "--type", type_, "--placement", placement, "--op", op)
    assert rc == 1 and any(not x["identical"] for x in rows)


# ---------------------------------------------------------------- the sampled cross product


@CROSS_VARIANTS
@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts_are_invariant(harness, threads):
    """The sample at the default shape with 1 and 3 threads (threads split output rows and columns,
    never K), the planted twin for a tiled and a tinyBLAS type, and the stock twin."""
    _, results = run_checks(harness["exact"], *[["--type", t, "--threads", threads] for t in SAMPLE])
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], *[["--type", t, "--threads", threads, "--plant"]
                                                for t in ("f32", "q6_K")])
    assert_caught(planted)
    # plain memory: where the host has AMX, "auto" places Q6_K in the AMX buffer, whose stock
    # kernels happen to agree across widths (not a twin)
    _, (stock,) = run_checks(harness["stock"], ["--type", "q6_K", "--threads", threads, "--placement", "cpu"])
    assert not stock.ok and stock.differing()


@CROSS_VARIANTS
def test_thread_count_of_the_reference_does_not_matter(harness):
    """Stronger than batch invariance: the width-1 reference on 1 thread, the wide products on 3."""
    shape = ["--threads", 3, "--ref-threads", 1, "--k", 512, "--m", 96]
    _, results = run_checks(harness["exact"], *[["--type", t, *shape] for t in SAMPLE])
    assert_invariant(results)
    assert all(r.summary["ref_threads"] == 1 and r.summary["threads"] == 3 for r in results)
    _, planted = run_checks(harness["exact"], ["--type", "q4_K", *shape, "--plant"])
    assert_caught(planted)


@CROSS_VARIANTS
@pytest.mark.parametrize("k", [256, 1280, 4096])
def test_reduction_lengths_are_invariant(harness, k):
    """K 256 (one 256-value block), 1280 (five) and 4096, the sample with M 128; the planted twin
    where K holds two blocks or more (q8_0 at 256, q4_K at 1280, q6_K at 4096) and the stock twin."""
    m = 64 if k == 4096 else 128
    _, results = run_checks(harness["exact"], *[["--type", t, "--k", k, "--m", m] for t in SAMPLE])
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], ["--type", {256: "q8_0", 1280: "q4_K", 4096: "q6_K"}[k], "--k", k,
                                               "--m", m, "--plant"], ["--type", "f16", "--k", k, "--m", m, "--plant"])
    assert_caught(planted)
    _, (stock,) = run_checks(harness["stock"], ["--type", "q4_K", "--placement", "cpu", "--k", k, "--m", m])
    assert not stock.ok and stock.differing()


@CROSS_VARIANTS
@pytest.mark.parametrize("m", [*AMX_M, 40])
def test_weight_row_counts_are_invariant(harness, m):
    """The AMX types at the M that reach every AMX block size (and 40, which AMX refuses), placed
    as llama.cpp places them: on a host without AMX the other kernels at those row counts."""
    _, results = run_checks(harness["exact"], *[["--type", t, "--k", 512, "--m", m] for t in AMX_TYPES])
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], *[["--type", t, "--k", 512, "--m", m, "--plant"]
                                                for t in ("f16", "q4_K")])
    assert_caught(planted)
    _, (stock,) = run_checks(harness["stock"], ["--type", "f16", "--placement", "cpu", "--k", 512, "--m", m])
    assert not stock.ok and stock.differing()


@CROSS_VARIANTS
def test_routed_experts_8_of_6_are_invariant(harness):
    """MUL_MAT_ID with 8 experts, 6 used per token, the sample; its planted and stock twins."""
    moe = ["--op", "mul_mat_id", "--experts", 8, "--used", 6, "--k", 512, "--m", 64]
    _, results = run_checks(harness["exact"], *[["--type", t, *moe] for t in SAMPLE])
    assert_invariant(results)
    assert all(r.summary["experts"] == 8 and r.summary["used"] == 6 for r in results)
    _, planted = run_checks(harness["exact"], *[["--type", t, *moe, "--plant"] for t in ("q4_K", "bf16")])
    assert_caught(planted)
    _, (stock,) = run_checks(harness["stock"], ["--type", "q6_K", *moe])
    assert not stock.ok and stock.differing()


@CROSS_VARIANTS
def test_grouped_kquant_products_are_invariant(harness):
    """3-D (grouped) products of the K-quants and IQ4_XS; the planted and stock twins."""
    grouped = ["--groups", 2, "--k", 512, "--m", 64]
    _, results = run_checks(harness["exact"], *[["--type", t, *grouped] for t in
                                                ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "iq2_xxs")])
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], *[["--type", t, *grouped, "--plant"] for t in ("q4_K", "q6_K")])
    assert_caught(planted)
    _, (stock,) = run_checks(harness["stock"], ["--type", "q6_K", *grouped])
    assert not stock.ok and stock.differing()


@EVERY_VARIANT
def test_amx_block_sizes_are_invariant(harness):
    """The AMX kernels (one-token VNNI and the tile kernel, F16's AVX-512 kernel) at every block
    size, weights in the AMX buffer, with their planted twins. Runs where the CPU backend offers
    AMX (a Sapphire Rapids or newer host with an AMX build); elsewhere one named skip."""
    listing = list_types(harness)
    if "AMX" not in listing["extra_buffers"]:
        host = "has" if {"amx_tile", "amx_int8"} <= host_flags() else "lacks"
        assert not (host == "has" and listing["cpu_has_amx_int8"]), \
            f"the host has AMX and the {harness.cpu} CPU backend was compiled with it, yet offers no AMX buffer"
        pytest.skip(f"no AMX buffer: this host's CPU {host} AMX (amx_tile, amx_int8), the {harness.cpu} CPU "
                    f"backend was compiled {'with' if listing['cpu_has_amx_int8'] else 'without'} it, and it offers "
                    f"{', '.join(listing['extra_buffers']) or 'no extra buffer type'}")
    checks = [["--type", t, "--k", 512, "--m", m, "--placement", "AMX"] for t in AMX_TYPES for m in AMX_M]
    _, results = run_checks(harness["exact"], *checks)
    assert all(r.summary["buffer"] == "AMX" for r in results)
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], *[c + ["--plant"] for c in checks])
    assert_caught(planted)


# ---------------------------------------------------------------- flash attention

# (cache type, extra options): head sizes 64..512 (DeepSeek-V4's 512, and 576/512 as MLA's), GQA
# 8/2 and 4/1, causal masks with padding cells or a sliding window, sinks and a logit softcap
ATTENTION = {
    "d128": [],
    "d64-pad": ["--head-dim", 64, "--pad", 128],
    "d128-window": ["--window", 256],
    "d256": ["--head-dim", 256, "--heads", 4, "--kv-heads", 1],
    "d512": ["--head-dim", 512, "--heads", 4, "--kv-heads", 1],
    "d576-512": ["--head-dim", 576, "--head-dim-v", 512, "--heads", 4, "--kv-heads", 1],
    "d64-sinks-softcap": ["--head-dim", 64, "--sinks", "--softcap", 30],
}
FA = ["--op", "flash_attn_ext"]


@EVERY_VARIANT
@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_flash_attention_is_invariant(harness, cache):
    """Each query row alone (its own mask row) equals the same row inside a batch of width n,
    KV 640 cells, head dim 128, 8 heads over 2 KV heads; the planted twin (the cache's cells, and
    every mask row, permuted for the wide batches)."""
    _, results = run_checks(harness["exact"], [*FA, "--type", cache])
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], [*FA, "--type", cache, "--plant"])
    assert_caught(planted)


@CROSS_VARIANTS
@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_flash_attention_shapes_are_invariant(harness, cache):
    _, results = run_checks(harness["exact"], *[[*FA, "--type", cache, *shape] for shape in ATTENTION.values()])
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], *[[*FA, "--type", cache, *ATTENTION[n], "--plant"]
                                                for n in ("d128-window", "d512")])
    assert_caught(planted)


@CROSS_VARIANTS
@pytest.mark.parametrize("threads", [1, 3])
def test_flash_attention_thread_counts_are_invariant(harness, threads):
    """Threads 1 and 3, the F16 and Q8_0 caches, other cache types (BF16, Q4_0), the wide runs on
    `threads` and the width-1 reference on the other count; the planted twin."""
    other = 3 if threads == 1 else 1
    checks = [[*FA, "--type", t, "--threads", threads, "--ref-threads", other] for t in ("f16", "q8_0", "bf16", "q4_0")]
    _, results = run_checks(harness["exact"], *checks)
    assert_invariant(results)
    _, planted = run_checks(harness["exact"], [*FA, "--threads", threads, "--plant"])
    assert_caught(planted)


@EVERY_VARIANT
def test_flash_attention_over_long_caches_and_their_views(harness):
    """Caches of 4K and 16K cells (many fixed splits per row: one query row spreads its splits over
    the threads, a batch walks them in order), each width-1 reference seeing only the cells up to its
    own padded to 256 as llama.cpp's view of the cache after one token (--ref-view), or up to its own
    exactly (a partial last tile); masked cells in the middle of the batches' cache (--holes: as
    DeepSeek-V4's raw cells grow in front of its compressed rows with the batch); GQA 4:1 and
    DeepSeek-V4's 576/512 heads with one KV head for 16 query heads; F16 and F32 caches."""
    checks = [
        [*FA, "--kv", 4096, "--ref-view", 256],
        [*FA, "--kv", 16384, "--heads", 4, "--kv-heads", 1, "--ref-view", 256, "--widths", "1,2,4,8,9,64,65,512"],
        [*FA, "--kv", 3000, "--ref-view", 1, "--threads", 3, "--ref-threads", 1],
        [*FA, "--kv", 2000, "--holes", 300, "--ref-view", 256],
        [*FA, "--kv", 1300, "--holes", 37, "--window", 300, "--sinks"],
        [*FA, "--kv", 2500, "--head-dim", 576, "--head-dim-v", 512, "--heads", 16, "--kv-heads", 1, "--ref-view", 256],
        [*FA, "--kv", 1700, "--type", "f32", "--head-dim", 80, "--heads", 6, "--kv-heads", 6, "--ref-view", 7],
    ]
    _, results = run_checks(harness["exact"], *checks, timeout=900)
    for r, c in zip(results, checks, strict=True):
        assert_invariant([r], widths=8 if "--widths" in c else len(WIDTHS.split(",")))
    _, planted = run_checks(harness["exact"], [*FA, "--kv", 4096, "--ref-view", 256, "--plant"])
    assert_caught(planted)


WIDE = "1,2,513,1024,1500,2048,4096"  # --chunk up to 4096 (dflash.core.settings.MAX_CHUNK)


@WIDE_VARIANTS
def test_widths_beyond_512_are_invariant(harness):
    """The widths --chunk takes past 512, up to 4,096 tokens per ubatch: products of the tinyBLAS,
    plain, repacked and tiled K-quant families (MUL_MAT and MUL_MAT_ID) and flash attention over
    4,608 F16 and F32 cells, every column bit-identical to width 1; the planted twin is caught at
    every wide width and the stock library differs."""
    types = ["f32", "f16", "q8_0", "q4_0", "mxfp4", "q4_K", "q6_K", "iq4_xs"]
    checks = [["--type", t, "--op", op, "--widths", WIDE] for t in types for op in ("mul_mat", "mul_mat_id")]
    checks += [[*FA, "--type", c, "--kv", 4608, "--widths", WIDE] for c in ("f16", "f32")]
    _, results = run_checks(harness["exact"], *checks, timeout=900)
    for r in results:
        assert_invariant([r], widths=len(WIDE.split(",")))
    _, planted = run_checks(harness["exact"], ["--type", "q4_K", "--widths", WIDE, "--plant"],
                            [*FA, "--kv", 4608, "--widths", WIDE, "--plant"])
    assert_caught(planted)
    _, stock = run_checks(harness["stock"], ["--type", "q4_K", "--widths", WIDE, "--placement", "cpu"],
                          [*FA, "--type", "f16", "--kv", 4608, "--widths", WIDE])
    assert all(r.differing() for r in stock), [r.describe() for r in stock]


@EVERY_VARIANT
def test_stock_flash_attention_is_caught_by_masked_cells_moving(harness):
    """The stock library's kernels walk the cache by cell index: the same visible cells with masked
    cells inserted among them change its results at every width (its split-KV path at width 1 too,
    the reference being one width-1 run), where the exact library's do not move (the test above)."""
    _, (res,) = run_checks(harness["stock"], [*FA, "--kv", 2000, "--holes", 300, "--ref-view", 256])
    assert not res.ok
    assert len(res.differing()) == len(WIDTHS.split(",")), res.describe()


@EVERY_VARIANT
def test_stock_flash_attention_is_caught_by_its_tiled_kernel(harness):
    """Stock flash attention takes a tiled kernel from 64 query rows (F16 cache): every width from
    64 differs from the per-row kernel's width-1 rows."""
    _, (res,) = run_checks(harness["stock"], [*FA, "--type", "f16"])
    assert not res.ok
    assert {w for w in res.differing()} == {int(w) for w in WIDTHS.split(",") if int(w) >= 64}, res.describe()


@EVERY_VARIANT
def test_stock_flash_attention_is_caught_by_its_split_kv_path(harness):
    """Stock runs one query row over 512+ cells of an F16 cache as per-thread KV chunks merged at
    the end: with KV 1280 every row sees cells of both threads' chunks, and every narrow width (per-row
    kernel, below the tiled one) differs from width 1. With one thread the split is one chunk, and
    a reference on one thread is caught by the merge of three."""
    _, (split,) = run_checks(harness["stock"], [*FA, "--type", "f16", "--kv", 1280, "--widths", NARROW])
    assert not split.ok and split.differing() == [int(w) for w in NARROW.split(",")[1:]], split.describe()
    _, (threads,) = run_checks(harness["stock"], [*FA, "--type", "f16", "--kv", 1280, "--widths", NARROW,
                                                   "--threads", 3, "--ref-threads", 1])
    assert not threads.ok and threads.differing() == [1], threads.describe()
    # the exact library at the same shapes
    narrow = [*FA, "--type", "f16", "--kv", 1280, "--widths", NARROW]
    _, results = run_checks(harness["exact"], narrow, [*narrow, "--threads", 3, "--ref-threads", 1])
    assert_invariant(results, widths=len(NARROW.split(",")))


@CROSS_VARIANTS  # a pattern other backends fuse (tests/test_vulkan.py); here the CPU backend's own ops
def test_the_add_norm_pattern_is_invariant_and_its_plant_is_caught(harness):
    """--op add_rms_norm: rms_norm(x + r) * w as one graph; every row of every width equals the row
    alone, and the planted twin (the wide runs' norm with another epsilon) differs at every width >= 2."""
    _, results = run_checks(harness["exact"], ["--op", "add_rms_norm", "--k", 640],
                            ["--op", "add_rms_norm", "--k", 640, "--plant"])
    assert_invariant(results[:1])
    assert_caught(results[1:])


# ---------------------------------------------------------------- usage


@CROSS_VARIANTS  # the harness's own option handling: one variant is enough
@pytest.mark.parametrize("args,message", [
    (["--type", "q4_K", "--k", 256, "--plant"], "at least two blocks"),
    (["--type", "iq2_xxs", "--imatrix", "off"], "needs an importance matrix"),
    (["--type", "q8_1"], "no matrix product for q8_1"),
    (["--op", "flash_attn_ext", "--kv", 100], "--kv must hold the widest batch"),
    (["--op", "flash_attn_ext", "--heads", 6, "--kv-heads", 4], "--heads must be a multiple of --kv-heads"),
    (["--experts", 4, "--used", 6, "--op", "mul_mat_id"], "--used must be <= --experts"),
    (["--list-types", "--then", "--type", "f16"], "--list-types runs alone"),
    (["--threads", 0], "--threads wants an integer"),
    (["--op", "flash_attn_ext", "--holes", 10, "--plant"], "one at a time"),
    (["--type", "q4_0", "--holes", 10], "apply to flash_attn_ext"),
    (["--op", "add_rms_norm", "--type", "q4_0"], "runs f32 rows"),
], ids=["plant-one-block", "imatrix-off", "no-product", "kv-too-short", "gqa", "used", "list-then", "threads",
        "holes-plant", "holes-mul-mat", "add-norm-type"])
def test_usage_errors_exit_2_with_one_line(harness, args, message):
    r = subprocess.run([harness["exact"], *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""
