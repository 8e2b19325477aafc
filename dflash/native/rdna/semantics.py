"""What each instruction does, as the RDNA3.5 and RDNA4 ISA documents' pseudocode says (tinygrad's
wheel carries that pseudocode: tests/test_rdna.py checks these functions against it on edge values).
Vector operations run on all 32 lanes at once (numpy) and write only the lanes EXEC enables.

Floating point: f32 arithmetic is IEEE with round to nearest even and subnormals kept (the kernels'
FLOAT_DENORM_MODE_32 = 3, checked at launch). Two documented liberties, neither of which a kernel
of this project can observe in its output: V_RCP_IFLAG_F32 computes the correctly rounded 1/x
(the document's `1.0F / S0.f32`; the hardware's reciprocal is an approximation of about 1 ulp,
which is why the compiler's integer division around it corrects its quotient), and a NaN result
is a NaN of numpy's choice of payload.

Only the instructions the project's code objects use are here; any other stops the run with its
name and address when it is reached (never a silent skip)."""
from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from dflash.native.rdna import decode
from dflash.native.rdna.decode import CONST, SCC, SGPR, VGPR, Instr, Operand
from dflash.native.rdna.state import WAVE, InterpreterError, Step, Wave

M32 = 0xFFFFFFFF
U32, U64 = np.uint32, np.uint64


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _f16_bits(x: float) -> int:
    return int(np.float16(x).view(np.uint16))


def _f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _const(op: Operand, width: int, ftype: str) -> int:
    if op.float_const is not None:
        if width == 64:
            return _f64_bits(op.float_const)
        return _f16_bits(op.float_const) if ftype == "f16" else _f32_bits(op.float_const)
    return op.index & ((1 << width) - 1)


# ---------------------------------------------------------------- scalar side

def sread(w: Wave, op: Operand, width: int = 32) -> int:
    if op.kind == SGPR:
        lo = w.s[op.index]
        return lo | (w.s[op.index + 1] << 32) if width == 64 else lo
    if op.kind == CONST:
        return _const(op, width, "f32")
    if op.kind == SCC:
        return w.scc
    raise InterpreterError(f"a scalar operand {op} of kind {op.kind}")


def swrite(w: Wave, op: Operand, value: int, width: int = 32) -> None:
    if op.kind == CONST:  # NULL
        return
    if op.kind != SGPR:
        raise InterpreterError(f"a scalar destination {op}")
    w.s[op.index] = value & M32
    if width == 64:
        w.s[op.index + 1] = (value >> 32) & M32


def _i32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x & 0x80000000 else x


def _sop2(fn: Callable[[int, int, Wave], tuple[int, int | None]], width: int = 32, w1: int | None = None) -> Step:
    def step(w: Wave, i: Instr) -> None:
        a = sread(w, i.ops["ssrc0"], width)
        b = sread(w, i.ops["ssrc1"], w1 or width)
        d, scc = fn(a, b, w)
        swrite(w, i.ops["sdst"], d, width)
        if scc is not None:
            w.scc = scc
    return step


def _sop1(fn: Callable[[int, Wave], tuple[int, int | None]], width: int = 32) -> Step:
    def step(w: Wave, i: Instr) -> None:
        d, scc = fn(sread(w, i.ops["ssrc0"], width), w)
        swrite(w, i.ops["sdst"], d, width)
        if scc is not None:
            w.scc = scc
    return step


def _sopc(fn: Callable[[int, int], bool]) -> Step:
    def step(w: Wave, i: Instr) -> None:
        w.scc = int(fn(sread(w, i.ops["ssrc0"]), sread(w, i.ops["ssrc1"])))
    return step


def _add_i32(a: int, b: int, w: Wave) -> tuple[int, int]:
    t = (a + b) & M32
    return t, int((a >> 31) == (b >> 31) and (a >> 31) != (t >> 31))


def _sub_i32(a: int, b: int, w: Wave) -> tuple[int, int]:
    t = (a - b) & M32
    return t, int((a >> 31) != (b >> 31) and (a >> 31) != (t >> 31))


def _f32(x: int) -> np.float32:
    return np.array([x], U32).view(np.float32)[0]


def _bits32(x: np.floating) -> int:
    return int(np.array([x], np.float32).view(U32)[0])


def _cvt_u32_f32(a: int, w: Wave) -> tuple[int, None]:
    f = float(_f32(a))
    if f != f or f <= 0:
        return 0, None
    return (M32 if f >= 4294967296.0 else int(f)), None


def _mul_f32(a: int, b: int, w: Wave) -> tuple[int, None]:
    with np.errstate(all="ignore"):
        return _bits32(np.float32(_f32(a)) * np.float32(_f32(b))), None


