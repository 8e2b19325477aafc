"""The exact Vulkan flavor on Mesa's lavapipe (a Vulkan driver that runs on the CPU): ggml's Vulkan
backend executes its shaders here for real, so the exact flavor's routing (vulkan_kernels/patches/
exact) is checked the way the CPU kernels are.

Op level: cpu_kernels/tests/invariance.cpp with --backend Vulkan0 computes every column (query
row) alone and inside products of widths 1, 2, 4, 8, 9, 64 and 512; every one must be bit for bit
its width-1 result. Widths 1..8 of MUL_MAT run the exact flavor's K-parallel narrow mode (one
invocation per row and 32 elements of K, whose two 16-element partials are folded in order with a
compensated sum; every pass geometry a GPU can get is forced too), 9 and beyond the s/m/l tiles:
the same per-output additions. A fused pattern runs too
(--op add_rms_norm: ADD, RMS_NORM and MUL as one graph, which ggml-vulkan fuses at one row unless
the exact flavor stops it), and products over K plus a tail of zero activations (--zero-tail: non-flash
attention multiplies a cache view that grows with the batch, its extra cells weighted 0), which must
equal width 1 over K. The twins that must fail: the harness's planted bug (--plant), the
library's planted bugs (DFLASH_VK_EXACT=plant: the mat-vec shaders for 2..8 columns again;
DFLASH_VK_EXACT=plant-fusion: the add hands the norm its partial sums again at one row;
DFLASH_VK_EXACT=plant-kpar: the narrow mode walks a row's chunks last to first, each as one chain) and
llama.cpp's own routing in the same build (DFLASH_VK_EXACT=0: mat-vec up to 8 columns, mul_mm
beyond, split-K, flash attention tuned per batch, the add+norm fusion), the stock twin.

Contraction: every floating-point operation of the exact flavor's product shaders, as embedded in
the library, is decorated NoContraction (dflash/native/spirv.py reads the shipped SPIR-V; a module with
one decoration removed is the twin), so a driver cannot fuse or split them differently per path.

Precision: the exact flavor computes in f32 (stock's wide products use f16-accumulating pipelines on
an fp16 device): width 1 against a double-precision product must be no further from it than stock's
width 1 (f32 mat-vec), type by type.

Flash attention (patch 0012, on in the exact flavor on Vulkan): splits of a fixed size from cell 0,
forced smaller and with the rows in chunks on lavapipe; its twins are splits sized from the cache
view (DFLASH_VK_EXACT=plant-fa), chunks of rows reading the first chunk's mask rows (plant-chunk)
and holes that do not fill whole splits.

Model level: tiny DeepSeek-V4 presets on vulkan:0, cache-cold prefills of one prompt in
fixed-width bands (tests/variant_prefill.py): q1 and bands of 4 and 9 over 40 tokens (F16, Q4_K_M),
2..64 over 80 tokens and 9 over 270 (MXFP4; the band at 252..260 crosses a split boundary that q1's
rows do not) must give q1's logits at every position and q1's response; with DFLASH_VK_EXACT=0
bands of 9, with plant-fusion q1, and with plant-fa the band of 9 over 270, must not.
`dflash diff` on Vulkan must call the planted fusion a difference although every tapped node
agrees. Every preset at 2, 4, 8, 9, 64 over 80 tokens, Gemma 3 270M and `dflash qualify` are the
by-hand run (benchmarks/vulkan_models.py; docs/guides/vulkan.md): lavapipe compiles each pipeline on first
use, and that compile (a cold Mesa shader cache on a fresh machine) is most of these tests' time.

Cost: the op-level checks reference every column alone, so width 512 costs 8 times width 64: a
few checks run to 512, the rest to 64 (about 4 minutes with a cold shader cache). On a fresh
machine most of this file's time is lavapipe's first compile of each pipeline, and each forced
geometry or routing mode is pipelines of its own: CI's job runs the device's and a GPU's narrow
geometry and llama.cpp's routing at model level; flash attention's forced splits and rows, 64
chunks a row, llama.cpp's routing at op level (the library's planted routing and the harness's
plant stay), the CPU+Vulkan split and stock Vulkan carry the `long` mark (.ci/run-long;
docs/development/ci.md has the times).

Stock Vulkan runs too: llama.cpp's own build (its defaults: flash attention with split-K) on the
tiny DeepSeek-V4 model at q1 and bands of 4, 9 and 64, which crashed lavapipe before common patch
0008 (every binding of a reused descriptor set written).

Needs both Vulkan builds (`scripts/setup --all` or `--vulkan`) and lavapipe (mesa-vulkan-drivers):
without them these tests fail, they are never skipped.
"""
import json
import os
import struct
import subprocess
import sys

import pytest

from dflash.core.errors import DflashError
from dflash.native import build, devices, spirv
from dflash.serving import server

from .conftest import run_dflash, run_json
from .test_cpu_kernels import compile_harness

