"""The CPU build variants (`--cpu`): which instruction sets each one's ggml CPU backend uses, what a
host must have to run it, and a check of a built library's machine code against its variant.

native is llama.cpp's default (-march=native: whatever the building host has). The other variants
are llama.cpp's own GGML_<ISA> options with GGML_NATIVE off (cmake/llama.cmake), so they run on any
host with their instruction sets. AMX is never required: llama.cpp's CPU backend asks the kernel
for AMX per process and offers its AMX buffers only when granted, so an avx512 build runs on a CPU
without AMX (its weights then go to the other kernels, and qualification records tell the two
apart). Imports nothing from the rest of dflash.
"""
from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import UsageError, arg

NATIVE = "native"
CPU_VARIANTS = (NATIVE, "avx512", "avx512-noamx", "avx2")

_AVX2 = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
_AVX512 = _AVX2 + ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni",
                   "avx512_bf16")
# /proc/cpuinfo flags a host needs to run each variant (native: the building host, checked by the key)
REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {NATIVE: (), "avx512": _AVX512, "avx512-noamx": _AVX512, "avx2": _AVX2}
# instruction classes each variant's libggml-cpu must contain, and must not
EXPECTED: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "avx512": (frozenset({"avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx512_vbmi", "amx"}),
               frozenset({"avx_vnni"})),
    "avx512-noamx": (frozenset({"avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx512_vbmi"}),
                     frozenset({"amx", "avx_vnni"})),
    "avx2": (frozenset({"avx2"}),
             frozenset({"avx512", "avx512_vnni", "avx512_bf16", "avx512_vbmi", "amx", "avx_vnni"})),
}


def check_variant(cpu: str) -> str:
    if cpu not in CPU_VARIANTS:
        raise ValueError(f"unknown CPU variant {cpu!r} (use one of {', '.join(CPU_VARIANTS)})")
    return cpu


@functools.lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """The CPU feature flags of this host (/proc/cpuinfo's first flags line; empty when unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def refuse_unrunnable(cpu: str) -> None:
    """UsageError (one line, naming the flags) when this CPU lacks what variant `cpu` was built for:
    loading it, or a probe of it, would die of an illegal instruction."""
    missing = missing_flags(cpu)
    if missing:
        raise UsageError(f"{arg('cpu')} {cpu} needs {', '.join(missing)}, which this CPU lacks "
                         f"(it would die of an illegal instruction)")


def missing_flags(cpu: str, flags: Iterable[str] | None = None) -> list[str]:
    """The flags `cpu` needs that the host (or `flags`) lacks; [] when it can run it."""
    have = host_flags() if flags is None else frozenset(flags)
    if not have:  # no /proc/cpuinfo (not Linux): nothing to check against
        return []
    return [f for f in REQUIRED_FLAGS[check_variant(cpu)] if f not in have]


# ---- what a library's machine code uses (objdump -d of libggml-cpu) ----

_AMX = re.compile(r"\b(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|tilerelease"
                  r"|tdpb[su][su]d|tdpbf16ps)\b")
_VNNI = re.compile(r"\bvpdp(bu|ws)sds?\b")
_BF16 = re.compile(r"\b(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)\b")
_VBMI = re.compile(r"\b(vpermb|vpermi2b|vpermt2b|vpmultishiftqb)\b")
_YMM = re.compile(r"%ymm\d+")
_SEGMENT_OR_ADDR = {"26", "2e", "36", "3e", "64", "65", "67"}  # prefixes an EVEX or VEX instruction may carry


def _encoding(raw: str) -> str:
    """"evex", "vex" or "legacy" from an instruction's bytes (objdump's hex column)."""
    for b in raw.split():
        if b in _SEGMENT_OR_ADDR:
            continue
        return "evex" if b == "62" else "vex" if b in ("c4", "c5") else "legacy"
    return "legacy"


@dataclass(frozen=True)
class IsaReport:
    """Instruction classes found in one library, with an example instruction for each."""
    library: str
    instructions: int
    classes: dict[str, str]  # class -> first instruction seen

    def to_json(self, cpu: str) -> dict:
        """The report against variant `cpu`: its classes, size and problems (`dflash build --check-isa`)."""
        return {"variant": cpu, "classes": sorted(self.classes), "instructions": self.instructions,
                "problems": self.problems(cpu)}

    def problems(self, cpu: str) -> list[str]:
        """What contradicts variant `cpu` (native: nothing is checked; it is the host's own)."""
        if check_variant(cpu) == NATIVE:
            return []
        need, forbid = EXPECTED[cpu]
        out = [f"no {c} instructions" for c in sorted(need - self.classes.keys())]
        out += [f"{c} instructions ({self.classes[c]})" for c in sorted(forbid & self.classes.keys())]
        return out


def classify(lines: Iterable[str], library: str = "") -> IsaReport:
    """The instruction classes in `objdump -d` output (AT&T syntax, with the bytes column): EVEX
    encodings are AVX-512, VEX encodings on ymm registers AVX/AVX2, VEX-encoded VNNI is AVX-VNNI."""
    classes: dict[str, str] = {}
    n = 0
    for line in lines:
        parts = line.split("\t")
        if len(parts) < 3 or not line.startswith(" "):
            continue  # headers, labels, and the byte-only continuation of a long instruction
        insn = parts[2].strip()
        if not insn or insn.startswith("("):
            continue
        n += 1
        enc = _encoding(parts[1])
        found = []
        if _AMX.search(insn):
            found.append("amx")
        if enc == "evex":
            found.append("avx512")
        if _VNNI.search(insn):
            found.append("avx512_vnni" if enc == "evex" else "avx_vnni")
        if _BF16.search(insn):
            found.append("avx512_bf16")
        if _VBMI.search(insn):
            found.append("avx512_vbmi")
        if enc == "vex" and _YMM.search(insn):
            found.append("avx2")
        for c in found:
            classes.setdefault(c, insn)
    return IsaReport(library, n, classes)


def disassemble(library: Path, objdump: str = "objdump") -> IsaReport:
    """objdump -d of `library`'s code, classified; raises OSError/RuntimeError when objdump fails."""
    proc = subprocess.Popen([objdump, "-d", str(library)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    report = classify(proc.stdout, str(library))
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0:
        raise RuntimeError(f"objdump -d {library} failed: {err.strip()[-200:]}")
    return report
