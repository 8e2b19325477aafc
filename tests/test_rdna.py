"""The RDNA interpreter (dflash/native/rdna): decoding checked against LLVM's disassembler, every
instruction it implements checked against a host computation of the ISA documents' pseudocode on
edge values (signs, carries, saturation, subnormals, infinities, NaN, rounding), micro-kernels for
the barrier, the lane permute and exec-masked branches, and the shipped narrow-MMVQ code objects of
both chips run whole (dflash kernels run): every kernel's columns identical to the host body and to
ncols 1, and the planted-order twin caught.

The references below are written from the pseudocode (tinygrad's str_pcode.py, from AMD's RDNA3.5
and RDNA4 ISA documents) independently of the interpreter: float results by exact rational
arithmetic rounded once to binary32 (fractions.Fraction), never by numpy. Instructions are
assembled by LLVM (llvm-mc-19), not by the interpreter's decoder.

Twins: a deliberately wrong dot4 (the unsigned operand read as signed) and a deliberately wrong
f32 add (flushing subnormal results) must fail these checks; a kernel with a race between its
waves (no barrier) must give other bits when the waves run in the other order."""
from __future__ import annotations

import json
import random
import re
import shutil
import struct
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from dflash.core.errors import DflashError
from dflash.native import kernel_run
from dflash.native.rdna import codeobj, decode, machine, semantics
from dflash.native.rdna.state import WAVE, InterpreterError, Memory

from .conftest import ROOT, run_dflash

ISA = {"gfx1151": "rdna3", "gfx1201": "rdna4"}
ARCHS = tuple(ISA)
LLVM_MC = shutil.which("llvm-mc-19") or shutil.which("llvm-mc")
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------- assembling and running one wave

_asm_cache: dict[tuple[str, tuple[str, ...]], bytes] = {}


def assemble(arch: str, lines: list[str]) -> bytes:
    key = (arch, tuple(lines))
    if key not in _asm_cache:
        assert LLVM_MC, "llvm-mc-19 is missing: scripts/setup --all installs llvm-19"
        r = subprocess.run([LLVM_MC, "-arch=amdgcn", f"-mcpu={arch}", "-show-encoding"], input="\n".join(lines) + "\n",
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        enc = re.findall(r"encoding: \[([^\]]*)\]", r.stdout)
        assert len(enc) == len(lines), (r.stdout, r.stderr)
        _asm_cache[key] = b"".join(bytes(int(b, 16) for b in e.split(",")) for e in enc)
    return _asm_cache[key]


def run(arch: str, lines: list[str], vgprs: dict[int, np.ndarray] | None = None, sgprs: dict[int, int] | None = None,
        exec_mask: int = M32, scc: int = 0, mem: Memory | None = None, lds: bytes | None = None) -> machine.Wave:
    """`lines` then s_endpgm on one wave of `arch`."""
    code = assemble(arch, [*lines, "s_endpgm"])
    prog = machine.program(code, 0, ISA[arch])
    w = machine.new_wave(ISA[arch], 1024, mem)
    for r, vals in (vgprs or {}).items():
        w.v[r] = np.asarray(vals, np.uint64).astype(np.uint32)
    for r, val in (sgprs or {}).items():
        w.s[r] = val & M32
    w.s[decode.EXEC_LO], w.scc = exec_mask, scc
    if lds is not None:
        w.lds[: len(lds)] = np.frombuffer(lds, np.uint8)
    return machine.run_wave(prog, w)


# ---------------------------------------------------------------- the references' arithmetic

def float_from_bits(b: int, exp_bits: int = 8, man_bits: int = 23) -> Fraction | str:
    """The exact value of IEEE bits (binary32 by default, binary16 with 5 and 10), or 'inf',
    '-inf', 'nan'."""
    sign, exp, man = b >> (exp_bits + man_bits), (b >> man_bits) & ((1 << exp_bits) - 1), b & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    if exp == (1 << exp_bits) - 1:
        return "nan" if man else ("-inf" if sign else "inf")
    v = Fraction(man, 1 << man_bits) * Fraction(2) ** (1 - bias) if exp == 0 else \
        (1 + Fraction(man, 1 << man_bits)) * Fraction(2) ** (exp - bias)
    return -v if sign else v


def f32_from_bits(b: int) -> Fraction | str:
    return float_from_bits(b)


def f16_from_bits(b: int) -> Fraction | str:
    return float_from_bits(b, 5, 10)


def f32_round(v: Fraction | str, negative_zero: bool = False) -> int:
    """IEEE binary32 bits of `v` rounded to nearest, ties to even, subnormals kept."""
    if v == "nan":
        return 0x7FC00000
    if v in ("inf", "-inf"):
        return 0x7F800000 | (0x80000000 if v == "-inf" else 0)
    assert isinstance(v, Fraction)
    sign = 0x80000000 if v < 0 or (v == 0 and negative_zero) else 0
    a = abs(v)
    if a == 0:
        return sign
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, -126)  # below 2^-126: the subnormal grid of 2^-149
    q = a / Fraction(2) ** (e - 23)  # the significand in units of the last place
    n = q.numerator // q.denominator
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2):
        n += 1
    if n == 1 << 24:
        n, e = n >> 1, e + 1
    if e > 127:
        return sign | 0x7F800000
    if n < 1 << 23:  # subnormal
        return sign | n
    return sign | ((e + 127) << 23) | (n - (1 << 23))


def f32_op(a: int, b: int, op: str) -> int:
    x, y = f32_from_bits(a), f32_from_bits(b)
    if "nan" in (x, y):
        return 0x7FC00000
    if isinstance(x, str) or isinstance(y, str):  # infinities: numpy's float64 gives IEEE's answer
        fx = float("inf") if x == "inf" else float("-inf") if x == "-inf" else float(x)
        fy = float("inf") if y == "inf" else float("-inf") if y == "-inf" else float(y)
        r = {"add": fx + fy, "sub": fx - fy, "mul": fx * fy}[op]
        return f32_round("nan" if r != r else ("inf" if r > 0 else "-inf") if abs(r) == float("inf") else Fraction(r))
    r = {"add": x + y, "sub": x - y, "mul": x * y}[op]
    sx, sy = a >> 31, b >> 31  # the sign of an exact zero, by IEEE's rules (round to nearest)
    neg_zero = {"add": sx and sy, "sub": sx and not sy, "mul": sx != sy}[op]
    return f32_round(r, bool(neg_zero))


def same_f32(got: int, want: int) -> bool:
    nan = lambda b: (b >> 23) & 0xFF == 0xFF and b & 0x7FFFFF  # noqa: E731
    return bool(nan(got) and nan(want)) or got == want


