"""Which floating-point operations of a Vulkan library's matrix-product shaders a driver may contract.

ggml-vulkan embeds its SPIR-V modules in libggml-vulkan.so as byte arrays (`<name>_data`). The
exact flavor decorates every floating-point operation of mul_mm's f32 shaders (`matmul_*_fp32`)
NoContraction when it builds them (vulkan_kernels/patches/exact/0007): a driver then may neither
fuse a multiply and an add into one fma nor split an fma, so the K-parallel narrow mode and the
tiles, two code paths with the same operations, round alike on RADV as on lavapipe. This module reads
the shipped bytes, not the sources: what the driver will be handed. The stock library decorates none.
"""
from __future__ import annotations

import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import DflashError

SPIRV_MAGIC = 0x07230203
OP_EXT_INST_IMPORT, OP_EXT_INST, OP_DECORATE = 11, 12, 71
NO_CONTRACTION = 42
GLSL_FMA = 50
FLOAT_OPS = {127: "OpFNegate", 129: "OpFAdd", 131: "OpFSub", 133: "OpFMul", 136: "OpFDiv", 140: "OpFRem",
             141: "OpFMod", 142: "OpVectorTimesScalar", 143: "OpMatrixTimesScalar", 144: "OpVectorTimesMatrix",
             145: "OpMatrixTimesVector", 146: "OpMatrixTimesMatrix", 147: "OpOuterProduct", 148: "OpDot"}
# mul_mm.comp's f32 shaders, the ones the exact flavor runs at every width (dense and MUL_MAT_ID)
EXACT_PRODUCTS = re.compile(r"matmul_(id_)?\w+_fp32")


@dataclass(frozen=True)
class ContractionCheck:
    """One SPIR-V module: its floating-point operations, and those a driver may contract."""
    module: str
    float_ops: int
    contractible: dict[str, int]  # operation name -> how many lack NoContraction

    @property
    def precise(self) -> bool:
        return self.float_ops > 0 and not self.contractible

    def to_json(self) -> dict:
        return {"module": self.module, "float_ops": self.float_ops, "contractible": self.contractible,
                "precise": self.precise}


def float_ops(module: bytes, name: str = "module") -> ContractionCheck:
    """Every floating-point arithmetic instruction of one SPIR-V module (and GLSL.std.450 Fma), and
    which of them lack a NoContraction decoration."""
    if len(module) < 20 or len(module) % 4:
        raise DflashError(f"{name}: not a SPIR-V module ({len(module)} bytes)")
    words = struct.unpack(f"<{len(module) // 4}I", module)
    if words[0] != SPIRV_MAGIC:
        raise DflashError(f"{name}: not a SPIR-V module (magic {words[0]:#010x})")
    glsl, decorated, ops = None, set(), []
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if count == 0 or i + count > len(words):
            raise DflashError(f"{name}: truncated SPIR-V instruction at word {i}")
        ins = words[i:i + count]
        if op == OP_EXT_INST_IMPORT and module[4 * (i + 2):4 * (i + count)].split(b"\0")[0] == b"GLSL.std.450":
            glsl = ins[1]
        elif op == OP_DECORATE and count > 2 and ins[2] == NO_CONTRACTION:
            decorated.add(ins[1])
        elif op in FLOAT_OPS:
            ops.append((FLOAT_OPS[op], ins[2]))
        elif op == OP_EXT_INST and count > 4 and ins[3] == glsl and ins[4] == GLSL_FMA:
            ops.append(("Fma", ins[2]))
        i += count
    loose = Counter(op_name for op_name, result in ops if result not in decorated)
    return ContractionCheck(name, len(ops), dict(loose))


def embedded_modules(library: Path, pattern: re.Pattern[str] = EXACT_PRODUCTS) -> dict[str, bytes]:
    """The SPIR-V modules a ggml-vulkan library embeds whose names match `pattern`, read through the
    ELF symbol table (`<name>_data` symbols; their size is the module's)."""
    try:
        data = library.read_bytes()
    except OSError as e:
        raise DflashError(f"cannot read {library}: {e.strerror}") from None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise DflashError(f"{library}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]
    symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
    if symtab is None:
        raise DflashError(f"{library}: no symbol table (a stripped library: rebuild it with dflash build)")
    strtab = sections[symtab[6]]
    out: dict[str, bytes] = {}
    for k in range(symtab[5] // 24):
        st_name, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, symtab[4] + 24 * k)
        end = data.index(b"\0", strtab[4] + st_name)
        sym = data[strtab[4] + st_name:end].decode(errors="replace")
        if not sym.endswith("_data") or not pattern.fullmatch(sym[:-5]) or not 0 < shndx < len(sections):
            continue
        section = sections[shndx]
        offset = value - section[3] + section[4]
        out[sym[:-5]] = data[offset:offset + size]
    return out


def contraction_report(library: Path, pattern: re.Pattern[str] = EXACT_PRODUCTS) -> list[ContractionCheck]:
    """Every matching module of `library`, checked; an error when it embeds none."""
    modules = embedded_modules(library, pattern)
    if not modules:
        raise DflashError(f"{library}: no SPIR-V module named like {pattern.pattern}")
    return [float_ops(module, name) for name, module in sorted(modules.items())]