ROOT = build.SOURCE_ROOT
WIDTHS = "1,2,4,8,9,64,512"
NARROWER = "1,2,4,8,9,64"  # the harness runs every column alone for the reference: 64 costs an eighth of 512
# (check, widths): the widest checks first; every type, op and attention shape at least to 64
CHECKS = [(["--type", "q4_0"], WIDTHS), (["--type", "mxfp4"], WIDTHS),
          (["--type", "q4_K", "--op", "mul_mat_id"], WIDTHS), (["--op", "flash_attn_ext"], WIDTHS),
          *((["--type", t], NARROWER) for t in ("f32", "f16", "q8_0", "q5_0", "q4_K", "q6_K")),
          *((["--type", t, "--op", "mul_mat_id"], NARROWER) for t in ("f16", "q4_0", "q5_0", "q8_0", "mxfp4")),
          *((["--op", "flash_attn_ext", *shape], NARROWER)
            for shape in (["--ref-view", "256"], ["--holes", "256", "--holes-at", "256"],
                          ["--window", "128", "--sinks"], ["--kv", "1100"],
                          ["--kv", "200", "--pad", "300", "--ref-view", "256"],
                          ["--kv", "4096", "--ref-view", "256"],
                          ["--head-dim", "64", "--heads", "4", "--kv-heads", "4"])),
          (["--op", "add_rms_norm", "--k", "640"], WIDTHS),
          # every width over K + a tail of zero activations equals width 1 over K (attention's cache view)
          (["--type", "f16", "--k", "1000", "--zero-tail", "200"], NARROWER),
          (["--type", "f32", "--zero-tail", "256"], NARROWER)]
# width 1 against a double-precision product, exact and stock side by side (docs/guides/vulkan.md)
PRECISION_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_K", "q6_K", "mxfp4")
# lavapipe is listed by ggml only when named (it skips CPU drivers otherwise): vulkan:0 here
ENV = {**os.environ, "GGML_VK_VISIBLE_DEVICES": "0"}


@pytest.fixture(scope="module")
def lavapipe():
    found, reason = devices.vulkan_devices()
    if not found:
        pytest.fail(f"no Vulkan device: {reason} (scripts/setup --vulkan installs lavapipe)")
    assert "llvmpipe" in found[0].arch, f"vulkan:0 is {found[0].name} ({found[0].arch}), not lavapipe"
    return found[0]


@pytest.fixture(scope="module")
def harness(tmp_path_factory, lavapipe):
    return compile_harness("exact", tmp_path_factory.mktemp("vk"), gpu="vulkan")


def run(exe: str, checks: list[list[str]], env: dict | None = None, widths: list[str] | None = None) -> list[dict]:
    """Each check on Vulkan0 (at `widths[i]`, default WIDTHS) in one process; one summary per check,
    its width rows under "rows", its widths under "widths_asked"."""
    widths = widths or [WIDTHS] * len(checks)
    argv: list[str] = []
    for i, c in enumerate(checks):
        argv += (["--then"] if i else []) + ["--backend", "Vulkan0", "--widths", widths[i], *c]
    r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=900, env={**ENV, **(env or {})})
    if r.returncode not in (0, 1):
        raise AssertionError(f"invariance {' '.join(argv)} crashed (rc={r.returncode}): {r.stderr[-2000:]}")
    out, rows = [], []
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            x = json.loads(line)
            if x.get("summary"):
                out.append({**x, "rows": rows, "args": checks[len(out)],
                            "widths_asked": [int(w) for w in widths[len(out)].split(",")]})
                rows = []
            else:
                rows.append(x)
    assert len(out) == len(checks), f"{len(checks)} checks, {len(out)} summaries: {r.stderr[-2000:]}"
    for s in out:
        assert s["backend"] == "Vulkan0" and s["buffer"] == "Vulkan0", s
    return out


def differing(s: dict) -> list[int]:
    return [x["width"] for x in s["rows"] if not x["identical"]]


@pytest.fixture(scope="module")
def exact(harness):
    return run(harness, [c for c, _ in CHECKS], widths=[w for _, w in CHECKS])


def test_every_product_and_attention_row_is_bit_identical_to_width_one(exact):
    bad = [(s["args"], differing(s)) for s in exact if not s["ok"] or differing(s)]
    assert not bad, f"not batch-invariant on lavapipe: {bad}"
    for s in exact:
        assert [x["width"] for x in s["rows"]] == s["widths_asked"], s["args"]
        # how close width 1 is to a double-precision result: f32 arithmetic (the f16-accumulating
        # pipelines stock picks were ~1.5e-2 here); a diagnostic bound, never the verdict
        assert s["reference_max_rel_err"] < 1e-5, (s["args"], s["reference_max_rel_err"])