def i32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x >> 31 else x


U32_EDGES = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 33, 63, 64, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF,
             0x10000, 0xFFFFFF, 0x1000000, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFE, M32]
F32_EDGES = [0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x80800000, 0x3F800000, 0xBF800000,
             0x3F000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x3F800001, 0x33800000,
             0x4B800000, 0x00400000, 0x0C000000, 0x72000000, 0x40490FDB, 0xC0490FDB]


def lanes(edges: list[int], rot: int, seed: int, bits: int = 32) -> np.ndarray:
    rng = random.Random(seed)
    vals = edges[rot % len(edges):] + edges[: rot % len(edges)]
    vals = (vals + [rng.getrandbits(bits) for _ in range(WAVE)])[:WAVE]
    return np.array(vals, np.uint64)


# ---------------------------------------------------------------- VALU, checked lane by lane

def _bfe(a: int, off: int, width: int, signed: bool) -> int:
    off, width = off & 31, width & 31
    t = (a >> off) & ((1 << width) - 1)
    if signed and width and t >> (width - 1):
        t -= 1 << width
    return t & M32 if width else 0


def _perm(a: int, b: int, sel: int) -> int:
    data = (a << 32) | b
    out = 0
    for k in range(4):
        s = (sel >> (8 * k)) & 0xFF
        byte = lambda j: (data >> (8 * j)) & 0xFF  # noqa: E731
        if s >= 13:
            r = 0xFF
        elif s == 12:
            r = 0
        elif s >= 8:
            r = 0xFF if byte({8: 1, 9: 3, 10: 5, 11: 7}[s]) >> 7 else 0
        else:
            r = byte(s)
        out |= r << (8 * k)
    return out


# name: (assembly, sources' edge lists, reference(a, b, c, lane) -> 32-bit result; float results compared as f32)
U, F = U32_EDGES, F32_EDGES
VALU = {
    "V_MOV_B32": ("v_mov_b32 v10, v1", [U], lambda a, b, c, n: a),
    "V_AND_B32": ("v_and_b32 v10, v1, v2", [U, U], lambda a, b, c, n: a & b),
    "V_OR_B32": ("v_or_b32 v10, v1, v2", [U, U], lambda a, b, c, n: a | b),
    "V_XOR_B32": ("v_xor_b32 v10, v1, v2", [U, U], lambda a, b, c, n: a ^ b),
    "V_ADD_NC_U32": ("v_add_nc_u32 v10, v1, v2", [U, U], lambda a, b, c, n: (a + b) & M32),
    "V_SUB_NC_U32": ("v_sub_nc_u32 v10, v1, v2", [U, U], lambda a, b, c, n: (a - b) & M32),
    "V_LSHLREV_B32": ("v_lshlrev_b32 v10, v1, v2", [U, U], lambda a, b, c, n: (b << (a & 31)) & M32),
    "V_LSHRREV_B32": ("v_lshrrev_b32 v10, v1, v2", [U, U], lambda a, b, c, n: b >> (a & 31)),
    "V_MUL_U32_U24": ("v_mul_u32_u24 v10, v1, v2", [U, U], lambda a, b, c, n: ((a & 0xFFFFFF) * (b & 0xFFFFFF)) & M32),
    "V_MUL_HI_U32_U24": ("v_mul_hi_u32_u24 v10, v1, v2", [U, U],
                         lambda a, b, c, n: ((a & 0xFFFFFF) * (b & 0xFFFFFF)) >> 32),
    "V_MUL_LO_U32": ("v_mul_lo_u32 v10, v1, v2", [U, U], lambda a, b, c, n: (a * b) & M32),
    "V_ADD3_U32": ("v_add3_u32 v10, v1, v2, v3", [U, U, U], lambda a, b, c, n: (a + b + c) & M32),
    "V_OR3_B32": ("v_or3_b32 v10, v1, v2, v3", [U, U, U], lambda a, b, c, n: a | b | c),
    "V_AND_OR_B32": ("v_and_or_b32 v10, v1, v2, v3", [U, U, U], lambda a, b, c, n: (a & b) | c),
    "V_LSHL_OR_B32": ("v_lshl_or_b32 v10, v1, v2, v3", [U, U, U], lambda a, b, c, n: ((a << (b & 31)) & M32) | c),
    "V_LSHL_ADD_U32": ("v_lshl_add_u32 v10, v1, v2, v3", [U, U, U],
                       lambda a, b, c, n: (((a << (b & 31)) & M32) + c) & M32),
    "V_BFE_U32": ("v_bfe_u32 v10, v1, v2, v3", [U, U, U], lambda a, b, c, n: _bfe(a, b, c, False)),
    "V_BFE_I32": ("v_bfe_i32 v10, v1, v2, v3", [U, U, U], lambda a, b, c, n: _bfe(a, b, c, True)),
    "V_PERM_B32": ("v_perm_b32 v10, v1, v2, v3", [U, U, [0x03020100, 0x07060504, 0x0C0D0E0F, 0x08090A0B,
                                                         0x0B0A0908, 0x10FF0D0C, 0x01234567]],
                   lambda a, b, c, n: _perm(a, b, c)),
    "V_MBCNT_LO_U32_B32": ("v_mbcnt_lo_u32_b32 v10, v1, v2", [U, U],
                           lambda a, b, c, n: (bin(a & ((1 << n) - 1)).count("1") + b) & M32),
    "V_CVT_F32_I32": ("v_cvt_f32_i32 v10, v1", [U], lambda a, b, c, n: f32_round(Fraction(i32(a)))),
    "V_CVT_F32_F16": ("v_cvt_f32_f16 v10, v1", [[0, 0x8000, 1, 0x8001, 0x3FF, 0x400, 0x3C00, 0x7BFF, 0x7C00, 0xFC00,
                                                  0x7E00, 0x1234 | 0xABCD0000]],
                      lambda a, b, c, n: f32_round(f16_from_bits(a & 0xFFFF), bool(a & 0x8000))),
    "V_RCP_IFLAG_F32": ("v_rcp_iflag_f32 v10, v1", [F], None),  # below: 1/x exact rounding where finite
    "V_ADD_F32": ("v_add_f32 v10, v1, v2", [F, F], lambda a, b, c, n: f32_op(a, b, "add")),
    "V_SUB_F32": ("v_sub_f32 v10, v1, v2", [F, F], lambda a, b, c, n: f32_op(a, b, "sub")),
    "V_MUL_F32": ("v_mul_f32 v10, v1, v2", [F, F], lambda a, b, c, n: f32_op(a, b, "mul")),
}
FLOAT_RESULTS = {"V_CVT_F32_I32", "V_CVT_F32_F16", "V_RCP_IFLAG_F32", "V_ADD_F32", "V_SUB_F32", "V_MUL_F32"}


