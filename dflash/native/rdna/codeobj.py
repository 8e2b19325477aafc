"""A code object as the interpreter needs it: the target, the text, and per kernel its entry, its
kernel descriptor (.kd, 64 bytes) and its arguments from the AMDGPU metadata note."""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import DflashError

# the instruction set each target runs (tinygrad's tables: "rdna3" is RDNA3.5's document, gfx1151's)
ISA = {"gfx1151": "rdna3", "gfx1201": "rdna4"}
NT_AMDGPU_METADATA = 32


@dataclass(frozen=True)
class Arg:
    offset: int
    size: int
    kind: str  # global_buffer, by_value, ...


@dataclass(frozen=True)
class Kernel:
    name: str
    entry: int                # address of the first instruction
    group_segment_size: int   # LDS bytes
    kernarg_size: int
    args: tuple[Arg, ...]
    rsrc1: int
    rsrc2: int
    code_properties: int
    wavefront_size: int
    max_workgroup_size: int

    @property
    def float_denorm_mode_32(self) -> int:
        """COMPUTE_PGM_RSRC1 bits 17:16 (3: f32 subnormals kept on input and output)."""
        return (self.rsrc1 >> 16) & 3

    @property
    def user_sgprs(self) -> int:
        return (self.rsrc2 >> 1) & 0x1F

    @property
    def workgroup_id_sgprs(self) -> tuple[bool, bool, bool]:
        """COMPUTE_PGM_RSRC2 ENABLE_SGPR_WORKGROUP_ID_X/Y/Z (bits 7, 8, 9)."""
        return bool(self.rsrc2 >> 7 & 1), bool(self.rsrc2 >> 8 & 1), bool(self.rsrc2 >> 9 & 1)

    @property
    def workitem_id_vgprs(self) -> int:
        """COMPUTE_PGM_RSRC2 ENABLE_VGPR_WORKITEM_ID (bits 12:11): 0 x, 1 x and y, 2 x, y and z."""
        return (self.rsrc2 >> 11) & 3

    @property
    def kernarg_ptr(self) -> bool:
        """KERNEL_CODE_PROPERTIES ENABLE_SGPR_KERNARG_SEGMENT_PTR (bit 3)."""
        return bool(self.code_properties >> 3 & 1)


@dataclass(frozen=True)
class CodeObject:
    path: Path
    target: str         # gfx1151, gfx1201
    text: bytes
    text_addr: int
    kernels: dict[str, Kernel]

    @property
    def isa(self) -> str:
        return ISA[self.target]

    def kernel(self, name: str) -> Kernel:
        if name not in self.kernels:
            raise DflashError(f"{self.path.name} has no kernel {name} (it has {len(self.kernels)}: "
                              f"{', '.join(sorted(self.kernels)[:4])}, ...)")
        return self.kernels[name]


def load(path: Path) -> CodeObject:
    """Read a code object built for gfx1151 or gfx1201 (clang's -mcode-object-version 5 or 6)."""
    import msgpack
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import NoteSection, SymbolTableSection

    data = Path(path).read_bytes()
    try:
        elf = ELFFile(io.BytesIO(data))
        if elf["e_machine"] != "EM_AMDGPU":
            raise DflashError(f"{path} is not an AMDGPU code object (machine {elf['e_machine']})")
        meta: dict = {}
        for sec in elf.iter_sections():
            if isinstance(sec, NoteSection):
                for note in sec.iter_notes():
                    if note["n_name"] == "AMDGPU" and note["n_type"] == NT_AMDGPU_METADATA:
                        desc = note["n_descdata"]
                        meta = msgpack.unpackb(desc if isinstance(desc, bytes) else desc.encode("latin-1"))
        text = elf.get_section_by_name(".text")
        rodata = elf.get_section_by_name(".rodata")
        symtab = elf.get_section_by_name(".symtab")
        if text is None or rodata is None or not isinstance(symtab, SymbolTableSection) or not meta:
            raise DflashError(f"{path}: no .text, .rodata, symbol table or AMDGPU metadata")
        symbols = {s.name: s["st_value"] for s in symtab.iter_symbols() if s.name}
    except ELFError as e:
        raise DflashError(f"{path} is not a readable ELF file: {e}") from e
    target = str(meta.get("amdhsa.target", "")).split("--")[-1].split(":")[0]
    if target not in ISA:
        raise DflashError(f"{path} targets {target or 'an unknown processor'}; the interpreter runs "
                          f"{', '.join(ISA)}")
    ro, ro_addr = rodata.data(), rodata["sh_addr"]
    kernels = {}
    for k in meta.get("amdhsa.kernels", []):
        name, kd_addr = k[".name"], symbols.get(k[".symbol"])
        if kd_addr is None or name not in symbols:
            raise DflashError(f"{path}: kernel {name} has no descriptor or entry symbol")
        kd = ro[kd_addr - ro_addr: kd_addr - ro_addr + 64]
        group, _private, kernarg = struct.unpack_from("<III", kd, 0)
        entry_offset, = struct.unpack_from("<q", kd, 16)
        rsrc3, rsrc1, rsrc2 = struct.unpack_from("<III", kd, 44)
        code_props, = struct.unpack_from("<H", kd, 56)
        if kd_addr + entry_offset != symbols[name]:
            raise DflashError(f"{path}: {name}'s descriptor points at {kd_addr + entry_offset:#x}, its symbol "
                              f"at {symbols[name]:#x}")
        args = tuple(Arg(a[".offset"], a[".size"], a[".value_kind"]) for a in k.get(".args", []))
        kernarg = int(k.get(".kernarg_segment_size", kernarg))  # the metadata's, as the runtime takes it
        kernels[name] = Kernel(name, symbols[name], group, kernarg, args, rsrc1, rsrc2, code_props,
                               int(k.get(".wavefront_size", 64)), int(k.get(".max_flat_workgroup_size", 0)))
    return CodeObject(Path(path), target, text.data(), text["sh_addr"], kernels)