def test_width_one_is_as_accurate_as_stock_width_one(harness):
    """Each product's width 1 against a double-precision product (K 1024, the harness's seed): the
    exact flavor's f32 mul_mm (16-element partials, compensated fold: patch 0011) must be no further
    from it than stock's f32 mat-vec (per-thread partial sums and a tree), type by type; both are
    deterministic on one driver. docs/guides/vulkan.md has the figures (about 8e-8..1.1e-7 against
    9e-8..2.8e-7). Patch 0010's plain fold of 32-element partials fails it (Q4_0 1.6e-7 against
    9.1e-8, Q6_K 2.4e-7 against 9.5e-8), one chain over K (~1.5e-6) and f16 accumulation (~1.5e-2)
    fail the absolute bound too."""
    checks = [["--type", t] for t in PRECISION_TYPES]
    exact = run(harness, checks, widths=["1"] * len(checks))
    stock = run(harness, checks, env={"DFLASH_VK_EXACT": "0"}, widths=["1"] * len(checks))
    worse = []
    for e, s in zip(exact, stock, strict=True):
        print(e["type"], "exact", e["reference_max_rel_err"], "stock", s["reference_max_rel_err"])
        assert s["reference_max_rel_err"] < 1e-6, s  # stock's width 1 is f32 mat-vec
        assert e["reference_max_rel_err"] < 2e-7, e
        if e["reference_max_rel_err"] > s["reference_max_rel_err"]:
            worse.append((e["type"], e["reference_max_rel_err"], s["reference_max_rel_err"]))
    assert not worse, f"exact width 1 further from the double-precision product than stock's: {worse}"


def test_the_planted_bug_is_caught(harness):
    """--plant: the wide runs sum K (the cache cells) in another order; every width >= 2 differs
    (add_rms_norm: the wide runs' norm takes another epsilon). The products are F16 (blocks of one
    element, so the rotation moves every element to another 16-element chain): for a quantized type
    the plant rotates whole blocks of 32 or 256, which moves whole chains, and since patch 0011 the
    compensated fold of the chains gives the same bits in either order (measured: Q4_0, Q4_K, MXFP4
    unchanged by it), so it would plant nothing there."""
    checks = [["--type", "f16", "--plant"], ["--type", "f16", "--op", "mul_mat_id", "--plant"],
              ["--op", "flash_attn_ext", "--plant"], ["--op", "add_rms_norm", "--k", "640", "--plant"]]
    for s in run(harness, checks, widths=[NARROWER] * len(checks)):
        assert s["ok"] and s["planted"], s["args"]
        assert differing(s) == s["widths_asked"][1:], (s["args"], differing(s))


@pytest.mark.long
def test_llama_cpps_own_routing_is_caught(harness):
    """The stock twin: DFLASH_VK_EXACT=0 gives the same build llama.cpp's routing back (mat-vec up to
    8 columns, mul_mm beyond; flash attention tuned per batch), which changes a column's bits with
    the width. The --zero-tail check fails under it too (from 9 on: the tiles against the width-1
    mat-vec); the failure it exists for, a fold that is moved by zero partials (patch 0011's first,
    Kahan version), was shown by hand only (vulkan_kernels/README.md)."""
    checks = [["--type", "q4_0"], ["--type", "q4_K", "--op", "mul_mat_id"], ["--op", "flash_attn_ext"],
              ["--type", "f16", "--k", "1000", "--zero-tail", "200"]]
    for s in run(harness, checks, env={"DFLASH_VK_EXACT": "0"}, widths=["1,2,8,9,64"] * len(checks)):
        assert not s["ok"] and differing(s), s["args"]
        assert 9 in differing(s) and 1 not in differing(s), (s["args"], differing(s))


def test_the_fused_add_norm_twins_are_caught(harness):
    """ggml-vulkan fuses ADD+RMS_NORM at one row (the add hands the norm partial sums of squares):
    with llama.cpp's routing (DFLASH_VK_EXACT=0) and with the planted fusion (plant-fusion) every
    wider batch differs from the fused width 1; the exact flavor turns the fusion off."""
    # whether the partial sums give another float depends on the row's values: of 64 rows of 4,096
    # values, 13 differ (at seed 42; 1 of the first 9), so the wide batch is the one that must differ
    check = [["--op", "add_rms_norm", "--k", "4096"]]
    for mode in ("0", "plant-fusion"):
        (s,) = run(harness, check, env={"DFLASH_VK_EXACT": mode}, widths=["1,9,64"])
        assert 64 in differing(s) and 1 not in differing(s), (mode, differing(s))


def test_the_librarys_planted_routing_is_caught(harness):
    """DFLASH_VK_EXACT=plant: the exact routing with the mat-vec shaders back for 2..8 columns."""
    (s,) = run(harness, [["--type", "q4_0"]], env={"DFLASH_VK_EXACT": "plant"}, widths=[NARROWER])
    assert differing(s) == [2, 4, 8], differing(s)


# "": the device's own geometry (1 chunk per row on lavapipe); 16, a GPU's; 64, more than any
GEOMETRIES = ["", "16", pytest.param("64", marks=pytest.mark.long)]