def _rcp(a: int) -> int:
    x = f32_from_bits(a)
    if x == "nan":
        return 0x7FC00000
    if x in ("inf", "-inf"):
        return 0x80000000 if x == "-inf" else 0
    assert isinstance(x, Fraction)
    if x == 0:
        return 0xFF800000 if a >> 31 else 0x7F800000
    return f32_round(1 / x)


def valu_mismatches(arch: str, name: str, rounds: int = 4) -> list[str]:
    asm, edges, ref = VALU[name]
    if name == "V_RCP_IFLAG_F32":
        ref = lambda a, b, c, n: _rcp(a)  # noqa: E731
    bad = []
    for rnd in range(rounds):
        srcs = [lanes(e, rnd * (k + 3), seed=rnd * 10 + k) for k, e in enumerate(edges)]
        w = run(arch, [asm], {k + 1: s for k, s in enumerate(srcs)})
        for lane in range(WAVE):
            args = [int(s[lane]) & M32 for s in srcs] + [0] * (3 - len(srcs))
            want = ref(*args, lane) & M32
            got = int(w.v[10][lane])
            ok = same_f32(got, want) if name in FLOAT_RESULTS else got == want
            if not ok:
                bad.append(f"{name} lane {lane} {[hex(a) for a in args[:len(srcs)]]}: got {got:#x}, want {want:#x}")
    return bad


def _valu_cases() -> list[tuple[str, str]]:
    return [(a, n) for a in ARCHS for n in VALU]


@pytest.mark.parametrize("arch,name", _valu_cases())
def test_valu_instruction_matches_the_pseudocode(arch, name):
    assert not valu_mismatches(arch, name)[:8]


def test_float_modifiers_abs_and_neg():
    a, b = lanes(F, 0, 1), lanes(F, 5, 2)
    w = run("gfx1201", ["v_add_f32_e64 v10, -|v1|, |v2|"], {1: a, 2: b})
    for lane in range(WAVE):
        x, y = (int(a[lane]) | 0x80000000), int(b[lane]) & 0x7FFFFFFF
        assert same_f32(int(w.v[10][lane]), f32_op(x, y, "add")), lane


def _dot4_ref(a: int, b: int, c: int, signed_a: bool, signed_b: bool, clamp: bool) -> int:
    t = i32(c)
    for k in range(4):
        x, y = (a >> (8 * k)) & 0xFF, (b >> (8 * k)) & 0xFF
        x = x - 256 if signed_a and x >> 7 else x
        y = y - 256 if signed_b and y >> 7 else y
        t += x * y
    if clamp:
        t = max(-(2**31), min(2**31 - 1, t))
    return t & M32


def dot4_mismatches(arch: str) -> list[str]:
    bad = []
    bytes_edges = [0, 0x7F7F7F7F, 0x80808080, 0xFFFFFFFF, 0x01FF807F, 0x12345678, 0xFEDCBA98, 0x00000080]
    acc_edges = [0, 1, M32, 0x7FFFFFFF, 0x80000000, 0x7FFF0000, 0x80010000]
    for sa, sb, clamp in [(x, y, z) for x in (0, 1) for y in (0, 1) for z in (0, 1)]:
        a, b, c = lanes(bytes_edges, sa, 1), lanes(bytes_edges, 3 + sb, 2), lanes(acc_edges, clamp, 3)
        asm = f"v_dot4_i32_iu8 v10, v1, v2, v3 neg_lo:[{sa},{sb},0]" + (" clamp" if clamp else "")
        w = run(arch, [asm], {1: a, 2: b, 3: c})
        for lane in range(WAVE):
            want = _dot4_ref(int(a[lane]), int(b[lane]), int(c[lane]), bool(sa), bool(sb), bool(clamp))
            if int(w.v[10][lane]) != want:
                bad.append(f"{asm} lane {lane}: got {int(w.v[10][lane]):#x}, want {want:#x}")
    return bad


@pytest.mark.parametrize("arch", ARCHS)
def test_dot4_signedness_and_clamp(arch):
    assert not dot4_mismatches(arch)[:8]


def test_a_wrong_dot4_is_caught(monkeypatch):
    """The twin: dot4 reading S1's bytes as signed whatever NEG[1] says."""
    def wrong(w, i):
        i2 = decode.Instr(i.addr, i.size, i.name, i.fmt, i.ops, {**i.mods, "neg": i.mods.get("neg", 0) | 2})
        return semantics._dot4_iu8(w, i2)
    monkeypatch.setitem(semantics.SPECIAL, "V_DOT4_I32_IU8", wrong)
    assert dot4_mismatches("gfx1201")


def test_a_subnormal_flushing_add_is_caught(monkeypatch):
    """The twin: an f32 add that flushes subnormal results to zero, as FLOAT_DENORM_MODE 0 would."""
    nsrc, ty, fn = semantics.VOP["V_ADD_F32"]

    def flushing(a, b):
        r = np.asarray(fn(a, b), np.uint32)
        return np.where((r & np.uint32(0x7F800000)) == 0, r & np.uint32(0x80000000), r)
    monkeypatch.setitem(semantics.VOP, "V_ADD_F32", (nsrc, ty, flushing))
    assert valu_mismatches("gfx1201", "V_ADD_F32")


@pytest.mark.parametrize("arch", ARCHS)
def test_exec_masks_every_vector_write(arch):
    mask = 0x0F0F00FF
    w = run(arch, ["v_add_nc_u32 v10, v1, v2"], {1: np.arange(WAVE), 2: np.full(WAVE, 5), 10: np.full(WAVE, 7)},
            exec_mask=mask)
    for lane in range(WAVE):
        assert int(w.v[10][lane]) == (lane + 5 if mask >> lane & 1 else 7)


# ---------------------------------------------------------------- compares, carries, lane moves

def _cmps() -> dict:
    preds = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "gt": lambda a, b: a > b,
             "lt": lambda a, b: a < b, "ge": lambda a, b: a >= b, "le": lambda a, b: a <= b}
    s16 = lambda x: (x & 0xFFFF) - 0x10000 if x & 0x8000 else x & 0xFFFF  # noqa: E731
    conv = {"u32": lambda x: x, "i32": i32, "u16": lambda x: x & 0xFFFF, "i16": s16}
    def pred(f, c):
        return lambda a, b: f(c(a), c(b))
    return {f"{p}_{t}": pred(f, conv[t]) for p, f in preds.items() for t in conv}


