"""CPU build variants (`dflash build --cpu`): each holds only its instruction sets, loads its own CPU
backend, and prefills q1 and bands bit for bit alike on the tiny model (every weight preset) and a
real GGUF; the stock library of the same variant is the twin that differs.

Every variant is built by `scripts/setup --all` (the CPU backend alone: about 1 minute each with
ccache). The model-level checks run one build per ISA class (avx512, avx512-noamx, avx2); the
native build's model-level checks are the rest of the suite's, and the kernel harness runs every
variant (tests/test_cpu_kernels.py). A variant
that is not built fails here, it is not skipped.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.core import cpu_isa
from dflash.core.errors import UsageError
from dflash.core.settings import resolve
from dflash.model import tiny_model
from dflash.native import build

from .conftest import ROOT, cpu_variant_params, run_dflash

VARIANTS = build.CPU_VARIANTS
WIDTHS = "1,4,64,512"


def need(flavor: str, cpu: str) -> None:
    if not build.is_built(flavor, cpu=cpu):
        pytest.fail(f"the {flavor} library's {cpu} variant is not built: run `dflash build --cpu {cpu}` "
                    f"(scripts/setup --all --long builds every variant)")


def runnable(cpu: str) -> None:
    """A variant this CPU lacks the instructions of cannot run here (the AVX-512 ones on an AVX2-only
    host): a named skip; its refusal is test_a_variant_loads_its_own_cpu_backend's check."""
    missing = cpu_isa.missing_flags(cpu)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {cpu} variant cannot run on it (built and "
                    f"disassembled here; its refusal is checked)")


# ---- the disassembly check ---------------------------------------------------------------------

def objdump_line(raw: str, insn: str) -> str:
    return f"  1000:\t{raw}\t{insn}"


def test_classify_tells_encodings_apart():
    lines = [objdump_line("62 f1 7c 48 28 c1", "vmovaps %zmm1,%zmm0"),
             objdump_line("c5 fc 28 c1", "vmovaps %ymm1,%ymm0"),
             objdump_line("62 f2 75 28 50 c2", "vpdpbusd %ymm2,%ymm1,%ymm0"),        # EVEX: AVX512-VNNI
             objdump_line("c4 e2 75 50 c2", "{vex} vpdpbusd %ymm2,%ymm1,%ymm0"),     # VEX: AVX-VNNI
             objdump_line("c4 e2 78 49 00", "ldtilecfg (%rax)"),
             objdump_line("48 89 c7", "mov %rax,%rdi"),
             "0000000000001000 <f>:", "  1005:\t00 00"]  # a label and a byte-only continuation
    r = cpu_isa.classify(lines)
    assert r.instructions == 6
    assert set(r.classes) == {"avx512", "avx2", "avx512_vnni", "avx_vnni", "amx"}
    assert "{vex}" in r.classes["avx_vnni"]


def test_variant_expectations_can_fail():
    """The check reports a library whose code contradicts its variant (here: AVX-512 code in avx2,
    AMX in avx512-noamx, none in avx512)."""
    r = cpu_isa.IsaReport("lib", 3, {"avx2": "a", "avx512": "b", "amx": "c"})
    assert any("avx512 instructions" in p for p in r.problems("avx2"))
    assert any("amx instructions" in p for p in r.problems("avx512-noamx"))
    assert any("no avx512_vnni" in p for p in r.problems("avx512"))
    assert r.problems("native") == []


@pytest.mark.parametrize("cpu", cpu_variant_params([v for v in VARIANTS if v != "native"]))
@pytest.mark.parametrize("flavor", build.FLAVORS)
def test_variant_holds_only_its_instruction_sets(flavor, cpu):
    need(flavor, cpu)
    lib = build.library_dir(flavor, cpu=cpu) / "libggml-cpu.so"
    report = cpu_isa.disassemble(lib)
    assert report.instructions > 100_000, report.instructions
    assert report.problems(cpu) == [], (cpu, sorted(report.classes))
    # the other libraries are the native build's, and carry no ISA-specific code at all
    for other in ("libllama.so", "libggml-base.so"):
        assert cpu_isa.disassemble(lib.parent / other).classes.keys() <= {"avx2"}, other


def test_build_check_isa_command():
    r = run_dflash("build", "--lib", "exact", "--cpu", "avx2", "--check-isa", "--json", check=True)
    out = json.loads(r.stdout)
    assert out["isa"]["exact"]["variant"] == "avx2" and out["isa"]["exact"]["problems"] == []
    assert out["isa"]["exact"]["classes"] == ["avx2"]


# ---- running a variant -------------------------------------------------------------------------

def test_host_flags_gate_a_variant():
    assert cpu_isa.missing_flags("avx2", {"avx", "avx2"}) == ["sse4_2", "fma", "f16c", "bmi2"]
    assert cpu_isa.missing_flags("avx512", set(cpu_isa.REQUIRED_FLAGS["avx512"])) == []
    assert "avx512f" in cpu_isa.missing_flags("avx512-noamx", set(cpu_isa.REQUIRED_FLAGS["avx2"]))
    assert cpu_isa.missing_flags("native", {"sse2"}) == []


def test_cpu_flag_and_option():
    assert resolve({}).cpu == "native"
    assert resolve({"DFLASH_CPU_VARIANT": "avx2"}).cpu == "avx2"
    with pytest.raises(UsageError, match="unknown"):
        resolve({"DFLASH_CPU_VARIANT": "sse3"})
    with pytest.raises(UsageError, match="DFLASH_LLAMA_LIB_DIR"):
        resolve({"DFLASH_CPU_VARIANT": "avx2", "DFLASH_LLAMA_LIB_DIR": "/tmp"})
    r = run_dflash("prefill", "--cpu", "sse3")
    assert r.returncode == 2 and "--cpu" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("cpu", cpu_variant_params(VARIANTS))
