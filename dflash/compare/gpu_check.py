"""The GPU check (`scripts/gpu-check`): one command on a machine with an NVIDIA GPU, or its CPU
stand-in here.

On the GPU (default) it loads the exact and the stock CUDA libraries (a bundle of prebuilt ones,
`--bundle DIR`, made here by `--make-bundle DIR`; or builds them with `dflash build --gpu cuda`) and
checks, each check one summary line (`gpu-check: PASS|FAIL|INFO|SKIP <name>: <detail>`). The twin,
which must differ where the exact library must not, is the stock library; a bundle that carries
the exact library only (when both do not fit the lent machine's 64 MiB) has the exact library with
DFLASH_NARROW_MMVQ=0 instead (every dflash hook off: ggml's stock routing on the GPU).

  libraries       both libraries' dynamic dependencies resolve (ldd: no "not found"; on the CPU
                  stand-in the driver's libcuda.so.1 is not looked for), their sizes
  selftest        the narrow-MMVQ kernels on the GPU == their host emulation, ncols invariance
                  (hip_kernels/tests/cuda_selftest.cu; GPU only)
  harness         op level (cpu_kernels/tests/invariance.cpp --backend CUDA0): MUL_MAT (contiguous,
                  strided, broadcast activations) and MUL_MAT_ID for every type the narrow path
                  covers and F32/F16/BF16, every column of ncols 1..8 bit-identical to ncols 1
  harness-wide    the same at wider widths; INFO on the GPU (they leave the narrow path, which
                  promises nothing there), PASS/FAIL on the CPU (its exact kernels promise every width)
  harness-planted the planted-bug twin (--plant): every width >= 2 must be caught
  harness-twin    the twin on the same cases: some case must differ, or the check could not fail
  model           q1 vs bands on the tiny model (dflash qualify --model <preset> --widths 1,2,4,8 and the
                  widest the narrow ceiling allows): every preset, every width exact
  model-twin      the twin on the same runs: some preset must differ
  qualify         `dflash qualify --device cuda:0` (the default tiny model and widths)
  evidence        one evidence directory holding everything, accepted by `dflash verify`

`--cpu-stand-in` runs the same logic here with the CPU backend standing in: the CPU libraries,
the harness with --backend CPU, the model runs (as `prefill --compare-q1` at chunks 2 and 4) and
qualify on --device cpu; smaller shapes and subsets of the types, cases and presets (each line says
so), and no kernel self-test.

Exit 0 when every check passed (INFO and SKIP lines do not fail it), 1 when one failed, 3 without
an NVIDIA GPU (GPU mode), 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash.compare import cuda_bundle
from dflash.core import cpu_isa, settings
from dflash.core.paths import REPO_ROOT, SOURCE_ROOT
from dflash.model import tiny_model
from dflash.native import build, cuda_libs
from dflash.proof.evidence import EvidenceWriter, verify

HARNESS_SRC = SOURCE_ROOT / "cpu_kernels" / "tests" / "invariance.cpp"
SELFTEST_SRC = SOURCE_ROOT / "hip_kernels" / "tests" / "cuda_selftest.cu"
FLAVORS = ("exact", "stock")
NARROW_WIDTHS = tuple(range(1, settings.MMVQ_MAX + 1))  # the narrow path: ncols 1..8
# the tiny model: widths 1, 2, 4, 8 and the widest the narrow ceiling allows (LUCE_MMVQ_MAX_NCOLS <= 8)
MODEL_WIDTHS = tuple(sorted({1, 2, 4, 8, settings.MMVQ_MAX}))
PLANT_K, PLANT_M = 1024, 256  # the harness's default shape, at which its planted twin is caught for every type


@dataclass(frozen=True)
class Mode:
    stand_in: bool
    backend: str              # the harness's --backend
    device: str               # dflash --device
    k: int
    m: int
    types: tuple[str, ...]    # ggml type names
    cases: tuple[tuple[str, str], ...]  # (op, src1)
    wide: tuple[int, ...]
    presets: tuple[str, ...]  # tiny-model --weights
    threads: int
    # the CPU stand-in's model runs are `prefill --compare-q1` at these chunks (a traced qualify run
    # of every width costs minutes of CPU); () on the GPU: `qualify --widths MODEL_WIDTHS` per preset
    prefill_chunks: tuple[int, ...] = ()
    qualify_args: tuple[str, ...] = ()  # extra options of the `qualify` check

    @property
    def wide_required(self) -> bool:
        """The CPU's exact kernels promise every width; on the GPU wider widths leave the narrow path."""
        return self.stand_in