CMPS = _cmps()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("form", ["e32", "e64", "cmpx"])
def test_compares_write_lane_masks_with_inactive_lanes_zero(arch, form):
    a, b = lanes(U, 0, 4), lanes(U, 7, 5)
    b[::3] = a[::3]
    mask = 0xF0FFFF0F
    for cmp, pred in CMPS.items():
        asm = {"e32": f"v_cmp_{cmp}_e32 vcc_lo, v1, v2", "e64": f"v_cmp_{cmp}_e64 s20, v1, v2",
               "cmpx": f"v_cmpx_{cmp}_e64 v1, v2"}[form]
        w = run(arch, [asm], {1: a, 2: b}, sgprs={20: 0xDEAD}, exec_mask=mask)
        want = sum(1 << lane for lane in range(WAVE) if mask >> lane & 1 and pred(int(a[lane]), int(b[lane])))
        got = {"e32": w.s[decode.VCC_LO], "e64": w.s[20], "cmpx": w.s[decode.EXEC_LO]}[form]
        assert got == want, (asm, hex(got), hex(want))


@pytest.mark.parametrize("arch", ARCHS)
def test_sixteen_bit_compare_and_shift(arch):
    a = lanes([0, 0x8000, 0x7FFF, 0xFFFF, 0x12348001, 0x80010002], 0, 6)
    b = lanes([0, 1, 0x8001, 0x0001FFFF, 0x7FFF], 2, 7)
    w = run(arch, ["v_cmp_lt_i16_e64 s20, v1, v2", "v_lshrrev_b16 v10, v2, v1"], {1: a, 2: b, 10: a})
    s16 = lambda x: (x & 0xFFFF) - 0x10000 if x & 0x8000 else x & 0xFFFF  # noqa: E731
    assert w.s[20] == sum(1 << n for n in range(WAVE) if s16(int(a[n])) < s16(int(b[n])))
    for n in range(WAVE):  # D0.u16 = S1.u16 >> S0[3:0]; the high half of the destination is kept
        x, sh = int(a[n]), int(b[n]) & 15
        assert int(w.v[10][n]) == (x & 0xFFFF0000) | ((x & 0xFFFF) >> sh), n


@pytest.mark.parametrize("arch", ARCHS)
def test_cndmask_carries_and_wide_multiply_add(arch):
    a, b, c = lanes(U, 0, 8), lanes(U, 3, 9), lanes(U, 11, 10)
    c64 = (c << np.uint64(32)) | lanes(U, 5, 11)
    sel = 0x5A5AF00F
    mad = "v_mad_co_u64_u32" if arch == "gfx1201" else "v_mad_u64_u32"
    w = run(arch, ["v_cndmask_b32_e64 v10, v1, v2, s20", "v_add_co_u32 v11, s21, v1, v2",
                   "v_add_co_ci_u32_e64 v12, s22, v1, v2, s20", "v_cndmask_b32_e32 v13, v1, v2, vcc_lo",
                   f"{mad} v[14:15], s23, v1, v2, v[4:5]", "v_lshrrev_b64 v[16:17], v3, v[4:5]"],
            {1: a, 2: b, 3: c, 4: c64 & np.uint64(M32), 5: c64 >> np.uint64(32)}, sgprs={20: sel, 106: ~sel & M32})
    carry, carry2, carry3 = 0, 0, 0
    for n in range(WAVE):
        x, y, s = int(a[n]), int(b[n]), sel >> n & 1
        assert int(w.v[10][n]) == (y if s else x)
        assert int(w.v[13][n]) == (x if s else y)
        assert int(w.v[11][n]) == (x + y) & M32
        carry |= ((x + y) >> 32) << n
        assert int(w.v[12][n]) == (x + y + s) & M32
        carry2 |= ((x + y + s) >> 32) << n
        full = x * y + int(c64[n])
        assert int(w.v[14][n]) | int(w.v[15][n]) << 32 == full & (2**64 - 1)
        carry3 |= (full >> 64) << n
        assert int(w.v[16][n]) | int(w.v[17][n]) << 32 == int(c64[n]) >> (int(c[n]) & 63)
    assert (w.s[21], w.s[22], w.s[23]) == (carry, carry2, carry3)