SALU: dict[str, Step] = {
    "S_MOV_B32": _sop1(lambda a, w: (a, None)),
    "S_ABS_I32": _sop1(lambda a, w: ((abs(_i32(a)) & M32), int(abs(_i32(a)) & M32 != 0))),
    "S_CVT_F32_U32": _sop1(lambda a, w: (_bits32(np.float32(a)), None)),
    "S_CVT_U32_F32": _sop1(_cvt_u32_f32),
    "S_AND_B32": _sop2(lambda a, b, w: (a & b, int(a & b != 0))),
    "S_OR_B32": _sop2(lambda a, b, w: (a | b, int(a | b != 0))),
    "S_XOR_B32": _sop2(lambda a, b, w: (a ^ b, int(a ^ b != 0))),
    "S_AND_NOT1_B32": _sop2(lambda a, b, w: (a & ~b & M32, int(a & ~b & M32 != 0))),
    "S_LSHL_B32": _sop2(lambda a, b, w: ((a << (b & 31)) & M32, int((a << (b & 31)) & M32 != 0))),
    "S_LSHR_B32": _sop2(lambda a, b, w: (a >> (b & 31), int(a >> (b & 31) != 0))),
    "S_ASHR_I32": _sop2(lambda a, b, w: ((_i32(a) >> (b & 31)) & M32, int((_i32(a) >> (b & 31)) & M32 != 0))),
    "S_LSHL_B64": _sop2(lambda a, b, w: ((a << (b & 63)) & (2**64 - 1), int((a << (b & 63)) & (2**64 - 1) != 0)),
                        64, 32),
    "S_ADD_U32": _sop2(lambda a, b, w: ((a + b) & M32, int(a + b > M32))),
    "S_ADDC_U32": _sop2(lambda a, b, w: ((a + b + w.scc) & M32, int(a + b + w.scc > M32))),
    "S_ADD_I32": _sop2(_add_i32),
    "S_ADD_CO_I32": _sop2(_add_i32),
    "S_SUB_I32": _sop2(_sub_i32),
    "S_SUB_CO_I32": _sop2(_sub_i32),
    "S_ADD_NC_U64": _sop2(lambda a, b, w: ((a + b) & (2**64 - 1), None), 64),
    "S_MUL_U64": _sop2(lambda a, b, w: ((a * b) & (2**64 - 1), None), 64),
    "S_MUL_I32": _sop2(lambda a, b, w: ((_i32(a) * _i32(b)) & M32, None)),
    "S_MUL_HI_U32": _sop2(lambda a, b, w: ((a * b) >> 32, None)),
    "S_MUL_F32": _sop2(_mul_f32),
    "S_CSELECT_B32": _sop2(lambda a, b, w: (a if w.scc else b, None)),
    "S_CMP_GE_I32": _sopc(lambda a, b: _i32(a) >= _i32(b)),
    "S_CMP_GE_U32": _sopc(lambda a, b: a >= b),
    "S_CMP_EQ_U32": _sopc(lambda a, b: a == b),
    "S_CMP_LG_U32": _sopc(lambda a, b: a != b),
    "S_CMP_LT_I32": _sopc(lambda a, b: _i32(a) < _i32(b)),
    "S_CMP_GT_I32": _sopc(lambda a, b: _i32(a) > _i32(b)),
}


def _saveexec(fn: Callable[[int, int], int]) -> Step:
    def step(w: Wave, i: Instr) -> None:
        old = w.exec
        new = fn(sread(w, i.ops["ssrc0"]), old) & M32
        swrite(w, i.ops["sdst"], old)
        w.s[decode.EXEC_LO] = new
        w.scc = int(new != 0)
    return step


SALU["S_AND_SAVEEXEC_B32"] = _saveexec(lambda s0, ex: s0 & ex)
SALU["S_AND_NOT1_SAVEEXEC_B32"] = _saveexec(lambda s0, ex: s0 & ~ex)


def _s_mulk(w: Wave, i: Instr) -> None:
    imm = i.mods["simm16"]
    imm = imm - 0x10000 if imm & 0x8000 else imm
    d = i.ops["sdst"]
    swrite(w, d, (_i32(sread(w, d)) * imm) & M32)


SALU["S_MULK_I32"] = _s_mulk


# ---------------------------------------------------------------- program flow and no-ops

def _simm16(i: Instr) -> int:
    x = i.mods["simm16"]
    return x - 0x10000 if x & 0x8000 else x


def _branch_if(cond: Callable[[Wave], bool]) -> Step:
    def step(w: Wave, i: Instr) -> int | None:
        return i.addr + 4 + 4 * _simm16(i) if cond(w) else None
    return step


def _nop(w: Wave, i: Instr) -> None:
    return None


def _endpgm(w: Wave, i: Instr) -> None:
    w.done = True


def _barrier(w: Wave, i: Instr) -> None:
    w.at_barrier = True