@pytest.mark.parametrize("chunks", GEOMETRIES)
def test_every_pass_geometry_of_the_narrow_path_is_bit_identical(harness, chunks):
    """Widths 1..8 run mul_mm's K-parallel mode (patch 0006): one (row, 32-chunk) per invocation,
    its two 16-element partials folded into the row's total in order (patch 0011). How many chunks
    of a row run side by side (1 on lavapipe, each invocation walking 4 or 8 rows (patch 0010); 16
    on a GPU) must not change a bit: GPU geometries forced on lavapipe, against the tiled widths 9
    and 33 (K 1000: a last chunk of 8, its second slot wholly past K, a +0 partial folded to
    nothing; K 1016: a second slot of 8 and zero padding; M 100: a partial workgroup)."""
    checks = [*(["--type", t] for t in PRECISION_TYPES), ["--type", "q5_0"], ["--type", "f32", "--k", "1000"],
              ["--type", "f32", "--k", "1016"],
              ["--type", "f16", "--src1", "broadcast"], ["--type", "q4_0", "--groups", "4"],
              ["--type", "q4_K", "--src1", "strided"], ["--type", "q5_0", "--m", "100"]]
    env = {"DFLASH_VK_KPAR_CHUNKS": chunks} if chunks else None
    got = run(harness, checks, env=env, widths=["1,2,3,8,9,33"] * len(checks))
    bad = [(s["args"], differing(s)) for s in got if not s["ok"] or differing(s)]
    assert not bad, (chunks, bad)


def test_a_pass_geometry_that_is_not_a_power_of_two_is_refused(harness):
    r = subprocess.run([harness, "--backend", "Vulkan0", "--type", "f16", "--widths", "1,2"], capture_output=True,
                       text=True, timeout=300, env={**ENV, "DFLASH_VK_KPAR_CHUNKS": "3"})
    assert r.returncode != 0 and "DFLASH_VK_KPAR_CHUNKS=3" in r.stderr


def test_the_planted_narrow_mode_is_caught(harness):
    """DFLASH_VK_EXACT=plant-kpar: the K-parallel mode walks a row's chunks last to first and sums
    each as one 32-element chain instead of two 16-element slots (at every narrow width, lavapipe's
    4 and 8 included); the tiled widths 9 and 33 keep the slots in order, so they differ from width
    1, the harness's reference, while the narrow widths agree with it. (The reversed walk alone is no
    longer caught since patch 0011: the compensated fold makes the sum of the partials nearly
    independent of their order.)"""
    checks = [["--type", "q4_0"], ["--type", "f16"], ["--type", "q4_K"]]
    for s in run(harness, checks, env={"DFLASH_VK_EXACT": "plant-kpar"}, widths=["1,2,4,8,9,33"] * len(checks)):
        assert differing(s) == [9, 33], (s["args"], differing(s))


def exact_vulkan_library():
    lib = build.library_dir("exact", "vulkan") / "libggml-vulkan.so"
    assert lib.is_file(), f"{lib} missing: scripts/setup --vulkan builds it"
    return lib


def test_every_float_operation_of_the_exact_products_is_no_contraction():
    """Patch 0007: every floating-point operation of mul_mm's f32 shaders, as embedded in the
    library the driver is handed, carries NoContraction, so no driver (RADV's fusing compiler
    included) can round the K-parallel mode and the tiles differently. The stock build's carry none."""
    report = spirv.contraction_report(exact_vulkan_library())
    names = {c.module for c in report}
    assert {"matmul_quant_f32_fp32", "matmul_f16_f32_fp32", "matmul_f32_f32_fp32"} <= names, names
    assert any(n.startswith("matmul_id_") for n in names), names
    assert not [c.to_json() for c in report if not c.precise]
    assert sum(c.float_ops for c in report) > 1000


def test_one_contractible_operation_is_found():
    """The check's twin: the same shipped module with one NoContraction decoration turned into
    another (RelaxedPrecision) must be reported with exactly that one operation loose."""
    module = spirv.embedded_modules(exact_vulkan_library())["matmul_quant_f32_fp32"]
    words = list(struct.unpack(f"<{len(module) // 4}I", module))
    i = 5
    while not (words[i] & 0xFFFF == spirv.OP_DECORATE and words[i + 2] == spirv.NO_CONTRACTION):
        i += words[i] >> 16
    words[i + 2] = 0  # RelaxedPrecision
    planted = spirv.float_ops(struct.pack(f"<{len(words)}I", *words), "planted")
    assert not planted.precise and sum(planted.contractible.values()) == 1, planted
    with pytest.raises(DflashError, match="not a SPIR-V module"):
        spirv.float_ops(module[4:], "shifted")


