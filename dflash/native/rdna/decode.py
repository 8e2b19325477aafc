"""A code object's text as prepared instructions: tinygrad's tables decode each word (format, opcode,
fields); this module turns the fields into operands the interpreter reads without looking at bits
again. Decoding is checked against LLVM's disassembler in tests/test_rdna.py."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from dflash.core.errors import DflashError

# operand kinds
SGPR, VGPR, CONST, SCC, NONE = "s", "v", "c", "scc", "-"
# source encodings that are not registers (the ISA documents' SSRC/SRC tables)
NULL, M0, EXEC_LO, EXEC_HI, VCC_LO, VCC_HI = 124, 125, 126, 127, 106, 107
SRC_SCC, LITERAL, VCCZ, EXECZ = 253, 255, 251, 252
FLOAT_CONSTS = {240: 0.5, 241: -0.5, 242: 1.0, 243: -1.0, 244: 2.0, 245: -2.0, 246: 4.0, 247: -4.0,
                248: 0.15915494309189532}
# gfx11's buffer_gl0_inv (MUBUF) is not in tinygrad's RDNA3 tables: a cache invalidate, nothing to do here
_MUBUF_GL0_INV = 0xE0AC0000


@dataclass(frozen=True)
class Operand:
    kind: str        # s, v, c, scc, -
    index: int = 0   # register number, or the constant's bits
    size: int = 1    # registers (1 or 2; SMEM and loads up to 8)
    float_const: float | None = None  # an inline float constant (its bits depend on the operand's type)

    def __repr__(self) -> str:
        if self.kind == CONST:
            return f"{self.float_const}" if self.float_const is not None else f"{self.index:#x}"
        return f"{self.kind}{self.index}" + (f":{self.index + self.size - 1}" if self.size > 1 else "")


@dataclass
class Instr:
    addr: int
    size: int
    name: str          # the opcode's name without _E32/_E64
    fmt: str           # the encoding: VOP1, VOP2, VOP3, VOP3SD, VOP3P, VOPC, VOPD, SOP1, SOPP, SMEM, DS, ...
    ops: dict[str, Operand] = field(default_factory=dict)
    mods: dict[str, int] = field(default_factory=dict)   # neg, abs, opsel, clmp, omod, offsets, simm16
    dual: tuple[str, str] | None = None                  # VOPD: the X and Y opcode names
    text: str = ""                                       # tinygrad's rendering, for messages

    def __repr__(self) -> str:
        return f"{self.addr:#x}: {self.text}"


def _operand(reg: Any, size: int = 1, literal: int | None = None) -> Operand:
    o = reg.offset
    if o < 106 or 108 <= o <= 123 or o in (VCC_LO, VCC_HI, EXEC_LO, EXEC_HI, M0):
        return Operand(SGPR, o, size)
    if o == NULL:
        return Operand(CONST, 0, size)
    if 256 <= o < 512:
        return Operand(VGPR, o - 256, size)
    if 128 <= o <= 192:
        return Operand(CONST, o - 128, size)
    if 193 <= o <= 208:
        return Operand(CONST, (-(o - 192)) & 0xFFFFFFFFFFFFFFFF, size)
    if o in FLOAT_CONSTS:
        return Operand(CONST, 0, size, float_const=FLOAT_CONSTS[o])
    if o == LITERAL:
        if literal is None:
            raise DflashError("a literal operand without a literal")
        return Operand(CONST, literal, size)
    if o == SRC_SCC:
        return Operand(SCC, 0, 1)
    raise DflashError(f"operand encoding {o} is not implemented")


def _name(op: Any) -> str:
    n = op.name
    for suffix in ("_E32", "_E64"):
        if n.endswith(suffix):
            return n[: -len(suffix)]
    return n


def prepare(inst: Any, addr: int) -> Instr:
    """One decoded tinygrad instruction as an Instr."""
    fmt = type(inst).__name__.replace("_LIT", "")
    literal = getattr(inst, "literal", None)
    regs = inst.op_regs if hasattr(inst, "op") else {}
    out = Instr(addr, inst.size(), _name(inst.op) if hasattr(inst, "op") else "VOPD", fmt, text=repr(inst))
    if "DPP" in type(inst).__name__:
        raise DflashError(f"{addr:#x}: DPP forms are not implemented ({out.text})")
    if fmt == "VOPD":
        out.dual = (inst.opx.name, inst.opy.name)
        out.ops = {"x0": _operand(inst.srcx0, 1, literal), "x1": _operand(inst.vsrcx1),
                   "y0": _operand(inst.srcy0, 1, literal), "y1": _operand(inst.vsrcy1),
                   "dx": _operand(inst.vdstx), "dy": _operand(inst.vdsty)}
        return out
    for fname, f in inst._fields:
        if fname in ("op", "literal") or type(f).__name__ == "FixedBitField":
            continue
        value = getattr(inst, fname)
        if type(value).__name__ == "Reg":
            # one name for the second source, whether the encoding's field is a VGPR (VOP2, VOPC) or not
            out.ops["src1" if fname == "vsrc1" else fname] = _operand(value, regs.get(fname, 1), literal)
        else:
            out.mods[fname] = int(value)
    return out


def decode_text(text: bytes, base: int, isa: str) -> dict[int, Instr]:
    """Every instruction of `text` (loaded at `base`) by address; an encoding that does not decode
    stops with its address."""
    from tinygrad.renderer.amd import decode_inst

    out: dict[int, Instr] = {}
    off = 0
    while off < len(text):
        word, = struct.unpack_from("<I", text, off)
        if isa == "rdna3" and word == _MUBUF_GL0_INV:
            out[base + off] = Instr(base + off, 8, "BUFFER_GL0_INV", "MUBUF", text="buffer_gl0_inv")
            off += 8
            continue
        try:
            inst = decode_inst(text[off: off + 16], isa)
        except (ValueError, RuntimeError, AssertionError) as e:
            raise DflashError(f"{base + off:#x}: word {word:#010x} does not decode as {isa}: {e}") from e
        out[base + off] = prepare(inst, base + off)
        off += inst.size()
    return out