@pytest.mark.parametrize("arch", ARCHS)
def test_readfirstlane_and_bpermute(arch):
    data = np.arange(100, 100 + WAVE)
    addr = (31 - np.arange(WAVE)) * 4 + 128 * (np.arange(WAVE) % 3)  # a multiple of 32 lanes more: ignored
    w = run(arch, ["v_readfirstlane_b32 s20, v1", "ds_bpermute_b32 v10, v2, v1"],
            {1: data, 2: addr, 10: np.zeros(WAVE)}, exec_mask=0x0000FFF0)
    assert w.s[20] == 104  # the lowest active lane
    for n in range(WAVE):
        src = (int(addr[n]) // 4) % WAVE
        want = (100 + src if 0x0000FFF0 >> src & 1 else 0) if 0x0000FFF0 >> n & 1 else 0
        assert int(w.v[10][n]) == want, n
    w = run(arch, ["v_readfirstlane_b32 s20, v1"], {1: data}, exec_mask=0)
    assert w.s[20] == 100  # no lane active: lane 0


DUAL_REF = {"mov_b32": lambda a, b, v: a, "add_nc_u32": lambda a, b, v: (a + b) & M32,
            "and_b32": lambda a, b, v: a & b, "lshlrev_b32": lambda a, b, v: (b << (a & 31)) & M32,
            "add_f32": lambda a, b, v: f32_op(a, b, "add"), "sub_f32": lambda a, b, v: f32_op(a, b, "sub"),
            "mul_f32": lambda a, b, v: f32_op(a, b, "mul"), "cndmask_b32": lambda a, b, v: b if v else a}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_dual_issue_operation(arch):
    a, b, c, d = lanes(F, 0, 20), lanes(F, 4, 21), lanes(U, 2, 22), lanes(U, 9, 23)
    vcc = 0x3C3C5AA5
    # the X slot takes fewer operations than Y: every operation once in the slot it is in
    pairs = [("mov_b32", "add_nc_u32"), ("add_f32", "and_b32"), ("sub_f32", "lshlrev_b32"), ("mul_f32", "mov_b32"),
             ("cndmask_b32", "mul_f32"), ("mov_b32", "add_f32"), ("add_f32", "sub_f32"), ("sub_f32", "cndmask_b32")]
    def half(op: str, dst: int, s0: int, s1: int) -> str:
        return f"v_dual_{op} v{dst}, v{s0}" + ("" if op == "mov_b32" else f", v{s1}")
    for x, y in pairs:
        w = run(arch, [f"{half(x, 10, 1, 2)} :: {half(y, 13, 4, 3)}"], {1: a, 2: b, 3: c, 4: d},
                sgprs={decode.VCC_LO: vcc})
        for n in range(WAVE):
            for op, dst, (s0, s1) in ((x, 10, (a, b)), (y, 13, (d, c))):
                want = DUAL_REF[op](int(s0[n]), int(s1[n]), vcc >> n & 1)
                got = int(w.v[dst][n])
                assert same_f32(got, want) if op.endswith("f32") else got == want, (op, n, hex(got), hex(want))


def test_dual_issue_reads_both_sources_before_writing():
    w = run("gfx1201", ["v_dual_mov_b32 v1, v2 :: v_dual_mov_b32 v2, v1",
                        "v_dual_mul_f32 v11, v3, v4 :: v_dual_add_f32 v12, v6, v5"],
            {1: np.full(WAVE, 1), 2: np.full(WAVE, 2), 3: np.full(WAVE, 0x40400000), 4: np.full(WAVE, 0x3F000000),
             5: np.full(WAVE, 0x3F000000), 6: np.full(WAVE, 0x40400000)})
    assert (w.v[1] == 2).all() and (w.v[2] == 1).all()
    assert (w.v[11] == 0x3FC00000).all() and (w.v[12] == 0x40600000).all()


# ---------------------------------------------------------------- scalar ALU

def _sop(name: str, a: int, b: int, scc: int) -> tuple[int, int | None]:
    r = {"s_and_b32": (a & b, None), "s_or_b32": (a | b, None), "s_xor_b32": (a ^ b, None),
         "s_and_not1_b32": (a & ~b & M32, None), "s_lshl_b32": ((a << (b & 31)) & M32, None),
         "s_lshr_b32": (a >> (b & 31), None), "s_ashr_i32": ((i32(a) >> (b & 31)) & M32, None),
         "s_mul_i32": ((i32(a) * i32(b)) & M32, None), "s_mul_hi_u32": ((a * b) >> 32, None),
         "s_cselect_b32": (a if scc else b, None)}.get(name)
    if r is not None:
        d = r[0]
        return d, (None if name in ("s_mul_i32", "s_mul_hi_u32", "s_cselect_b32") else int(d != 0))
    if name in ("s_add_u32",):
        return (a + b) & M32, int(a + b > M32)
    if name == "s_addc_u32":
        return (a + b + scc) & M32, int(a + b + scc > M32)
    if name in ("s_add_i32", "s_add_co_i32"):
        t = (a + b) & M32
        return t, int(a >> 31 == b >> 31 and a >> 31 != t >> 31)
    if name in ("s_sub_i32", "s_sub_co_i32"):
        t = (a - b) & M32
        return t, int(a >> 31 != b >> 31 and a >> 31 != t >> 31)
    raise KeyError(name)


SOP2 = {"gfx1151": ["s_and_b32", "s_or_b32", "s_xor_b32", "s_and_not1_b32", "s_lshl_b32", "s_ashr_i32", "s_mul_i32",
                    "s_mul_hi_u32", "s_cselect_b32", "s_add_u32", "s_addc_u32", "s_add_i32", "s_sub_i32"],
        "gfx1201": ["s_and_b32", "s_or_b32", "s_xor_b32", "s_and_not1_b32", "s_lshl_b32", "s_lshr_b32", "s_ashr_i32",
                    "s_mul_i32", "s_mul_hi_u32", "s_cselect_b32", "s_add_co_i32", "s_sub_co_i32"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_scalar_alu_results_and_scc(arch):
    rng = random.Random(3)
    pairs = [(a, b) for a in U[::3] for b in U[1::4]] + [(rng.getrandbits(32), rng.getrandbits(32)) for _ in range(20)]
    for name in SOP2[arch]:
        for a, b in pairs[:40]:
            for scc in (0, 1):
                w = run(arch, [f"{name} s3, s1, s2"], sgprs={1: a, 2: b}, scc=scc)
                d, want_scc = _sop(name, a, b, scc)
                assert w.s[3] == d, (name, hex(a), hex(b), scc)
                assert w.scc == (scc if want_scc is None else want_scc), (name, hex(a), hex(b), scc)
                if name not in ("s_addc_u32", "s_cselect_b32"):
                    break


SCMP = {"ge_i32": lambda a, b: i32(a) >= i32(b), "ge_u32": lambda a, b: a >= b, "eq_u32": lambda a, b: a == b,
        "lg_u32": lambda a, b: a != b, "lt_i32": lambda a, b: i32(a) < i32(b), "gt_i32": lambda a, b: i32(a) > i32(b)}


@pytest.mark.parametrize("arch", ARCHS)
def test_scalar_conversions_compares_and_exec_saves(arch):
    for f, want in [(0x3F800000, 1), (0x4F800000, M32), (0xBF800000, 0), (0x7FC00000, 0), (0x3FFFFFFF, 1),
                    (0x4F7FFFFF, 0xFFFFFF00), (0x00000001, 0), (0x7F800000, M32)]:
        w = run(arch, [f"s_mov_b32 s1, {f:#x}", "s_cvt_u32_f32 s2, s1"])
        assert w.s[2] == want, hex(f)
    for u in (0, 1, 0xFFFFFF, 0x1000001, M32, 0x80000001):
        w = run(arch, [f"s_mov_b32 s1, {u:#x}", "s_cvt_f32_u32 s2, s1", "s_mul_f32 s3, s2, 0.5"])
        assert w.s[2] == f32_round(Fraction(u)) and w.s[3] == f32_op(w.s[2], 0x3F000000, "mul"), hex(u)
    for a, b in [(0, 1), (1, 0), (M32, 0), (0x80000000, 0x7FFFFFFF), (5, 5), (0x7FFFFFFF, 0x80000000)]:
        for cmp, pred in SCMP.items():
            w = run(arch, [f"s_cmp_{cmp} s1, s2"], sgprs={1: a, 2: b})
            assert w.scc == int(pred(a, b)), (cmp, hex(a), hex(b))
    w = run(arch, ["s_mov_b32 s1, 0xFF00FF00", "s_and_saveexec_b32 s2, s1"], exec_mask=0x0FF00FF0)
    assert (w.s[2], w.s[decode.EXEC_LO], w.scc) == (0x0FF00FF0, 0x0F000F00, 1)
    w = run(arch, ["s_mov_b32 s1, 0xFF00FF00", "s_and_not1_saveexec_b32 s2, s1"], exec_mask=0xFF00FF00)
    assert (w.s[2], w.s[decode.EXEC_LO], w.scc) == (0xFF00FF00, 0, 0)
    w = run(arch, ["s_mov_b32 s1, 0x80000005", "s_abs_i32 s2, s1", "s_mov_b32 s3, -7", "s_mulk_i32 s3, 0xfffd"]
            if arch == "gfx1151" else ["s_mov_b32 s1, 0x80000005", "s_abs_i32 s2, s1"])
    assert w.s[2] == 0x7FFFFFFB and w.scc == 1
    if arch == "gfx1151":
        assert w.s[3] == 21
    if arch == "gfx1201":  # 64-bit scalar arithmetic
        w = run(arch, ["s_mov_b32 s2, 0xFFFFFFFF", "s_mov_b32 s3, 1", "s_mov_b32 s4, 3", "s_mov_b32 s5, 0",
                       "s_add_nc_u64 s[6:7], s[2:3], s[4:5]", "s_mul_u64 s[8:9], s[2:3], s[4:5]",
                       "s_lshl_b64 s[10:11], s[2:3], 4"])
        x = 0x1FFFFFFFF
        assert (w.s[6] | w.s[7] << 32, w.s[8] | w.s[9] << 32, w.s[10] | w.s[11] << 32) == (x + 3, x * 3, x << 4)


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("arch", ARCHS)
def test_global_and_scalar_loads_and_stores(arch):
    mem = Memory()
    data = bytes(range(256))
    buf = mem.alloc(data)
    out = mem.alloc(4 * WAVE)
    lines = ["global_load_u8 v10, v1, s[2:3] offset:-4", "global_load_i8 v11, v1, s[2:3]",
             "global_load_u16 v12, v1, s[2:3] offset:2", "global_load_b32 v13, v1, s[2:3] offset:4",
             "global_load_b64 v[14:15], v[4:5], off offset:8", "global_store_b32 v6, v13, s[6:7]",
             "global_load_b128 v[20:23], v1, s[2:3] offset:16",
             "s_load_b32 s20, s[2:3], 0x8", "s_load_b64 s[22:23], s[2:3], 0x10", "s_load_b128 s[24:27], s[2:3], 0x20",
             "s_load_b256 s[32:39], s[2:3], 0x40"]
    offs = np.arange(WAVE) * 4 + 4
    w = run(arch, lines, {1: offs, 4: (buf + offs) & M32, 5: np.full(WAVE, buf >> 32), 6: np.arange(WAVE) * 4},
            sgprs={2: buf & M32, 3: buf >> 32, 6: out & M32, 7: out >> 32}, mem=mem)
    for n in range(WAVE):
        o = int(offs[n])
        assert int(w.v[10][n]) == data[o - 4]
        assert int(w.v[11][n]) == (data[o] - 256 if data[o] > 127 else data[o]) & M32
        assert int(w.v[12][n]) == struct.unpack_from("<H", data, o + 2)[0]
        assert int(w.v[13][n]) == struct.unpack_from("<I", data, o + 4)[0]
        assert int(w.v[14][n]) | int(w.v[15][n]) << 32 == struct.unpack_from("<Q", data, o + 8)[0]
        assert [int(w.v[20 + k][n]) for k in range(4)] == list(struct.unpack_from("<4I", data, o + 16))
    assert np.frombuffer(mem.read(out, 4 * WAVE), "<u4").tolist() == [int(x) for x in w.v[13]]
    assert w.s[20] == struct.unpack_from("<I", data, 8)[0]
    assert [w.s[k] for k in range(32, 40)] == list(struct.unpack_from("<8I", data, 0x40))
    with pytest.raises(InterpreterError, match="outside every buffer"):
        run(arch, ["global_load_b32 v13, v1, s[2:3] offset:4"], {1: np.full(WAVE, 300)},
            sgprs={2: buf & M32, 3: buf >> 32}, mem=mem)


@pytest.mark.parametrize("arch", ARCHS)
def test_lds_loads_and_stores(arch):
    addr = np.arange(WAVE) * 4
    lines = ["ds_store_b32 v1, v2 offset:512", "ds_store_2addr_b32 v1, v2, v3 offset0:0 offset1:32",
             "ds_load_b32 v10, v1 offset:512", "ds_load_2addr_b32 v[11:12], v1 offset0:0 offset1:32",
             "ds_load_2addr_stride64_b32 v[13:14], v1 offset0:0 offset1:2"]
    w = run(arch, lines, {1: addr, 2: np.arange(WAVE) + 1000, 3: np.arange(WAVE) + 2000}, exec_mask=0xFFFF)
    act = np.arange(WAVE) < 16
    assert (w.v[10][act] == np.arange(16) + 1000).all() and (w.v[11][act] == np.arange(16) + 1000).all()
    assert (w.v[12][act] == np.arange(16) + 2000).all()
    assert (w.v[13][act] == np.arange(16) + 1000).all() and (w.v[14][act] == np.arange(16) + 1000).all()
    with pytest.raises(InterpreterError, match="LDS access"):
        run(arch, ["ds_load_b32 v10, v1 offset:2000"], {1: addr})


BRANCHES = {"s_cbranch_scc0": lambda w: w.scc == 0, "s_cbranch_scc1": lambda w: w.scc == 1,
            "s_cbranch_execz": lambda w: w.s[decode.EXEC_LO] == 0,
            "s_cbranch_execnz": lambda w: w.s[decode.EXEC_LO] != 0,
            "s_cbranch_vccz": lambda w: w.s[decode.VCC_LO] == 0,
            "s_cbranch_vccnz": lambda w: w.s[decode.VCC_LO] != 0, "s_branch": lambda w: True}


@pytest.mark.parametrize("arch", ARCHS)
def test_branches_taken_and_not(arch):
    """PC = PC + 4 + 4 * simm16 when taken: a branch over one 4-byte instruction skips it, and a
    backward branch of a counted loop runs its body again."""
    for br, cond in BRANCHES.items():
        for scc, ex, vcc in ((0, 0, 0), (1, 1, 5)):
            w = run(arch, ["s_mov_b32 s10, 1", f"{br} 1", "s_mov_b32 s10, 2", "s_nop 0"], exec_mask=ex, scc=scc,
                    sgprs={decode.VCC_LO: vcc})
            probe = machine.new_wave(ISA[arch])
            probe.scc, probe.s[decode.EXEC_LO], probe.s[decode.VCC_LO] = scc, ex, vcc
            assert w.s[10] == (1 if cond(probe) else 2), (br, scc, ex, vcc)
    co = "_co" if arch == "gfx1201" else ""
    w = run(arch, ["s_mov_b32 s10, 0", "s_mov_b32 s11, 5", f"s_add{co}_i32 s10, s10, 3", f"s_sub{co}_i32 s11, s11, 1",
                   "s_cmp_lg_u32 s11, 0", "s_cbranch_scc1 -4"])
    assert (w.s[10], w.s[11]) == (15, 0)


# no effect here: memory completes at issue, so waits, clauses, scheduling hints and cache
# maintenance change nothing; s_code_end is the padding after the last kernel (reaching it is an
# error: test_the_padding_is_never_executed); barriers and s_sendmsg run in the micro-kernels
NO_EFFECT = {"S_WAITCNT", "S_WAIT_KMCNT", "S_WAIT_LOADCNT", "S_WAIT_DSCNT", "S_WAIT_STORECNT", "S_WAIT_EXPCNT",
             "S_NOP", "S_CLAUSE", "S_DELAY_ALU", "S_SET_INST_PREFETCH_DISTANCE", "GLOBAL_INV", "GLOBAL_WB",
             "BUFFER_GL0_INV", "S_CODE_END", "S_BARRIER", "S_BARRIER_SIGNAL", "S_BARRIER_WAIT", "S_SENDMSG",
             "S_ENDPGM"}


def test_every_implemented_instruction_has_a_check_here():
    """An instruction added to the interpreter without a check in this file fails this test."""
    text = Path(__file__).read_text().upper()
    tested = {*VALU, *(f"V_CMP_{k.upper()}" for k in CMPS), *(f"V_CMPX_{k.upper()}" for k in CMPS),
              *(f"V_DUAL_{k.upper()}" for k in DUAL_REF), *(b.upper() for b in BRANCHES),
              *(f"S_CMP_{k.upper()}" for k in SCMP)}
    named = {n for n in semantics.IMPLEMENTED if n in text.replace("_E32", "").replace("_E64", "")}
    missing = set(semantics.IMPLEMENTED) - tested - named - NO_EFFECT
    assert not missing, sorted(missing)


def test_the_padding_is_never_executed():
    with pytest.raises(InterpreterError, match="s_code_end reached"):
        run("gfx1201", ["s_code_end"])


def test_an_unimplemented_instruction_stops_with_its_name_and_address():
    with pytest.raises(InterpreterError, match=r"at 0x4: v_sin_f32.*V_SIN_F32 is not implemented"):
        run("gfx1201", ["v_mov_b32 v1, 0", "v_sin_f32 v2, v1"])


def test_bad_code_objects_and_missing_builds_are_one_line_errors(tmp_path):
    (tmp_path / "x.hsaco").write_text("not an ELF file")
    with pytest.raises(DflashError, match="not a readable ELF file"):
        codeobj.load(tmp_path / "x.hsaco")
    with pytest.raises(DflashError, match="no code object at .*build the kernels first"):
        kernel_run.run("gfx1201", tmp_path)
    r = run_dflash("kernels", "run", "--build-dir", str(tmp_path), check=False)
    assert r.returncode == 1 and "build the kernels first" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- micro-kernels (code objects)

KERNEL_ASM = {
    "gfx1201": {"wait_ds": "s_wait_dscnt 0", "wait_k": "s_wait_kmcnt 0",
                "barrier": "s_barrier_signal -1\n  s_barrier_wait -1"},
    "gfx1151": {"wait_ds": "s_waitcnt lgkmcnt(0)", "wait_k": "s_waitcnt lgkmcnt(0)", "barrier": "s_barrier"},
}


def micro_kernel(arch: str, tmp: Path, name: str, body: str, lds: int) -> Path:
    """A code object of one kernel `name` (kernel arguments: one pointer) from assembly."""
    k = KERNEL_ASM[arch]
    src = f""".amdgcn_target "amdgcn-amd-amdhsa--{arch}"
.text
.globl {name}
.p2align 8
.type {name},@function
{name}:
  s_load_b64 s[2:3], s[0:1], 0x0
  {k['wait_k']}
  {body.format(**k)}
  s_endpgm
.rodata
.p2align 6
.amdhsa_kernel {name}
  .amdhsa_group_segment_fixed_size {lds}
  .amdhsa_user_sgpr_kernarg_segment_ptr 1
  .amdhsa_kernarg_size 8
  .amdhsa_next_free_vgpr 16
  .amdhsa_next_free_sgpr 16
  .amdhsa_float_denorm_mode_32 3
  .amdhsa_float_denorm_mode_16_64 3
  .amdhsa_system_vgpr_workitem_id 1
.end_amdhsa_kernel
.amdgpu_metadata
---
amdhsa.version: [1, 2]
amdhsa.target: amdgcn-amd-amdhsa--{arch}
amdhsa.kernels:
  - .name: {name}
    .symbol: {name}.kd
    .kernarg_segment_size: 8
    .kernarg_segment_align: 8
    .group_segment_fixed_size: {lds}
    .private_segment_fixed_size: 0
    .wavefront_size: 32
    .sgpr_count: 16
    .vgpr_count: 16
    .max_flat_workgroup_size: 128
    .args:
      - {{.offset: 0, .size: 8, .value_kind: global_buffer, .address_space: global}}
...
.end_amdgpu_metadata
"""
    (tmp / f"{name}.s").write_text(src)
    obj, co = tmp / f"{name}.o", tmp / f"{name}_{arch}.hsaco"
    clang = shutil.which("clang-19") or "clang"
    r = subprocess.run([clang, "-x", "assembler", "-target", "amdgcn-amd-amdhsa", f"-mcpu={arch}", "-c",
                        str(tmp / f"{name}.s"), "-o", str(obj)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lld = shutil.which("ld.lld-19") or "ld.lld"
    r = subprocess.run([lld, "-shared", str(obj), "-o", str(co)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return co


# every work-item writes its id to LDS, (the barrier), then reads the id of the work-item 32 ahead in a
# workgroup of 64 (the other wave) and stores it
EXCHANGE = """v_and_b32 v1, 0x3ff, v0
  v_lshlrev_b32 v2, 2, v1
  v_add_nc_u32 v5, 7, v1
  ds_store_b32 v2, v5
  {wait_ds}
  {barrier}
  v_add_nc_u32 v3, 32, v1
  v_and_b32 v3, 63, v3
  v_lshlrev_b32 v3, 2, v3
  ds_load_b32 v4, v3
  {wait_ds}
  global_store_b32 v2, v4, s[2:3]"""


def launch_one(co: Path, name: str, threads: int, order: str = "forward") -> list[int]:
    prog = machine.load_program(codeobj.load(co))
    mem = Memory()
    out = mem.alloc(4 * threads)
    machine.launch(prog, name, (1, 1, 1), (threads, 1, 1), struct.pack("<Q", out), mem, order=order)
    return np.frombuffer(mem.read(out, 4 * threads), "<u4").tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_barrier_orders_the_waves_of_a_workgroup(arch, tmp_path):
    co = micro_kernel(arch, tmp_path, "exchange", EXCHANGE, 256)
    want = [((t + 32) % 64) + 7 for t in range(64)]
    assert launch_one(co, "exchange", 64) == want
    assert launch_one(co, "exchange", 64, order="reverse") == want
    # the twin: without the barrier the first wave reads the second's cells before they are written
    racy = micro_kernel(arch, tmp_path, "racy", EXCHANGE.replace("{barrier}", "s_nop 0"), 256)
    assert launch_one(racy, "racy", 64) != launch_one(racy, "racy", 64, order="reverse")


BRANCH = """v_and_b32 v1, 0x3ff, v0
  v_lshlrev_b32 v2, 2, v1
  v_mov_b32 v4, 100
  v_and_b32 v3, 1, v1
  v_cmp_eq_u32_e32 vcc_lo, 1, v3
  s_and_saveexec_b32 s4, vcc_lo
  s_cbranch_execz 2
  v_add_nc_u32 v4, v1, v4
  v_add_nc_u32 v4, v1, v4
  s_or_b32 exec_lo, exec_lo, s4
  v_mbcnt_lo_u32_b32 v5, -1, 0
  v_lshlrev_b32 v5, 16, v5
  v_or_b32 v4, v4, v5
  global_store_b32 v2, v4, s[2:3]"""


@pytest.mark.parametrize("arch", ARCHS)
def test_an_exec_masked_branch_and_its_skip(arch, tmp_path):
    co = micro_kernel(arch, tmp_path, "branch", BRANCH, 0)
    got = launch_one(co, "branch", 64)
    assert got == [((100 + 2 * t) if t % 2 else 100) | ((t % 32) << 16) for t in range(64)]


PERMUTE = """v_and_b32 v1, 0x3ff, v0
  v_lshlrev_b32 v2, 2, v1
  v_sub_nc_u32 v3, 31, v1
  v_lshlrev_b32 v3, 2, v3
  v_add_nc_u32 v5, 1000, v1
  ds_bpermute_b32 v4, v3, v5
  {wait_ds}
  global_store_b32 v2, v4, s[2:3]"""


@pytest.mark.parametrize("arch", ARCHS)
def test_a_lane_permute_kernel(arch, tmp_path):
    co = micro_kernel(arch, tmp_path, "permute", PERMUTE, 0)
    assert launch_one(co, "permute", 64) == [1000 + 32 * (t // 32) + 31 - t % 32 for t in range(64)]


# ---------------------------------------------------------------- the shipped code objects

@pytest.fixture(scope="module")
def kernels_build(tmp_path_factory) -> Path:
    """The code objects (and their planted-order twins) and dflash_mmvq_host, built as CMake builds them."""
    build = tmp_path_factory.mktemp("hip_kernels")
    for cmd in (["cmake", "-S", str(ROOT / "hip_kernels"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(build), "-j2", "--target", "dflash_mmvq_code_objects", "dflash_mmvq_host"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return build


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_agrees_with_llvms_disassembler(arch, kernels_build):
    """Every instruction of the shipped code object: tinygrad's decoding and LLVM's name the same
    operation at the same address."""
    co = codeobj.load(kernels_build / f"dflash_mmvq_{arch}.hsaco")
    instrs = decode.decode_text(co.text, co.text_addr, co.isa)
    r = subprocess.run([shutil.which("llvm-objdump-19") or "llvm-objdump", "-d", f"--mcpu={arch}",
                        str(co.path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    llvm, second = {}, {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s+(\S+)(.*)//\s*([0-9A-F]+):", line)
        if m:
            llvm[int(m.group(3), 16)] = m.group(1)
            y = re.search(r"::\s*(\S+)", m.group(2))  # a dual-issue word's second operation
            second[int(m.group(3), 16)] = y.group(1) if y else None
    assert set(llvm) == set(instrs)
    def plain(name: str) -> str:  # the encoding suffix is spelled differently by the two
        return re.sub(r"_e(32|64)$", "", name.lower())
    bad = []
    for addr, ins in instrs.items():
        ours = ins.dual[0] if ins.dual else ins.text.split("(")[0]
        if plain(ours) != plain(llvm[addr]) or (ins.dual and plain(ins.dual[1]) != plain(second[addr] or "")):
            bad.append((hex(addr), ins.text, llvm[addr], second[addr]))
    assert not bad[:10], f"{len(bad)} of {len(instrs)}: {bad[:10]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_instruction_of_the_code_objects_is_implemented(arch, kernels_build):
    co = codeobj.load(kernels_build / f"dflash_mmvq_{arch}.hsaco")
    names = set()
    for i in decode.decode_text(co.text, co.text_addr, co.isa).values():
        names |= set(i.dual) if i.dual else {i.name}
    assert names - set(semantics.IMPLEMENTED) == set()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shipped_kernel_is_bit_identical_to_the_host_body_and_to_ncols_one(arch, kernels_build):
    results = kernel_run.run(arch, kernels_build)
    assert len(results) == 35
    bad = [(r.kernel, r.first_diff) for r in results if not r.ok]
    assert not bad, bad
    assert {r.ncols for r in results} == {1, 2, 3, 4, None}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_planted_order_code_object_is_caught(arch, kernels_build):
    """DFLASH_MMVQ_PLANTED_ORDER: ncols > 1 adds the warps last to first. Every such kernel differs
    from the host body and from ncols 1; ncols 1 and the routed-expert kernels do not."""
    results = kernel_run.run(arch, kernels_build, planted=True)
    differ = {r.kernel for r in results if not r.ok}
    assert differ == {f"dflash_mmvq_{t}_nc{k}" for t in kernel_run.ks.TYPES for k in (2, 3, 4)}


def test_dflash_kernels_run_cli(kernels_build):
    d = json.loads(run_dflash("kernels", "run", "--arch", "gfx1201", "--type", "q4_k", "--build-dir",
                              str(kernels_build), "--json").stdout)
    assert d["ok"] and d["emulated_isa"] and len(d["results"]) == 5
    r = run_dflash("kernels", "run", "--arch", "gfx1201", "--type", "q4_0", "--build-dir", str(kernels_build),
                   "--planted", check=False)
    assert r.returncode == 1 and "3 of 5 kernels differ (the planted twin: expected)" in r.stderr
    r = run_dflash("kernels", "run", "--arch", "gfx1100", check=False)
    assert r.returncode == 2 and "gfx1151, gfx1201" in r.stderr and "Traceback" not in r.stderr