@pytest.mark.long
def test_flash_attention_splits_are_fixed_from_cell_zero(harness):
    """Patch 0012: a row's cells are summed in splits of 256 cells from cell 0 at every width and
    cache size, merged by the split-K reduce in split order, and a row whose cells fit one split
    finishes in the attention shader with the reduce's own steps (CHECKS: references over 256
    cells, one split, against batches over 500, two). Forced splits of 64 cells (DFLASH_VK_FA_SPLIT)
    against width-1 references over one or two splits and batches over five, a cache of 1,100
    cells, masked holes filling whole splits, sinks and a window (each with lavapipe's one query row
    per workgroup and with a GPU's up to 8, DFLASH_VK_FA_ROWS; patch 0013), and query rows in
    chunks (DFLASH_VK_FA_SCRATCH: the scratch for 4,096 cells at 64 rows would pass it) are all
    identical to width 1. Twins: splits sized from the cache as llama.cpp sizes them
    (DFLASH_VK_EXACT=plant-fa) differ once the reference's cache view is shorter than the batch's;
    chunks of rows that all read the first chunk's mask rows (plant-chunk) differ at 64;
    holes that do not fill whole splits move cells to other splits and differ (the limit: a row's
    visible cells must keep their offsets from the split grid; the one cache view llama.cpp starts at
    a cell that depends on the batch, DeepSeek-V4's raw window ahead of its compressed rows, starts
    and ends on multiples of 256 cells); a split size that does not divide 256 and a row count that
    is not 1, 2, 4 or 8 are refused."""
    fa = ["--op", "flash_attn_ext"]
    split = {"DFLASH_VK_FA_SPLIT": "64"}
    checks = [[*fa, "--kv", "100", "--pad", "200", "--ref-view", "64"], [*fa, "--kv", "1100", "--ref-view", "256"],
              [*fa, "--holes", "128", "--holes-at", "192", "--window", "128", "--sinks"]]
    got = [s for rows in ("", "8") for s in  # the device's most rows per workgroup (1 on lavapipe), a GPU's
           run(harness, checks, env={**split, **({"DFLASH_VK_FA_ROWS": rows} if rows else {})},
               widths=[NARROWER] * len(checks))]
    (chunked,) = run(harness, [[*fa, "--kv", "4096", "--ref-view", "256"]],
                     env={**split, "DFLASH_VK_FA_SCRATCH": "200000"}, widths=["1,9,64"])
    bad = [(s["args"], differing(s)) for s in [*got, chunked] if not s["ok"] or differing(s)]
    assert not bad, bad
    misview = {**split, "DFLASH_VK_FA_SCRATCH": "200000", "DFLASH_VK_EXACT": "plant-chunk"}
    (misviewed,) = run(harness, [[*fa, "--kv", "4096", "--ref-view", "256"]], env=misview, widths=["1,9,64"])
    assert 64 in differing(misviewed), differing(misviewed)
    (planted,) = run(harness, [[*fa, "--kv", "200", "--pad", "300", "--ref-view", "256"]],
                     env={"DFLASH_VK_EXACT": "plant-fa"}, widths=[NARROWER])
    assert {9, 64} <= set(differing(planted)), differing(planted)
    (unaligned,) = run(harness, [[*fa, "--holes", "64"]], widths=["1,512"])  # the middle: cell 320
    assert differing(unaligned) == [512], differing(unaligned)
    for bad_env in ({"DFLASH_VK_FA_SPLIT": "96"}, {"DFLASH_VK_FA_ROWS": "3"}):
        r = subprocess.run([harness, "--backend", "Vulkan0", *fa, "--widths", "1,2"], capture_output=True,
                           text=True, timeout=300, env={**ENV, **bad_env})
        ((name, value),) = bad_env.items()
        assert r.returncode != 0 and f"{name}={value}" in r.stderr, r.stderr[-500:]


def test_a_bad_routing_value_is_one_line(harness):
    r = subprocess.run([harness, "--backend", "Vulkan0", "--type", "f16", "--widths", "1,2"], capture_output=True,
                       text=True, timeout=300, env={**ENV, "DFLASH_VK_EXACT": "maybe"})
    assert r.returncode != 0 and "DFLASH_VK_EXACT=maybe" in r.stderr


# ---------------------------------------------------------------- model level


def prefill_widths(model, widths: str, tokens: int, env: dict | None = None,
                   device: str = "vulkan:0", lib: str = "exact") -> dict[int, dict]:
    """Every width's fingerprints (tests/variant_prefill.py: one process, cache-cold runs of the
    same prompt in fixed-width bands) on `device` with the `lib` flavor's Vulkan build."""
    return prefill_models([model], widths, tokens, env, device, lib)[str(model)]


def prefill_models(models: list, widths: str, tokens: int, env: dict | None = None,
                   device: str = "vulkan:0", lib: str = "exact") -> dict[str, dict[int, dict]]:
    """prefill_widths for several models in one process (one library load), by model path."""
    cmd = [sys.executable, "-m", "tests.variant_prefill", "--device", device, "--lib", lib, "--widths", widths,
           "--tokens", str(tokens), "--threads", "2", *map(str, models)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "GGML_VK_"))},
                            **(env or {})})
    assert r.returncode == 0, r.stderr[-2000:]
    out: dict[str, dict[int, dict]] = {str(m): {} for m in models}
    for line in r.stdout.splitlines():
        d = json.loads(line)
        assert d["n_tokens"] == tokens and d["library"]["flavor"] == lib, d
        assert d["widths_run"][-1] == min(d["width"], tokens), d  # a band of the width was really decoded
        assert d["devices"] == device.split(","), d
        out[d["model"]][d["width"]] = d
    for m, runs in out.items():
        assert sorted(runs) == sorted(int(w) for w in widths.split(",")), (m, runs)
    return out