def test_a_variant_loads_its_own_cpu_backend(cpu):
    """The process maps the variant's libggml-cpu, not the native one (/proc/self/maps); on a CPU
    that lacks the variant's instructions, loading it is refused in one line naming them."""
    need("exact", cpu)
    missing = cpu_isa.missing_flags(cpu)
    if missing:
        r = run_dflash("prefill", "--cpu", cpu, "--weights", "f32", "--json")
        assert r.returncode == 2 and f"--cpu {cpu} needs {', '.join(missing)}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        return
    code = ("import json, sys\n"
            "from dflash.run import engine\nfrom dflash.core import settings\n"
            f"d = engine.load_library(settings.resolve({{'DFLASH_CPU_VARIANT': {cpu!r}}}))\n"
            "maps = open('/proc/self/maps').read().split()\n"
            "print(json.dumps({'dir': str(d), 'cpu': sorted({m for m in maps if 'libggml-cpu' in m})}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dir"] == str(build.library_dir("exact", cpu=cpu))
    real = str(Path(out["dir"]).resolve())  # the tests' cache links to the user's built libraries
    assert out["cpu"] and all(m.startswith(real + "/") for m in out["cpu"]), out


def prefill_all(cpu: str, lib: str, models: list) -> dict:
    """{(model, width): fingerprints} from one child process holding the library (flavor, variant)."""
    need(lib, cpu)
    runnable(cpu)
    cmd = [sys.executable, "-m", "tests.variant_prefill", "--cpu", cpu, "--lib", lib, "--widths", WIDTHS,
           "--threads", "2", *map(str, models)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == len(models) * len(WIDTHS.split(","))
    for x in rows:
        assert x["library"]["cpu"] == cpu and x["library"]["flavor"] == lib and x["n_tokens"] == 512 + 8
        assert x["widths_run"][-1] == x["width"]  # bands of that width were really decoded
    return {(x["model"], x["width"]): (x["logits_sha256"], x["response_sha256"]) for x in rows}


def differing(fp: dict, model) -> list[int]:
    """The widths whose fingerprints differ from width 1's."""
    return [w for (m, w), v in fp.items() if m == str(model) and v != fp[(str(model), 1)]]


ISA_CLASSES = [v for v in VARIANTS if v != "native"]


@pytest.mark.parametrize("cpu", cpu_variant_params(ISA_CLASSES))
def test_q1_and_bands_agree_on_every_preset(tiny_models, cpu):
    """The tiny DeepSeek-V4 model, every weight preset, fixed-width bands of 4, 64 and 512 against
    q1 on the exact library of this variant (every position's logits and the response); the same
    variant's stock library is the twin that must be caught differing."""
    models = [tiny_models[w] for w in tiny_model.WEIGHTS]
    exact = prefill_all(cpu, "exact", models)
    for w, m in zip(tiny_model.WEIGHTS, models, strict=True):
        assert differing(exact, m) == [], (cpu, w)
    stock = prefill_all(cpu, "stock", models)
    caught = [w for w, m in zip(tiny_model.WEIGHTS, models, strict=True) if differing(stock, m)]
    assert len(caught) >= len(tiny_model.WEIGHTS) - 1, (cpu, caught)


# Gemma on each class: CI's job runs the native build (the tiny presets run on avx2 above)
@pytest.mark.parametrize("cpu", cpu_variant_params(ISA_CLASSES, ci=("native",)))
def test_q1_and_bands_agree_on_a_real_gguf(gemma, cpu):
    exact = prefill_all(cpu, "exact", [gemma])
    assert differing(exact, gemma) == [], cpu


def test_threads_one_two_three():
    """q1 and bands on 1, 2 and 3 threads (native): bands equal q1 at each thread count, and q1
    itself gives the same bits on every thread count (threads split output rows, never K)."""
    hashes = {}
    for t in (1, 2, 3):
        r = run_dflash("prefill", "--compare-q1", "--bands", "--chunk", "4", "--threads", t, "--json",
                       "--weights", "q4_k_m", check=True)
        out = json.loads(r.stdout)
        assert out["identical_to_q1"] is True, t
        hashes[t] = (out["q1"]["logits_sha256"], out["logits_sha256"])
    assert len(set(hashes.values())) == 1, hashes


def test_a_record_of_one_variant_vouches_for_that_variant_only():
    """End to end: `dflash qualify --cpu avx2` proves width 8 for the avx2 build; prefill --chunk 8
    runs on avx2 and is refused on the native build (and on avx512-noamx), which no record names."""
    q = run_dflash("qualify", "--cpu", "avx2", "--weights", "f32", "--widths", "8", "--threads", "2", "--json",
                   check=True)
    assert json.loads(q.stdout)["library"]["cpu"] == "avx2"
    ok = run_dflash("prefill", "--cpu", "avx2", "--weights", "f32", "--chunk", "8", "--threads", "2", "--json",
                    check=True)
    out = json.loads(ok.stdout)
    assert out["library"]["cpu"] == "avx2" and out["chunk"] == 8 and out["qualification"]["width"] == 8
    for other in ("native", "avx512-noamx"):
        r = run_dflash("prefill", "--cpu", other, "--weights", "f32", "--chunk", "8", "--threads", "2")
        # refused: no record names it, or (an AVX2-only host) it cannot run here at all
        why = "needs avx512" if cpu_isa.missing_flags(other) else "no qualification record"
        assert r.returncode == 2 and why in r.stderr, (other, r.stderr)