GPU = Mode(False, "CUDA0", "cuda:0", 1024, 256,
           ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_K", "q5_K", "q6_K", "mxfp4"),
           (("mul_mat", "contiguous"), ("mul_mat", "strided"), ("mul_mat", "broadcast"), ("mul_mat_id", "contiguous")),
           (9, 16, 17, 32, 64, 65, 128, 256, 512), tiny_model.WEIGHTS, 8)
_SENTENCE = ("The band scheduler keeps every compressor emission at the end of its band, so a token's result "
             "is the same bits at every width. It runs narrow bands first. ")
STAND_IN = Mode(True, "CPU", "cpu", 512, 32,
                ("f32", "f16", "q8_0", "q4_0", "q4_K", "mxfp4"),
                (("mul_mat", "contiguous"), ("mul_mat_id", "contiguous")),
                (16, 64), ("mxfp4",), 2, prefill_chunks=(2, 4),
                # the shortest run qualify accepts: 156 tokens cross the ratio 128 and the 64-token window
                # (resumed at 51: 51 % 4 == 3, so the resumed start cuts a 'start' band at cap 2)
                qualify_args=("--widths", "2", "--n-predict", "1", "--resume-at", "51", "--prompt", _SENTENCE * 5))


@dataclass
class Line:
    status: str  # PASS, FAIL, INFO, SKIP
    name: str
    detail: str

    def render(self) -> str:
        return f"gpu-check: {self.status} {self.name}: {self.detail}"


@dataclass
class Run:
    mode: Mode
    work: Path
    files: Path
    libs: dict[str, Path]
    lines: list[Line] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    plant_exact: bool = False  # (tests) the exact narrow harness run gets the planted bug: its line must FAIL

    @property
    def twin(self) -> str:
        """What stands beside the exact library to show that a check can fail: the stock library, or
        (a bundle that carries the exact one only) the exact library with every dflash hook off."""
        return "stock" if "stock" in self.libs else "hooks-off"

    def twin_desc(self) -> str:
        return ("the stock library" if self.twin == "stock" else
                "the exact library with DFLASH_NARROW_MMVQ=0 (every dflash hook off: ggml's stock routing)")

    def side(self, side: str) -> tuple[str, dict[str, str]]:
        """The flavor and environment of side "exact" or "twin"."""
        if side == "exact" or self.twin == "stock":
            flavor = "exact" if side == "exact" else "stock"
            return flavor, self.lib_env()
        return "exact", {**self.lib_env(), "DFLASH_NARROW_MMVQ": "0"}

    def say(self, status: str, name: str, detail: str) -> Line:
        line = Line(status, name, detail)
        self.lines.append(line)
        print(line.render(), flush=True)
        return line

    def note(self, text: str) -> None:
        print(f"[gpu-check] {text}", file=sys.stderr, flush=True)

    def write(self, name: str, data: str | bytes) -> Path:
        p = self.files / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            p.write_text(data)
        else:
            p.write_bytes(data)
        return p

    def lib_env(self) -> dict[str, str]:
        """The environment of the harness and of a dflash command (which finds each flavor's library at
        its keyed path in this run's cache, link_libraries), the narrow ceiling at its widest."""
        return {**self.env, "LUCE_MMVQ_MAX_NCOLS": str(settings.MMVQ_MAX), "DFLASH_NARROW_MMVQ": "1"}

    def link_libraries(self) -> dict[str, str]:
        """This run's cache (XDG_CACHE_HOME of every dflash command) gets each flavor's library at the
        path `dflash --lib F --device D` loads from (build.install_dir on this machine): a link to the
        library checked here. Returns those paths."""
        gpu = "none" if self.mode.stand_in else "cuda"
        saved = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = self.env["XDG_CACHE_HOME"]
        try:
            done = {}
            for flavor, lib in self.libs.items():
                dest = build.install_dir(flavor, gpu)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.symlink_to(lib.parent.resolve(), target_is_directory=True)
                done[flavor] = str(dest)
            return done
        finally:
            if saved is None:
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = saved