def differing_widths(runs: dict[int, dict]) -> list[int]:
    q1 = runs[1]
    return [w for w, d in runs.items()
            if (d["logits_sha256"], d["response_sha256"]) != (q1["logits_sha256"], q1["response_sha256"])]


def test_bands_are_bit_identical_to_q1_on_lavapipe(lavapipe, tiny_models):
    """Widths 2..64 over 80 tokens (the sliding window of 64 and compressor boundaries crossed):
    every position's logits and the response equal q1's. (512 over 520 tokens, every preset and
    Gemma: benchmarks/vulkan_models.py, by hand; README.)"""
    assert not differing_widths(prefill_widths(tiny_models["mxfp4"], "1,2,4,8,9,64", 80))


def test_the_f16_and_k_quant_presets_are_bit_identical_to_q1_on_lavapipe(lavapipe, tiny_models):
    """The presets that differed before the add+norm fusion was turned off (its planted twin is the
    next test), in one process: narrow (4) and tiled (9) bands over 40 tokens equal q1. Q4_K_M
    holds Q4_K, Q5_0, Q6_K and Q8_0 tensors, f16 F16 ones. The F32, Q8_0, Q4_0 and Q6_K presets
    are in the by-hand run (benchmarks/vulkan_models.py, README): each is a few minutes of
    pipeline compiles on a cold Mesa cache, and their weight types run here at op level."""
    presets = ("f16", "q4_k_m")
    runs = prefill_models([tiny_models[w] for w in presets], "1,4,9", 40)
    bad = {w: differing_widths(runs[str(tiny_models[w])]) for w in presets}
    assert not any(bad.values()), bad


@pytest.mark.long
def test_flash_attention_splits_are_bit_identical_to_q1_at_model_level(lavapipe, tiny_models):
    """Flash attention is on in the exact flavor (patch 0012: splits of 256 cells from cell 0). Over
    270 tokens the band of 9 at positions 252..260 runs over a cache view of 512 cells (two splits,
    merged by the reduce) where q1's positions 252..255 ran over 256 (one split, finished in the
    attention shader): every position's logits and the response equal q1's, with lavapipe's one
    query row per workgroup and with a GPU's up to 8 (DFLASH_VK_FA_ROWS=8: the band's rows share
    workgroups; patch 0013). Twin: splits sized from the cache view (DFLASH_VK_EXACT=plant-fa) give
    that band other bits."""
    exact = prefill_widths(tiny_models["mxfp4"], "1,9", 270)
    assert not differing_widths(exact)
    assert all(d["flash_attn"] == "on" for d in exact.values()), exact
    # q1 has one row per workgroup under either ceiling: the band of 9 alone, against the q1 above
    gpu_rows = prefill_widths(tiny_models["mxfp4"], "9", 270, env={"DFLASH_VK_FA_ROWS": "8"})
    assert (gpu_rows[9]["logits_sha256"], gpu_rows[9]["response_sha256"]) == \
        (exact[1]["logits_sha256"], exact[1]["response_sha256"])
    planted = prefill_widths(tiny_models["mxfp4"], "1,9", 270, env={"DFLASH_VK_EXACT": "plant-fa"})
    assert differing_widths(planted) == [9]


@pytest.mark.long
def test_the_tiny_deepseek_v4_model_runs_on_stock_vulkan(lavapipe, tiny_models):
    """Stock llama.cpp's Vulkan build on the tiny DeepSeek-V4 model, with llama.cpp's defaults
    (flash attention on, split-K): q1 and bands of 4, 9 and 64 over 96 tokens all finish, each a
    band of its width. Before common patch 0008 this died with SIGSEGV inside lavapipe every time
    tried (64 over 96): ggml-vulkan writes only a pipeline's own bindings of a reused descriptor set,
    and lavapipe binds the rest too, one of them flash attention's destroyed split-K scratch
    (vulkan_kernels/README.md). The exact flavor's bands equal q1 (the tests above); stock's need not."""
    runs = prefill_widths(tiny_models["mxfp4"], "1,4,9,64", 96, lib="stock")
    print("stock widths differing from its q1:", differing_widths(runs))
    assert all(len(d["logits_sha256"]) == 64 for d in runs.values()), runs


def test_the_planted_fusion_differs_at_model_level(lavapipe, tiny_models):
    """DFLASH_VK_EXACT=plant-fusion: q1 takes the add+norm fusion again, bands of 4 do not."""
    runs = prefill_widths(tiny_models["f16"], "1,4", 20, env={"DFLASH_VK_EXACT": "plant-fusion"})
    assert differing_widths(runs) == [4]