def _barrier_signal(w: Wave, i: Instr) -> None:
    which = _i32(sread(w, i.ops["ssrc0"]))
    if which != -1:
        raise InterpreterError(f"s_barrier_signal {which}: only the workgroup barrier (-1) is implemented")


def _code_end(w: Wave, i: Instr) -> None:
    raise InterpreterError("s_code_end reached: the program ran past its last instruction")


def _sendmsg(w: Wave, i: Instr) -> None:
    if i.mods["simm16"] != 3:  # MSG_DEALLOC_VGPRS: nothing to release here
        raise InterpreterError(f"s_sendmsg {i.mods['simm16']} is not implemented")


FLOW: dict[str, Step] = {
    "S_BRANCH": _branch_if(lambda w: True),
    "S_CBRANCH_SCC0": _branch_if(lambda w: w.scc == 0),
    "S_CBRANCH_SCC1": _branch_if(lambda w: w.scc == 1),
    "S_CBRANCH_EXECZ": _branch_if(lambda w: w.exec == 0),
    "S_CBRANCH_EXECNZ": _branch_if(lambda w: w.exec != 0),
    "S_CBRANCH_VCCZ": _branch_if(lambda w: w.s[decode.VCC_LO] == 0),
    "S_CBRANCH_VCCNZ": _branch_if(lambda w: w.s[decode.VCC_LO] != 0),
    "S_ENDPGM": _endpgm,
    "S_BARRIER": _barrier,            # gfx11
    "S_BARRIER_SIGNAL": _barrier_signal,  # gfx12: signal, then wait
    "S_BARRIER_WAIT": _barrier,
    "S_SENDMSG": _sendmsg,
    "S_CODE_END": _code_end,  # the padding after the last kernel
}
# waits, scheduling hints and cache maintenance: memory completes at issue here
for _n in ("S_WAITCNT", "S_WAIT_KMCNT", "S_WAIT_LOADCNT", "S_WAIT_DSCNT", "S_WAIT_STORECNT", "S_WAIT_EXPCNT",
           "S_NOP", "S_CLAUSE", "S_DELAY_ALU", "S_SET_INST_PREFETCH_DISTANCE", "GLOBAL_INV", "GLOBAL_WB",
           "BUFFER_GL0_INV"):
    FLOW[_n] = _nop


# ---------------------------------------------------------------- vector side

def vread(w: Wave, op: Operand, width: int = 32, ftype: str = "u") -> np.ndarray:
    """A source as 32 lanes (uint32, or uint64 for width 64), or a scalar that broadcasts."""
    if op.kind == VGPR:
        lo = w.v[op.index]
        return lo.astype(U64) | (w.v[op.index + 1].astype(U64) << U64(32)) if width == 64 else lo
    if op.kind == SGPR:
        return np.asarray(sread(w, op, 64), U64) if width == 64 else np.asarray(w.s[op.index], U32)
    if op.kind == CONST:
        return np.asarray(_const(op, 64, ftype), U64) if width == 64 else np.asarray(_const(op, 32, ftype) & M32, U32)
    if op.kind == SCC:
        return np.asarray(w.scc, U32)
    raise InterpreterError(f"a vector operand {op}")


def vwrite(w: Wave, op: Operand, value: np.ndarray, mask: np.ndarray, width: int = 32) -> None:
    if op.kind != VGPR:
        raise InterpreterError(f"a vector destination {op}")
    value = np.broadcast_to(value, (WAVE,))
    if width == 64:
        value = value.astype(U64)
        w.v[op.index] = np.where(mask, (value & U64(M32)).astype(U32), w.v[op.index])
        w.v[op.index + 1] = np.where(mask, (value >> U64(32)).astype(U32), w.v[op.index + 1])
    else:
        w.v[op.index] = np.where(mask, value.astype(U32), w.v[op.index])


def lanes_to_bits(flags: np.ndarray, mask: np.ndarray) -> int:
    """A lane mask (SGPR value) from per-lane flags; lanes EXEC disables read 0."""
    f = np.broadcast_to(flags, (WAVE,)) & mask
    return int(np.packbits(f[::-1].astype(np.uint8)).view(">u4")[0])


def bits_to_lanes(bits: int) -> np.ndarray:
    return ((U32(bits) >> np.arange(WAVE, dtype=U32)) & 1).astype(bool)


def _float_mods(x: np.ndarray, k: int, i: Instr) -> np.ndarray:
    x = np.asarray(x, U32)
    if i.mods.get("abs", 0) >> k & 1:
        x = x & U32(0x7FFFFFFF)
    if i.mods.get("neg", 0) >> k & 1:
        x = x ^ U32(0x80000000)
    return x


def _as_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, U32).view(np.float32)