_DEADLINE: list[float] = []  # time.monotonic() by which every command must have ended (--deadline)


def _run(cmd: Sequence[str], env: Mapping[str, str], timeout: float = 1800, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    if _DEADLINE:
        timeout = max(1.0, min(timeout, _DEADLINE[0] - time.monotonic()))
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=dict(env), timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(list(cmd), 124, out, f"timed out after {timeout:.0f} s")


def _dflash(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash", *args]


def _tail(text: str, n: int = 1) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return " | ".join(lines[-n:]) if lines else "no output"


# ---- libraries --------------------------------------------------------------------------------

def check_libraries(run: Run, bundle_info: dict | None) -> None:
    report: dict[str, Any] = {"run_host_isa": cuda_bundle.host_isa(cpu_isa.host_flags())}
    problems = []
    if bundle_info is not None:
        missing = sorted(set(bundle_info.get("build_host_isa", [])) - cpu_isa.host_flags())
        report["isa_missing"] = missing
        if missing:
            problems.append(f"this CPU lacks {', '.join(missing)}, which the bundle's native CPU backend "
                            f"may use (build it here with 16 cores instead)")
    allowed = ("libcuda.so.1",) if run.mode.stand_in else ()
    sizes = {}
    for flavor, lib in run.libs.items():
        backend = lib / ("libggml-cpu.so" if run.mode.stand_in else "libggml-cuda.so")
        env = {**run.env, "LD_LIBRARY_PATH": ":".join([str(lib), run.env.get("LD_LIBRARY_PATH", "")]).rstrip(":")}
        out = _run(["ldd", str(backend)], env, timeout=60)
        bad = cuda_libs.unresolved(out.stdout, allowed) if out.returncode == 0 else [f"ldd failed: {_tail(out.stderr)}"]
        report[flavor] = {"dir": str(lib), "ldd": out.stdout, "unresolved": bad}
        sizes[flavor] = {p.name: p.stat().st_size for p in sorted(lib.iterdir()) if p.is_file() and not p.is_symlink()}
        problems += [f"{flavor} {backend.name}: {b} not found" for b in bad]
    report["sizes"] = sizes
    run.write("libraries.json", json.dumps(report, indent=2) + "\n")
    total = {f: sum(s.values()) for f, s in sizes.items()}
    what = ", ".join(f"{f} {total[f] / 2**20:.1f} MiB" for f in total)
    if problems:
        run.say("FAIL", "libraries", "; ".join(problems))
    else:
        run.say("PASS", "libraries", f"every dependency resolves ({what})")


# ---- kernel self-test -------------------------------------------------------------------------

def check_selftest(run: Run) -> None:
    if run.mode.stand_in:
        run.say("SKIP", "selftest",
                "stand-in: the CUDA kernels need a GPU (tests/test_hip_kernels.py runs their host half)")
        return
    nvcc = build._nvcc()
    if nvcc is None:
        run.say("FAIL", "selftest", "no nvcc")
        return
    exe = run.work / "cuda_selftest"
    m = re.match(r"\d+[af]?", build.cuda_architectures().split(";")[0])
    arch = m[0] if m else "90"  # 90-real -> sm_90
    b = _run([nvcc, "-std=c++17", "-O2", f"-arch=sm_{arch}", f"-I{SOURCE_ROOT / 'hip_kernels' / 'include'}",
              f"-I{SOURCE_ROOT / 'hip_kernels' / 'tests'}", "-Xcompiler", "-ffp-contract=off", str(SELFTEST_SRC),
              "-o", str(exe)], run.env, timeout=600)
    run.write("selftest-build.txt", b.stdout + b.stderr)
    if b.returncode != 0:
        run.say("FAIL", "selftest", f"nvcc failed: {_tail(b.stderr)}")
        return
    r = _run([str(exe)], run.env, timeout=300)
    run.write("selftest.txt", r.stdout + r.stderr)
    ok = r.returncode == 0 and "cuda selftest: PASS" in r.stdout
    run.say("PASS" if ok else "FAIL", "selftest", _tail(r.stdout))


# ---- op-level harness -------------------------------------------------------------------------

def build_harness(run: Run, flavor: str) -> Path | None:
    lib = run.libs[flavor]
    exe = run.work / f"invariance-{flavor}"
    cxx = shutil.which("g++") or shutil.which("c++") or "g++"
    r = _run([cxx, "-O2", "-std=c++17", str(HARNESS_SRC), f"-I{lib.parent / 'include'}", f"-L{lib}",
              "-lggml", "-lggml-base", "-lggml-cpu", "-Wl,--allow-shlib-undefined",
              f"-Wl,--disable-new-dtags,-rpath,{lib}", "-o", str(exe)], run.env, timeout=900)
    run.write(f"harness-build-{flavor}.txt", r.stdout + r.stderr)
    return exe if r.returncode == 0 else None


def _cases(mode: Mode, types: Sequence[str] | None = None, k: int | None = None, m: int | None = None
           ) -> list[list[str]]:
    return [["--type", t, "--op", op, "--src1", src1, "--k", str(k or mode.k), "--m", str(m or mode.m),
             "--backend", mode.backend, "--threads", str(mode.threads)]
            for t in (types or mode.types) for op, src1 in mode.cases]


def run_harness(run: Run, exe: Path, env: Mapping[str, str], label: str, cases: list[list[str]],
                widths: Sequence[int], plant: bool = False) -> tuple[int, list[dict]]:
    argv: list[str] = []
    for i, c in enumerate(cases):
        argv += ["--then"] if i else []
        argv += [*c, "--widths", ",".join(map(str, widths)), *(["--plant"] if plant else [])]
    r = _run([str(exe), *argv], {**env, "OMP_WAIT_POLICY": "passive"}, timeout=1200)
    run.write(f"harness-{label}.jsonl", r.stdout)
    run.write(f"harness-{label}.err", r.stderr)
    summaries = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and '"summary": true' in x]
    if r.returncode not in (0, 1) or len(summaries) != len(cases):
        return -1, summaries
    return r.returncode, summaries


def _case(s: dict) -> str:
    return f"{s['type']} {s['op']} {s['src1']}"


def _differs(s: dict) -> bool:
    """Some width of the case differs from ncols 1 (with --plant too: the harness's own "ok" then
    means the plant was caught)."""
    return int(s["widths_differing"]) > 0


def check_harness(run: Run) -> None:
    mode = run.mode
    exes = {f: build_harness(run, f) for f in run.libs}
    for f, exe in exes.items():
        if exe is None:
            run.say("FAIL", "harness" if f == "exact" else "harness-twin",
                    f"invariance.cpp does not build against the {f} library "
                    f"({_tail((run.files / f'harness-build-{f}.txt').read_text())})")
    exact_env = run.side("exact")[1]
    shape = f"k {mode.k}, m {mode.m}"
    subset = " (stand-in subset: smaller shapes, fewer types and cases)" if mode.stand_in else ""
    cases = _cases(mode)
    exact = exes["exact"]
    if exact is not None:
        rc, rows = run_harness(run, exact, exact_env, "exact", cases, NARROW_WIDTHS, plant=run.plant_exact)
        bad = [_case(s) for s in rows if _differs(s)]
        n = len(cases)
        if rc < 0:
            run.say("FAIL", "harness", f"the harness crashed ({_tail((run.files / 'harness-exact.err').read_text())})")
        else:
            run.say("PASS" if not bad else "FAIL", "harness",
                    f"{n - len(bad)}/{n} cases bit-identical at ncols {NARROW_WIDTHS[0]}..{NARROW_WIDTHS[-1]} vs "
                    f"ncols 1 on {mode.backend} ({len(mode.types)} types x {len(mode.cases)} op/activation layouts, "
                    f"{shape}){subset}" + (f"; differing: {', '.join(bad)}" if bad else ""))
        rc, rows = run_harness(run, exact, exact_env, "exact-wide", cases, mode.wide)
        bad = [_case(s) for s in rows if _differs(s)]
        widths = ",".join(map(str, mode.wide))
        if rc < 0:
            run.say("FAIL", "harness-wide", "the harness crashed")
        elif mode.wide_required:
            run.say("PASS" if not bad else "FAIL", "harness-wide",
                    f"{n - len(bad)}/{n} cases bit-identical at widths {widths} vs ncols 1"
                    + (f"; differing: {', '.join(bad)}" if bad else ""))
        else:
            run.say("INFO", "harness-wide",
                    f"{n - len(bad)}/{n} cases bit-identical at widths {widths} vs ncols 1 (beyond the narrow "
                    f"path's 8 columns: no promise)" + (f"; differing: {', '.join(bad)}" if bad else ""))
        planted_types = [t for t in mode.types if t not in ("f16", "bf16")] or list(mode.types)
        # the harness's default shape: on a small one a rotated sum can round to the same floats (MXFP4 on
        # the CPU at K 1024, M 32)
        pcases = _cases(mode, planted_types, k=max(mode.k, PLANT_K), m=max(mode.m, PLANT_M))
        rc, rows = run_harness(run, exact, exact_env, "exact-planted", pcases, NARROW_WIDTHS[1:], plant=True)
        missed = [_case(s) for s in rows if not (s["ok"] and s["planted"])]
        if rc < 0:
            run.say("FAIL", "harness-planted", "the harness crashed")
        else:
            run.say("PASS" if not missed else "FAIL", "harness-planted",
                    f"the planted bug caught at every width 2..{NARROW_WIDTHS[-1]} in {len(pcases) - len(missed)}/"
                    f"{len(pcases)} cases" + (f"; missed: {', '.join(missed)}" if missed else ""))
    twin_flavor, twin_env = run.side("twin")
    twin = exes[twin_flavor]
    if twin is not None:
        rc, rows = run_harness(run, twin, twin_env, "twin", cases, NARROW_WIDTHS)
        differ = [_case(s) for s in rows if _differs(s)]
        if rc < 0:
            run.say("FAIL", "harness-twin", f"the harness crashed on {run.twin_desc()}")
        else:
            run.say("PASS" if differ else "FAIL", "harness-twin",
                    f"the twin, {run.twin_desc()}, differs in {len(differ)}/{len(cases)} cases"
                    + (f" (e.g. {', '.join(differ[:4])})" if differ else ": no case differs, so the check could not "
                       "tell an invariant library from a stock one"))


# ---- model level ------------------------------------------------------------------------------

def _json(r: subprocess.CompletedProcess[str]) -> dict | None:
    try:
        obj = json.loads(r.stdout)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _qualify(run: Run, side: str, label: str, extra: Sequence[str]) -> dict | None:
    flavor, env = run.side(side)
    ev = run.work / f"qualify-{label}"
    cmd = _dflash("qualify", "--device", run.mode.device, "--lib", flavor, "--threads", str(run.mode.threads),
                  "--json", "--evidence", str(ev), *extra)
    r = _run(cmd, env, timeout=1200)
    run.write(f"{label}.json", r.stdout)
    run.write(f"{label}.err", r.stderr)
    obj = _json(r)
    if r.returncode != 0 or obj is None:
        run.note(f"{' '.join(cmd[2:])}: rc {r.returncode}: {_tail(r.stderr)}")
        return None
    for p in sorted(ev.rglob("*")) if ev.is_dir() else []:
        if p.is_file():
            run.write(f"{label}/{str(p.relative_to(ev)).replace('/', '__')}", p.read_bytes())
    return obj


def _prefill_q1(run: Run, side: str, weights: str, path: str, chunks: Sequence[int]) -> list[int] | None:
    """`prefill --compare-q1` at each chunk: the chunks whose bands differ from q1 (exit 4), None
    when one did not run."""
    flavor, env = run.side(side)
    differ = []
    for chunk in chunks:
        label = f"model-{side}-{weights}-chunk{chunk}"
        cmd = _dflash("prefill", "--model", path, "--device", run.mode.device, "--lib", flavor, "--chunk", str(chunk),
                      "--bands", "--compare-q1", "--n-predict", "4", "--threads", str(run.mode.threads),
                      "--prompt", _SENTENCE * 2, "--json")
        r = _run(cmd, {**env, "DFLASH_DS4_EXACT_PREFILL_BANDS": "1"}, timeout=900)
        run.write(f"{label}.json", r.stdout)
        run.write(f"{label}.err", r.stderr)
        if r.returncode not in (0, 4) or _json(r) is None:
            run.note(f"{' '.join(cmd[3:9])}: rc {r.returncode}: {_tail(r.stderr)}")
            return None
        if r.returncode == 4:
            differ.append(chunk)
    return differ


def _inexact(q: dict) -> list[int]:
    return [int(r["width"]) for r in q.get("results", []) if not r.get("exact")]


def check_model(run: Run) -> None:
    mode = run.mode
    widths = ",".join(map(str, MODEL_WIDTHS))
    paths: dict[str, str] = {}
    for w in mode.presets:
        # the K-quant presets are made by the exact library's quantizer (CPU code, whichever backend it has)
        r = _run(_dflash("tiny-model", "--weights", w, "--json"),
                 {**run.lib_env(), "DFLASH_LLAMA_LIB_DIR": str(run.libs["exact"])}, timeout=600)
        obj = _json(r)
        if r.returncode != 0 or obj is None:
            run.say("FAIL", "model", f"tiny-model --weights {w}: {_tail(r.stderr)}")
            return
        paths[w] = str(obj["path"])
    subset = f" (stand-in subset of {len(tiny_model.WEIGHTS)})" if mode.stand_in else ""
    verdicts: dict[str, dict[str, Any]] = {side: {} for side in ("exact", "twin")}
    for side in verdicts:
        for w, path in paths.items():
            if mode.prefill_chunks:  # the twin at the widest chunk only
                chunks = mode.prefill_chunks if side == "exact" else mode.prefill_chunks[-1:]
                verdicts[side][w] = _prefill_q1(run, side, w, path, chunks)
                continue
            q = _qualify(run, side, f"model-{side}-{w}", ["--model", path, "--widths", widths, "--n-predict", "4"])
            verdicts[side][w] = None if q is None else _inexact(q)
    if mode.prefill_chunks:
        widths = ",".join(map(str, mode.prefill_chunks)) + " (stand-in: prefill --compare-q1; chunks above 4 need " \
                                                          "a qualification record, minutes of CPU each)"
    ex = verdicts["exact"]
    failed = [w for w, v in ex.items() if v is None]
    inexact = {w: v for w, v in ex.items() if v}
    detail = (f"q1 vs bands at widths {widths} on {mode.device}: {len(ex) - len(failed) - len(inexact)}/{len(ex)} "
              f"presets exact at every width ({', '.join(mode.presets)}){subset}")
    if failed:
        detail += f"; did not run: {', '.join(failed)}"
    if inexact:
        detail += "; differing: " + ", ".join(f"{w} at {v}" for w, v in inexact.items())
    run.say("PASS" if not failed and not inexact else "FAIL", "model", detail)
    st = verdicts["twin"]
    differ = {w: v for w, v in st.items() if v}
    ran = [w for w, v in st.items() if v is not None]
    run.say("PASS" if differ else "FAIL", "model-twin",
            f"the twin, {run.twin_desc()}, differs from q1 in {len(differ)}/{len(ran)} presets"
            + (" (" + ", ".join(f"{w} at {v}" for w, v in differ.items()) + ")" if differ else
               ": none differs, so the model check could not tell the libraries apart"))


def check_qualify(run: Run) -> None:
    q = _qualify(run, "exact", "qualify", list(run.mode.qualify_args))
    if q is None:
        run.say("FAIL", "qualify", f"dflash qualify --device {run.mode.device} did not run "
                                   f"({_tail((run.files / 'qualify.err').read_text())})")
        return
    bad = _inexact(q)
    run.say("PASS" if not bad and q.get("all_exact") else "FAIL", "qualify",
            f"dflash qualify --device {run.mode.device}: widths {','.join(str(r['width']) for r in q['results'])} "
            f"{'all exact' if not bad else f'differing at {bad}'}; recommended chunk {q.get('recommended_chunk')}, "
            f"uncovered weight types {q.get('uncovered_weight_types') or 'none'}")


# ---- main -------------------------------------------------------------------------------------

CHECKS = ("libraries", "selftest", "harness", "model", "qualify")


def _machine(mode: Mode) -> str:
    parts = [f"mode {'cpu-stand-in' if mode.stand_in else 'gpu'}", f"host {platform.node()} {platform.machine()}",
             f"python {sys.version.split()[0]}", f"isa {' '.join(cuda_bundle.host_isa(cpu_isa.host_flags()))}"]
    for cmd in (["nvidia-smi", "-L"], ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                                       "--format=csv"], ["nvcc", "--version"]):
        if shutil.which(cmd[0]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            parts.append(f"$ {' '.join(cmd)}\n{r.stdout.strip()}")
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("evidence", nargs="?", help="evidence directory [default: evidence/runs/gpu-check-<UTC time>]")
    ap.add_argument("--cpu-stand-in", action="store_true", help="run here with the CPU backend standing in")
    ap.add_argument("--bundle", type=Path, help="prebuilt CUDA libraries (made by --make-bundle)")
    ap.add_argument("--make-bundle", type=Path, metavar="DIR", help="build both CUDA flavors and pack them into DIR")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--deadline", type=float, metavar="SECONDS",
                    help="stop starting checks (a FAIL line each: not run) and cut commands short this many seconds "
                         "after the start, leaving time for the evidence (the lent machine's 10-minute command limit)")
    ap.add_argument("--plant-exact", action="store_true",
                    help="(tests) run the exact library's harness with the planted bug: the check must FAIL")
    a = ap.parse_args(argv)
    if a.make_bundle:
        info = cuda_bundle.make_bundle(
            a.make_bundle, log=lambda s: print(f"[gpu-check] {s}", file=sys.stderr, flush=True))
        print(json.dumps(info, indent=2))
        return 0
    checks = [c for c in a.checks.split(",") if c]
    if any(c not in CHECKS for c in checks):
        ap.error(f"--checks takes {','.join(CHECKS)}")
    mode = STAND_IN if a.cpu_stand_in else GPU
    if not mode.stand_in and (shutil.which("nvidia-smi") is None or
                              subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0):
        print("gpu-check: no NVIDIA GPU (nvidia-smi finds none); --cpu-stand-in runs the CPU stand-in", file=sys.stderr)
        return 3
    t0 = time.monotonic()
    out = Path(a.evidence or REPO_ROOT / "evidence" / "runs" /
               f"gpu-check-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        files = work / "files"
        files.mkdir()
        base = {k: v for k, v in os.environ.items() if k not in ("DFLASH_LLAMA_LIB_DIR", "LLAMA_CPP_LIB_PATH")}
        base["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *[p for p in base.get("PYTHONPATH", "").split(os.pathsep)
                                                                if p]])
        # the checks' commands: records and tiny models of this run only (the libraries are linked in)
        env = {**base, "XDG_CACHE_HOME": str(work / "cache")}
        bundle_info = None
        if mode.stand_in:
                libs = {f: build.build_library(f, log=lambda s: print(f"[gpu-check] {s}", file=sys.stderr))
                    for f in FLAVORS}
        elif a.bundle:
            libs, bundle_info = cuda_bundle.unpack_bundle(a.bundle, work)
            dirs = cuda_bundle.cuda_runtime_dirs()
            env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, dirs), env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        else:
            libs = {}
            for f in FLAVORS:
                r = _run(_dflash("build", "--lib", f, "--gpu", "cuda", "--json"), base, timeout=3 * 3600)
                obj = _json(r)
                if r.returncode != 0 or obj is None:
                    print(f"gpu-check: FAIL build: the {f} CUDA build failed: {_tail(r.stderr)}")
                    return 1
                libs[f] = Path(obj[f])
        run = Run(mode, work, files, libs, env=env, plant_exact=a.plant_exact)
        run.write("machine.txt", _machine(mode))
        run.write("library-links.json", json.dumps({"links": run.link_libraries(),
                                                    "libraries": {f: str(p) for f, p in libs.items()}}, indent=2))
        if bundle_info is not None:
            run.write("bundle.json", json.dumps(bundle_info, indent=2) + "\n")
        if a.plant_exact:
            run.note("--plant-exact: the exact library's harness runs with the planted bug (its line must FAIL)")
        timings = {}
        if a.deadline:
            _DEADLINE[:] = [t0 + a.deadline]
        for c in checks:
            if _DEADLINE and time.monotonic() > _DEADLINE[0] - 20:
                run.say("FAIL", c, f"not run: out of time (--deadline {a.deadline:.0f} s)")
                continue
            run.note(f"{c} ...")
            tc = time.monotonic()
            {"libraries": lambda: check_libraries(run, bundle_info), "selftest": lambda: check_selftest(run),
             "harness": lambda: check_harness(run), "model": lambda: check_model(run),
             "qualify": lambda: check_qualify(run)}[c]()
            timings[c] = round(time.monotonic() - tc, 1)
            run.note(f"{c}: {timings[c]:.0f} s")
        seconds = round(time.monotonic() - t0, 1)
        failed = [x for x in run.lines if x.status == "FAIL"]
        lines = [x.render() for x in run.lines]
        summary: dict[str, Any] = {"ok": not failed, "mode": "cpu-stand-in" if mode.stand_in else "gpu",
                                   "seconds": seconds, "seconds_per_check": timings, "lines": lines, "checks": checks,
                                   "libraries": {f: str(p) for f, p in libs.items()}}
        with EvidenceWriter(out, "gpu-check") as w:
            for p in sorted(files.rglob("*")):
                if p.is_file():
                    w.write_bytes(str(p.relative_to(files)), p.read_bytes())
            w.write_json("summary.json", summary)
            w.write_text("summary.txt", "\n".join(lines) + "\n")
            directory, sha = w.commit()
        report = verify(directory, sha)
        if report.ok:
            run.say("PASS", "evidence", f"{directory} accepted by dflash verify (manifest sha256 {sha})")
        else:
            run.say("FAIL", "evidence", f"{directory}: dflash verify: {report.problems[0]}")
        failed = [x for x in run.lines if x.status == "FAIL"]
        print(f"gpu-check: {'FAIL' if failed else 'PASS'}: {len(run.lines) - len(failed)}/{len(run.lines)} lines "
              f"pass or inform, {seconds:.0f} s; evidence {directory}", flush=True)
        return 1 if failed else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