def test_diff_sees_a_difference_inside_fused_work(lavapipe, tiny_models):
    """The tap runs nodes one at a time, so the planted fusion never happens while tapping: every
    tapped node agrees, and only the untapped runs show the difference; dflash diff must say
    "differs" (and where), not "identical". The exact flavor is identical both ways."""
    args = ("diff", "--device", "vulkan:0", "--model", tiny_models["f16"], "--a", "q1", "--b", "w4",
            "--n-tokens", 12, "--threads", 2)
    planted = run_json(*args, env={**ENV, "DFLASH_VK_EXACT": "plant-fusion"})
    assert planted["logits_identical"] and planted["nodes_identical"], planted  # the tap cannot see it
    assert planted["untapped_identical"] is False and planted["identical"] is False
    assert planted["tap_faithful"] is False and "a" in planted["tap_changed_logits"]  # q1 fused untapped only
    assert isinstance(planted["untapped_first_diff_position"], int)
    exact = run_json(*args, env=ENV)
    assert exact["identical"] and exact["untapped_identical"], exact
    # (tap_faithful is False here too: the fusions the exact flavor keeps compute otherwise than
    # their nodes one at a time, at every width alike; with GGML_VK_DISABLE_FUSION=1 it is True.
    # The nodes then describe the unfused graph, and diff says so.)


def test_llama_cpps_own_routing_differs_at_model_level(lavapipe, tiny_models):
    """The stock twin at model level: the same build with DFLASH_VK_EXACT=0 changes the logits
    between q1 and bands of 9 (mul_mm against q1's mat-vec)."""
    runs = prefill_widths(tiny_models["mxfp4"], "1,9", 40, env={"DFLASH_VK_EXACT": "0"})
    assert differing_widths(runs) == [9]


@pytest.mark.long
def test_a_cpu_and_vulkan_split_is_bit_identical_to_q1(lavapipe, tiny_models, gemma):
    """--device cpu,vulkan:0, the mixed case of a model too big for one GPU: the CPU keeps the
    first half of the layers (the exact CPU kernels), lavapipe the rest (what lavapipe cannot run,
    DeepSeek-V4's hyper-connection ops, falls back to the CPU), and the exact flavor turns
    llama.cpp's op offload off (Engine.op_offload: with it on, bands of 9 already differed).
    Gemma 3 270M: bands of 4, 9 and 64 over 72 tokens equal q1. Tiny DeepSeek-V4: 4, 9 and 16
    (from 32 on it differs: docs/guides/vulkan.md). Twin: llama.cpp's own Vulkan routing on the same
    split differs at 9."""
    assert not differing_widths(prefill_widths(gemma, "1,4,9,64", 72, device="cpu,vulkan:0"))
    assert not differing_widths(prefill_widths(tiny_models["mxfp4"], "1,4,9,16", 40, device="cpu,vulkan:0"))
    twin = prefill_widths(tiny_models["mxfp4"], "1,9", 40, env={"DFLASH_VK_EXACT": "0"}, device="cpu,vulkan:0")
    assert differing_widths(twin) == [9]


RPC_PROMPT = "The band scheduler picks exact widths for every step of a prefill."


@pytest.mark.long
def test_a_vulkan_device_behind_rpc_server_is_bit_identical_to_q1(lavapipe, gemma, tmp_path):
    """`dflash rpc-server --device vulkan:0` on loopback, every layer of Gemma 3 270M on it (rpc:0)
    and a CPU + remote Vulkan split (cpu,rpc:0): bands of 4 give the logits and response of q1 on
    the same placement.
    The client loads the exact Vulkan build too (the build its server runs; a CPU-only client
    would be refused as another build). Twin: a server whose library plants mat-vec for 2..8
    columns (DFLASH_VK_EXACT=plant) gives other logits at bands of 4. (The tiny DeepSeek-V4
    model cannot run behind an RPC server on lavapipe: ggml's RPC client offers every op to the
    server, and lavapipe has no pipeline for its hyper-connection ops; locally those fall back
    to the CPU.) One server answers all four clients in turn: before common patch 0008 a lavapipe
    server that had served two clients aborted inside lavapipe on the third (heap corruption; gone
    with the stale-descriptor fix, vulkan_kernels/README.md), so this doubles as that patch's check."""
    from .test_rpc import Server

    def prefill(endpoint: str, device: str, *bands: str) -> dict:
        r = run_json("prefill", "--model", gemma, "--prompt", RPC_PROMPT, "--threads", 1, "--n-predict", 4,
                     "--rpc", endpoint, "--device", device, *bands)
        assert [d["id"] for d in r["devices"]] == device.split(","), r["devices"]
        return r

    q1: dict[str, dict] = {}
    server = Server(tmp_path, "--device", "vulkan:0")
    try:
        assert server.info["device"] == "vulkan:0"
        for device in ("rpc:0", "cpu,rpc:0"):  # four clients in turn on one server
            q1[device] = prefill(server.endpoint, device, "--no-bands")
            r = prefill(server.endpoint, device, "--bands", "--chunk", "4")
            assert max(r["widths"]) == 4 and r["library"]["dir"] == server.info["library"]["dir"], r["library"]
            assert (r["logits_sha256"], r["response_sha256"]) == (q1[device]["logits_sha256"],
                                                                  q1[device]["response_sha256"]), device
    finally:
        server.kill()
    planted = Server(tmp_path, "--device", "vulkan:0", env={"DFLASH_VK_EXACT": "plant"})
    try:
        r = prefill(planted.endpoint, "rpc:0", "--bands", "--chunk", "4")
    finally:
        planted.kill()
    assert r["logits_sha256"] != q1["rpc:0"]["logits_sha256"]