def _f32_out(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(U32)


def _no_mods(i: Instr, allowed: tuple[str, ...] = ()) -> None:
    for m in ("neg", "abs", "clmp", "omod", "opsel", "neg_hi"):
        if m not in allowed and i.mods.get(m, 0):
            raise InterpreterError(f"modifier {m}={i.mods[m]} is not implemented for {i.name}")


# each: (sources, their types ("u" integer, "f32", "f16"), the operation on numpy arrays)
def _bfe_i32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    off, width = b & U32(31), c & U32(31)
    t = (a.astype(np.int64) if hasattr(a, "astype") else np.int64(a)) & 0xFFFFFFFF
    t = (t >> off.astype(np.int64)) & ((np.int64(1) << width.astype(np.int64)) - 1)
    sign = np.int64(1) << np.maximum(width.astype(np.int64) - 1, 0)
    ext = np.where(width == 0, 0, (t ^ sign) - sign)
    return (ext & 0xFFFFFFFF).astype(U32)


def _perm(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    data = (np.broadcast_to(np.asarray(a, U64), (WAVE,)) << U64(32)) | np.broadcast_to(np.asarray(b, U64), (WAVE,))
    sel = np.broadcast_to(np.asarray(c, U32), (WAVE,))
    byte = lambda k: ((data >> U64(8 * k)) & U64(0xFF)).astype(U32)  # noqa: E731
    out = np.zeros(WAVE, U32)
    for k in range(4):
        s = (sel >> U32(8 * k)) & U32(0xFF)
        r = np.zeros(WAVE, U32)
        for j in range(8):
            r = np.where(s == j, byte(j), r)
        for code, src_byte in ((8, 1), (9, 3), (10, 5), (11, 7)):
            r = np.where(s == code, (byte(src_byte) >> U32(7)) * U32(0xFF), r)
        r = np.where(s == 12, U32(0), r)
        r = np.where(s >= 13, U32(0xFF), r)
        out |= r << U32(8 * k)
    return out


def _mbcnt_lo(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    below = (U64(1) << np.arange(WAVE, dtype=U64)) - U64(1)
    masked = np.asarray(a, U64) & below
    count = np.array([bin(int(x)).count("1") for x in np.broadcast_to(masked, (WAVE,))], U32)
    return (count + np.asarray(b, U32)).astype(U32)


def _u24(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, U64) & U64(0xFFFFFF)


VOP: dict[str, tuple[int, str, Callable[..., np.ndarray]]] = {
    "V_MOV_B32": (1, "u", lambda a: a),
    "V_AND_B32": (2, "u", lambda a, b: a & b),
    "V_OR_B32": (2, "u", lambda a, b: a | b),
    "V_XOR_B32": (2, "u", lambda a, b: a ^ b),
    "V_ADD_NC_U32": (2, "u", lambda a, b: a + b),
    "V_SUB_NC_U32": (2, "u", lambda a, b: a - b),
    "V_LSHLREV_B32": (2, "u", lambda a, b: b << (a & U32(31))),
    "V_LSHRREV_B32": (2, "u", lambda a, b: b >> (a & U32(31))),
    "V_MUL_U32_U24": (2, "u", lambda a, b: ((_u24(a) * _u24(b)) & U64(M32)).astype(U32)),
    "V_MUL_HI_U32_U24": (2, "u", lambda a, b: ((_u24(a) * _u24(b)) >> U64(32)).astype(U32)),
    "V_MUL_LO_U32": (2, "u", lambda a, b: ((np.asarray(a, U64) * np.asarray(b, U64)) & U64(M32)).astype(U32)),
    "V_ADD3_U32": (3, "u", lambda a, b, c: a + b + c),
    "V_OR3_B32": (3, "u", lambda a, b, c: a | b | c),
    "V_AND_OR_B32": (3, "u", lambda a, b, c: (a & b) | c),
    "V_LSHL_OR_B32": (3, "u", lambda a, b, c: (a << (b & U32(31))) | c),
    "V_LSHL_ADD_U32": (3, "u", lambda a, b, c: (a << (b & U32(31))) + c),
    "V_BFE_U32": (3, "u", lambda a, b, c: (a >> (b & U32(31))) &
                  ((np.left_shift(U64(1), np.asarray(c & U32(31), U64)) - U64(1)).astype(U32))),
    "V_BFE_I32": (3, "u", _bfe_i32),
    "V_PERM_B32": (3, "u", _perm),
    "V_MBCNT_LO_U32_B32": (2, "u", _mbcnt_lo),
    "V_CVT_F32_I32": (1, "u", lambda a: _f32_out(np.asarray(a, U32).view(np.int32).astype(np.float32))),
    "V_CVT_F32_F16": (1, "f16", lambda a: _f32_out((np.asarray(a, U32) & U32(0xFFFF)).astype(np.uint16)
                                                   .view(np.float16).astype(np.float32))),
    "V_RCP_IFLAG_F32": (1, "f32", lambda a: _f32_out(np.float32(1.0) / _as_f32(a))),
    "V_ADD_F32": (2, "f32", lambda a, b: _f32_out(_as_f32(a) + _as_f32(b))),
    "V_SUB_F32": (2, "f32", lambda a, b: _f32_out(_as_f32(a) - _as_f32(b))),
    "V_MUL_F32": (2, "f32", lambda a, b: _f32_out(_as_f32(a) * _as_f32(b))),
}


def _vop_step(name: str, i: Instr) -> Step:
    nsrc, ty, fn = VOP[name]
    names = ["src0", "src1", "src2"][:nsrc]
    _no_mods(i, ("neg", "abs") if ty == "f32" else ())

    def step(w: Wave, ins: Instr) -> None:
        srcs = []
        for k, n in enumerate(names):
            x = vread(w, ins.ops[n], 32, ty)
            srcs.append(_float_mods(x, k, ins) if ty == "f32" else np.broadcast_to(np.asarray(x, U32), (WAVE,)))
        with np.errstate(all="ignore"):
            r = fn(*srcs)
        vwrite(w, ins.ops["vdst"], np.asarray(r).astype(U32), w.mask())
    return step


def _dot4_iu8(w: Wave, i: Instr) -> None:
    """V_DOT4_I32_IU8: NEG[0] and NEG[1] say whether S0's and S1's bytes are signed; S2 is added
    first, then the four products in order; clamp saturates to int32."""
    neg = i.mods.get("neg", 0)
    a, b, c32 = (np.ascontiguousarray(np.broadcast_to(np.asarray(vread(w, i.ops[n]), U32), (WAVE,)))
                 for n in ("src0", "src1", "src2"))
    c = c32.view(np.int32).astype(np.int64)
    ab = a.view(np.uint8).reshape(WAVE, 4)
    bb = b.view(np.uint8).reshape(WAVE, 4)
    av = ab.view(np.int8).astype(np.int64) if neg & 1 else ab.astype(np.int64)
    bv = bb.view(np.int8).astype(np.int64) if neg & 2 else bb.astype(np.int64)
    t = c + (av * bv).sum(axis=1)
    if i.mods.get("clmp", 0):
        t = np.clip(t, -(2**31), 2**31 - 1)
    vwrite(w, i.ops["vdst"], (t & M32).astype(U32), w.mask())


def _readfirstlane(w: Wave, i: Instr) -> None:
    ex = w.exec
    lane = (ex & -ex).bit_length() - 1 if ex else 0
    src = i.ops["src0"]
    val = int(w.v[src.index][lane]) if src.kind == VGPR else int(np.asarray(vread(w, src)))
    swrite(w, i.ops["vdst"], val)


def _lshrrev_b16(w: Wave, i: Instr) -> None:
    _no_mods(i)
    a = np.asarray(vread(w, i.ops["src0"]), U32)
    b = np.asarray(vread(w, i.ops["src1"]), U32)
    d = i.ops["vdst"]
    low = ((b & U32(0xFFFF)) >> (a & U32(15))) & U32(0xFFFF)
    vwrite(w, d, (w.v[d.index] & U32(0xFFFF0000)) | low, w.mask())  # D0.u16: the high half stays


def _lshrrev_b64(w: Wave, i: Instr) -> None:
    _no_mods(i)
    a = np.asarray(vread(w, i.ops["src0"]), U32)
    b = np.asarray(vread(w, i.ops["src1"], 64), U64)
    vwrite(w, i.ops["vdst"], b >> (a & U32(63)).astype(U64), w.mask(), 64)


# compares: (type, predicate)
CMP: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "EQ_U32": lambda a, b: a == b, "NE_U32": lambda a, b: a != b, "GT_U32": lambda a, b: a > b,
    "LT_U32": lambda a, b: a < b, "GE_U32": lambda a, b: a >= b, "LE_U32": lambda a, b: a <= b,
    "EQ_I32": lambda a, b: a.view(np.int32) == b.view(np.int32),
    "GT_I32": lambda a, b: a.view(np.int32) > b.view(np.int32),
    "LT_I32": lambda a, b: a.view(np.int32) < b.view(np.int32),
    "LE_I32": lambda a, b: a.view(np.int32) <= b.view(np.int32),
    "GE_I32": lambda a, b: a.view(np.int32) >= b.view(np.int32),
    "NE_I32": lambda a, b: a.view(np.int32) != b.view(np.int32),
}


def _half(x: np.ndarray, hi: int) -> np.ndarray:
    return ((x >> U32(16)) if hi else x) & U32(0xFFFF)


def _cmp_step(name: str, i: Instr) -> Step:
    x = name.startswith("V_CMPX_")
    key = name[len("V_CMPX_"):] if x else name[len("V_CMP_"):]
    sixteen = key.endswith("_I16") or key.endswith("_U16")
    if sixteen:
        signed = key.endswith("_I16")
        pred = CMP[key[:-4] + ("_I32" if signed else "_U32")]
        _no_mods(i, ("opsel",))
    else:
        if key not in CMP:
            return _missing(name)
        pred = CMP[key]
        _no_mods(i)

    def step(w: Wave, ins: Instr) -> None:
        a = np.broadcast_to(np.asarray(vread(w, ins.ops["src0"]), U32), (WAVE,)).copy()
        b = np.broadcast_to(np.asarray(vread(w, ins.ops["src1"]), U32), (WAVE,)).copy()
        if sixteen:
            sel = ins.mods.get("opsel", 0)
            a, b = _half(a, sel & 1), _half(b, sel >> 1 & 1)
            if signed:  # sign-extend the halves so the i32 predicate compares them as int16
                a, b = (((x ^ U32(0x8000)).astype(np.int64) - 0x8000).astype(np.int32).view(U32) for x in (a, b))
        bits = lanes_to_bits(pred(a, b), w.mask())
        if x:
            w.s[decode.EXEC_LO] = bits
        else:
            _write_lane_mask(w, ins, "vdst", bits)
    return step


def _lane_select(w: Wave, i: Instr) -> int:
    """The lane mask an instruction takes as its third source: VCC in the 32-bit encoding (VOP2),
    src2 in the 64-bit one."""
    return w.s[decode.VCC_LO] if i.fmt == "VOP2" else sread(w, i.ops["src2"])


def _write_lane_mask(w: Wave, i: Instr, dst: str, bits: int) -> None:
    """A lane mask an instruction writes: to VCC in the 32-bit encodings (VOP2, VOPC), to the
    SGPR operand `dst` in the 64-bit one."""
    if i.fmt in ("VOP2", "VOPC"):
        w.s[decode.VCC_LO] = bits
    else:
        swrite(w, i.ops[dst], bits)


def _cndmask(w: Wave, i: Instr) -> None:
    _no_mods(i)
    a, b = vread(w, i.ops["src0"]), vread(w, i.ops["src1"])
    vwrite(w, i.ops["vdst"], np.where(bits_to_lanes(_lane_select(w, i)), b, a), w.mask())


def _add_co(carry_in: bool) -> Step:
    def step(w: Wave, i: Instr) -> None:
        _no_mods(i)
        a = np.asarray(vread(w, i.ops["src0"]), U64)
        b = np.asarray(vread(w, i.ops["src1"]), U64)
        t = a + b
        if carry_in:
            t = t + bits_to_lanes(_lane_select(w, i)).astype(U64)
        mask = w.mask()
        vwrite(w, i.ops["vdst"], (t & U64(M32)).astype(U32), mask)
        _write_lane_mask(w, i, "sdst", lanes_to_bits(np.broadcast_to(t > U64(M32), (WAVE,)), mask))
    return step


def _mad_u64_u32(w: Wave, i: Instr) -> None:
    _no_mods(i)
    a = np.broadcast_to(np.asarray(vread(w, i.ops["src0"]), U32), (WAVE,))
    b = np.broadcast_to(np.asarray(vread(w, i.ops["src1"]), U32), (WAVE,))
    c = np.broadcast_to(np.asarray(vread(w, i.ops["src2"], 64), U64), (WAVE,))
    full = [int(x) * int(y) + int(z) for x, y, z in zip(a, b, c, strict=True)]  # 65 bits
    mask = w.mask()
    vwrite(w, i.ops["vdst"], np.array([f & (2**64 - 1) for f in full], U64), mask, 64)
    swrite(w, i.ops["sdst"], lanes_to_bits(np.array([f >> 64 for f in full], bool), mask))


# ---------------------------------------------------------------- VOPD: two operations, sources read first

DUAL: dict[str, Callable[[np.ndarray, np.ndarray, Wave], np.ndarray]] = {
    "V_DUAL_MOV_B32": lambda a, b, w: a,
    "V_DUAL_ADD_NC_U32": lambda a, b, w: a + b,
    "V_DUAL_AND_B32": lambda a, b, w: a & b,
    "V_DUAL_LSHLREV_B32": lambda a, b, w: b << (a & U32(31)),
    "V_DUAL_ADD_F32": lambda a, b, w: _f32_out(_as_f32(a) + _as_f32(b)),
    "V_DUAL_SUB_F32": lambda a, b, w: _f32_out(_as_f32(a) - _as_f32(b)),
    "V_DUAL_MUL_F32": lambda a, b, w: _f32_out(_as_f32(a) * _as_f32(b)),
    "V_DUAL_CNDMASK_B32": lambda a, b, w: np.where(bits_to_lanes(w.s[decode.VCC_LO]), b, a),
}


def _vopd_step(i: Instr) -> Step:
    assert i.dual is not None
    x, y = i.dual
    for n in (x, y):
        if n not in DUAL:
            return _missing(n)
    fx, fy = DUAL[x], DUAL[y]

    def step(w: Wave, ins: Instr) -> None:
        o = ins.ops
        # copies: vread hands out the register file's rows, and X writes before Y is stored
        ax, bx, ay, by = (np.array(np.broadcast_to(np.asarray(vread(w, o[k]), U32), (WAVE,)))
                          for k in ("x0", "x1", "y0", "y1"))
        with np.errstate(all="ignore"):
            rx, ry = fx(ax, bx, w), fy(ay, by, w)
        mask = w.mask()
        vwrite(w, o["dx"], np.asarray(rx).astype(U32), mask)
        vwrite(w, o["dy"], np.asarray(ry).astype(U32), mask)
    return step


# ---------------------------------------------------------------- memory

def _smem_load(ndw: int) -> Step:
    def step(w: Wave, i: Instr) -> None:
        base = sread(w, i.ops["sbase"], 64)
        off = i.mods.get("ioffset", i.mods.get("offset", 0))
        bits = 24 if "ioffset" in i.mods else 21
        off = off - (1 << bits) if off >> (bits - 1) & 1 else off
        so = i.ops.get("soffset")
        addr = base + off + (sread(w, so) if so is not None and so.kind == SGPR else 0)
        data = np.frombuffer(w.mem.read(addr & ~3, 4 * ndw), U32)
        d = i.ops["sdata"]
        for k in range(ndw):
            w.s[d.index + k] = int(data[k])
    return step


def _global_addr(w: Wave, i: Instr) -> np.ndarray:
    vaddr = i.ops["vaddr" if "vaddr" in i.ops else "addr"]
    saddr = i.ops["saddr"]
    off = i.mods.get("ioffset", i.mods.get("offset", 0))
    bits = 24 if "ioffset" in i.mods else 13
    off = off - (1 << bits) if off >> (bits - 1) & 1 else off
    if saddr.kind == CONST or (saddr.kind == SGPR and saddr.index == decode.M0):
        base = np.asarray(vread(w, Operand(VGPR, vaddr.index, 2), 64), U64)
    else:
        base = U64(sread(w, Operand(SGPR, saddr.index, 2), 64)) + w.v[vaddr.index].astype(U64)
    return (base.astype(np.int64) + off).astype(U64)


def _global_load(width: int, signed: bool = False) -> Step:
    def step(w: Wave, i: Instr) -> None:
        mask = w.mask()
        if not mask.any():
            return
        addrs = _global_addr(w, i)[mask]
        raw = w.mem.load(addrs, width)
        d = i.ops["vdst"]
        if width >= 4:
            words = raw.reshape(-1, width).copy().view(U32).reshape(-1, width // 4)
            for k in range(width // 4):
                w.v[d.index + k][mask] = words[:, k]
        else:
            val = raw.astype(np.int64)
            v = val[:, 0] | (val[:, 1] << 8) if width == 2 else val[:, 0]
            if signed:
                v = v - ((v >> (8 * width - 1)) << (8 * width))
            w.v[d.index][mask] = (v & M32).astype(U32)
    return step


def _global_store(width: int) -> Step:
    def step(w: Wave, i: Instr) -> None:
        mask = w.mask()
        if not mask.any():
            return
        data = i.ops["vsrc" if "vsrc" in i.ops else "data"]
        vals = np.stack([w.v[data.index + k][mask] for k in range(width // 4)], axis=1).copy()
        w.mem.store(_global_addr(w, i)[mask], vals.view(np.uint8).reshape(-1, width))
    return step


def _lds_check(w: Wave, addr: np.ndarray, width: int) -> np.ndarray:
    a = np.asarray(addr, np.int64)
    if (a < 0).any() or (a + width > len(w.lds)).any():
        bad = int(a[(a < 0) | (a + width > len(w.lds))][0])
        raise InterpreterError(f"LDS access of {width} bytes at {bad} beyond the {len(w.lds)} bytes of the workgroup")
    if (a % 4).any():
        raise InterpreterError("an unaligned LDS access")
    return a


def _lds_read(w: Wave, addr: np.ndarray) -> np.ndarray:
    a = _lds_check(w, addr, 4)
    return w.lds.view(U32)[a // 4]


def _lds_write(w: Wave, addr: np.ndarray, vals: np.ndarray) -> None:
    a = _lds_check(w, addr, 4)
    w.lds.view(U32)[a // 4] = vals


def _ds_step(name: str, i: Instr) -> Step:
    o0, o1 = i.mods.get("offset0", 0), i.mods.get("offset1", 0)

    def addr(w: Wave, ins: Instr, mask: np.ndarray) -> np.ndarray:
        return w.v[ins.ops["addr"].index][mask].astype(np.int64)

    if name == "DS_LOAD_B32":
        def step(w: Wave, ins: Instr) -> None:
            m = w.mask()
            w.v[ins.ops["vdst"].index][m] = _lds_read(w, addr(w, ins, m) + (o0 | o1 << 8))
    elif name == "DS_STORE_B32":
        def step(w: Wave, ins: Instr) -> None:
            m = w.mask()
            _lds_write(w, addr(w, ins, m) + (o0 | o1 << 8), w.v[ins.ops["data0"].index][m])
    elif name in ("DS_LOAD_2ADDR_B32", "DS_LOAD_2ADDR_STRIDE64_B32"):
        scale = 256 if "STRIDE64" in name else 4
        def step(w: Wave, ins: Instr) -> None:
            m = w.mask()
            a = addr(w, ins, m)
            d = ins.ops["vdst"].index
            first, second = _lds_read(w, a + o0 * scale), _lds_read(w, a + o1 * scale)
            w.v[d][m], w.v[d + 1][m] = first, second
    elif name == "DS_STORE_2ADDR_B32":
        def step(w: Wave, ins: Instr) -> None:
            m = w.mask()
            a = addr(w, ins, m)
            _lds_write(w, a + o0 * 4, w.v[ins.ops["data0"].index][m])
            _lds_write(w, a + o1 * 4, w.v[ins.ops["data1"].index][m])
    elif name == "DS_BPERMUTE_B32":
        def step(w: Wave, ins: Instr) -> None:
            m = w.mask()
            off = o0 | o1 << 8
            src_lane = ((w.v[ins.ops["addr"].index].astype(np.int64) + off) // 4) % WAVE
            data = w.v[ins.ops["data0"].index]
            tmp = np.where(m[src_lane], data[src_lane], U32(0))
            d = ins.ops["vdst"].index
            w.v[d] = np.where(m, tmp, w.v[d])
    else:
        return _missing(name)
    return step


MEMORY: dict[str, Step] = {
    "S_LOAD_B32": _smem_load(1), "S_LOAD_B64": _smem_load(2), "S_LOAD_B128": _smem_load(4),
    "S_LOAD_B256": _smem_load(8),
    "GLOBAL_LOAD_B32": _global_load(4), "GLOBAL_LOAD_B64": _global_load(8), "GLOBAL_LOAD_B128": _global_load(16),
    "GLOBAL_LOAD_U8": _global_load(1), "GLOBAL_LOAD_I8": _global_load(1, True), "GLOBAL_LOAD_U16": _global_load(2),
    "GLOBAL_STORE_B32": _global_store(4),
}


# ---------------------------------------------------------------- the table

def _missing(name: str) -> Step:
    def step(w: Wave, i: Instr) -> None:
        raise InterpreterError(f"instruction {name} is not implemented")
    return step


SPECIAL: dict[str, Step] = {
    "V_DOT4_I32_IU8": _dot4_iu8,
    "V_READFIRSTLANE_B32": _readfirstlane,
    "V_LSHRREV_B16": _lshrrev_b16,
    "V_LSHRREV_B64": _lshrrev_b64,
    "V_CNDMASK_B32": _cndmask,
    "V_ADD_CO_U32": _add_co(False),
    "V_ADD_CO_CI_U32": _add_co(True),
    "V_MAD_U64_U32": _mad_u64_u32,
    "V_MAD_CO_U64_U32": _mad_u64_u32,
}


def step_for(i: Instr, isa: str) -> Step:
    """The function that executes `i` (one that stops the run for an instruction not implemented)."""
    n = i.name
    if i.fmt == "VOPD":
        return _vopd_step(i)
    for table in (FLOW, SALU, MEMORY, SPECIAL):
        if n in table:
            return table[n]
    if n in VOP:
        return _vop_step(n, i)
    if n.startswith(("V_CMP_", "V_CMPX_")):
        return _cmp_step(n, i)
    if n.startswith("DS_"):
        return _ds_step(n, i)
    return _missing(n)


_CMP_KEYS = {*CMP, *(k[:-3] + ("I16" if k.endswith("I32") else "U16") for k in CMP)}
IMPLEMENTED = sorted({*FLOW, *SALU, *MEMORY, *SPECIAL, *VOP, *DUAL, "DS_LOAD_B32", "DS_STORE_B32",
                      "DS_LOAD_2ADDR_B32", "DS_LOAD_2ADDR_STRIDE64_B32", "DS_STORE_2ADDR_B32", "DS_BPERMUTE_B32",
                      *(p + k for p in ("V_CMP_", "V_CMPX_") for k in _CMP_KEYS)})