def test_vulkan_devices_are_listed_and_a_missing_one_exits_3(lavapipe):
    r = run_dflash("prefill", "--device", "vulkan:7", "--threads", "1")
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "vulkan:7 does not exist (1 Vulkan device(s) present)" in lines[0], lines



SERVE_ARGS = ("--threads", "2", "--max-tokens", "4", "--prefix-words", "16", "--ctx", "512", "--json", "--",
              "--chat-template", "chatml")
SERVE_PROMPT = ("Exact serving on a GPU: every response equals the same request run alone and cold, one "
                "token per step, on the same device and driver, bit for bit, from prompt to last token.")


@pytest.mark.long
def test_serving_on_vulkan_is_identical_to_solo_cold_runs_and_q1(lavapipe):
    """`dflash qualify --serve --device vulkan:0` on the tiny DeepSeek-V4 model: llama-server on the
    exact Vulkan build, every layer on lavapipe, one and four slots with prompts in ubatches of 16
    (the s tile), every response identical to its solo cold run and to dflash prefill (q1) on the
    same device. (Before dflash turned context checkpoints off here, this check caught the repeat
    of a 73-token prompt, restored from a checkpoint at 69, differing from its cold run.) The twin
    is the next test's planted server."""
    r = run_dflash("qualify", "--serve", "--device", "vulkan:0", "--parallel", "4", "--ubatch", "16", *SERVE_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["exact"] is True and "-vulkan0-" in out["system_fingerprint"], out["system_fingerprint"]
    for c in out["configs"]:
        assert c["config"]["flash_attn"] == "on" and c["config"]["ubatch"] == 16
        assert c["responses"] == c["identical_to_solo"] == c["identical_to_prefill"] > 0, c
        # DeepSeek-V4 on Vulkan runs without context checkpoints (dflash/serve.py): its cache cannot
        # be cut, so no request reuses a prefix
        assert c["cache_hits"] == 0, c
    target = json.load(open(os.path.join(out["evidence_dir"], "target.json")))
    assert target["device"] == "vulkan:0" and "llvmpipe" in target["device_label"], target


def test_dflash_serve_on_vulkan_answers_what_q1_computes_and_a_planted_server_does_not(lavapipe):
    """`dflash serve --device vulkan:0 --ubatch 16`: the fingerprint names the device, flash
    attention on (patch 0012), ggml's Vulkan backend mapped, and a 40-token prompt's last-position logits and
    response equal `dflash prefill --device vulkan:0` (q1). Twin: the same server on a library that
    plants mat-vec for 2..8 columns (DFLASH_VK_EXACT=plant; the 35-token prompt's last ubatch has 3
    tokens, so its last position's logits come from the planted shader) must answer otherwise. A
    device dflash cannot serve yet is one line, exit 2."""
    from .test_serve import Serve

    p = json.loads(run_dflash("prefill", "--device", "vulkan:0", "--prompt", SERVE_PROMPT, "--logits", "last",
                              "--n-predict", "4", "--no-bands", "--threads", "2", "--json", check=True).stdout)

    def ask(*args, env=None):
        s = Serve("--device", "vulkan:0", "--ubatch", "16", *args, env=env)
        try:
            assert "-vulkan0-" in s.info["system_fingerprint"] and s.info["config"]["flash_attn"] == "on"
            maps = open(f"/proc/{s.llama_server_pid()}/maps").read()
            assert "libggml-vulkan.so" in maps, "llama-server did not load ggml's Vulkan backend"
            r = s.post("/v1/completions", {"prompt": SERVE_PROMPT, "max_tokens": 4, "temperature": 0})
            assert r.status == 200 and r.body["system_fingerprint"] == s.info["system_fingerprint"], r.text[:300]
            return r.body["dflash"]
        finally:
            assert s.stop() == 0, "".join(s.err[-20:])

    fp = ask("--allow-inexact")  # no record needed for one request's comparison
    assert fp["prompt_sha256"] == p["prompt_sha256"]
    assert (fp["logits_sha256"], fp["response_tokens"]) == (p["logits_sha256"], p["response_tokens"])
    planted = ask("--allow-inexact", env={"DFLASH_VK_EXACT": "plant"})
    assert planted["prompt_sha256"] == p["prompt_sha256"] and planted["logits_sha256"] != p["logits_sha256"]
    bad = run_dflash("serve", "--device", "cpu,vulkan:0", "--port", server.free_port())
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
