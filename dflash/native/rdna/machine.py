"""Running a kernel of a code object: device memory as host buffers, a launch grid of wave32
workgroups set up as the hardware's ABI sets them up, and each wave stepped instruction by
instruction (semantics.py) with its waves interleaved at every barrier.

The ABI (LLVM's AMDGPU usage document, "Initial Kernel Execution State"): user SGPRs first (here the
kernarg segment pointer in s[0:1]), then on gfx11 the enabled workgroup IDs in the SGPRs after them;
gfx12 has architected workgroup IDs instead (TTMP9 = x, TTMP7 = y | z << 16). v0 holds the packed
work-item IDs (x in bits 9:0, y in 19:10, z in 29:20). EXEC starts with one bit per live lane.
Registers nothing initializes hold a poison value, so a kernel that reads one computes garbage
visibly. Memory instructions complete at issue (the waits are no-ops): in one wave's program order,
which is what a race-free kernel may assume."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash.native.rdna import decode, semantics
from dflash.native.rdna.codeobj import CodeObject, Kernel
from dflash.native.rdna.state import POISON, WAVE, InterpreterError, Memory, Step, Wave


@dataclass
class Program:
    isa: str
    instrs: dict[int, decode.Instr]
    steps: dict[int, Step]
    code: CodeObject | None = None


def load_program(code: CodeObject) -> Program:
    return program(code.text, code.text_addr, code.isa, code)


def program(text: bytes, base: int, isa: str, code: CodeObject | None = None) -> Program:
    """Machine code (loaded at `base`) decoded and prepared for running."""
    instrs = decode.decode_text(text, base, isa)
    return Program(isa, instrs, {a: semantics.step_for(i, isa) for a, i in instrs.items()}, code)


def new_wave(isa: str, lds_bytes: int = 0, mem: Memory | None = None, pc: int = 0) -> Wave:
    """A wave with every register poisoned, all 32 lanes live, SCC 0: tests set what they need."""
    s = [POISON] * 128
    s[decode.EXEC_LO], s[decode.EXEC_HI], s[decode.VCC_LO], s[decode.VCC_HI] = 0xFFFFFFFF, 0, 0, 0
    return Wave(s, np.full((256, WAVE), POISON, np.uint32), np.zeros(max(lds_bytes, 4), np.uint8),
                mem or Memory(), isa, pc)


def run_wave(prog: Program, w: Wave, max_steps: int = 1_000_000) -> Wave:
    """One wave alone from its program counter to s_endpgm (a barrier passes at once)."""
    while not w.done:
        _run_until_barrier(prog, w, max_steps, "snippet")
        w.at_barrier = False
    return w


@dataclass
class LaunchStats:
    workgroups: int = 0
    waves: int = 0
    instructions: int = 0


def _check_modes(k: Kernel) -> None:
    if k.wavefront_size != WAVE:
        raise InterpreterError(f"{k.name} is built for wave{k.wavefront_size}; the interpreter runs wave32")
    if k.float_denorm_mode_32 != 3 or (k.rsrc1 >> 18) & 3 != 3:
        raise InterpreterError(f"{k.name} flushes subnormals (FLOAT_DENORM_MODE {k.float_denorm_mode_32}); the "
                               "interpreter runs IEEE subnormals only")
    if (k.rsrc1 >> 12) & 0xF:
        raise InterpreterError(f"{k.name} asks for a rounding mode other than round to nearest even")
    if not k.kernarg_ptr or k.user_sgprs != 2:
        raise InterpreterError(f"{k.name}: user SGPRs other than the kernarg pointer are not implemented")
    if np.float32(1e-45) * np.float32(1.0) == 0:  # the host itself flushes (MXCSR FTZ/DAZ set by a library)
        raise InterpreterError("this process flushes f32 subnormals; the interpreter cannot run IEEE semantics in it")


def launch(prog: Program, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], kernarg: bytes,
           mem: Memory, order: str = "forward", max_steps: int = 50_000_000) -> LaunchStats:
    """Run kernel `name` over `grid` workgroups of `block` work-items (HIP's launch: grid counts
    workgroups) with `kernarg` as its kernel arguments; buffers live in `mem`. `order` "reverse"
    runs each workgroup's waves last to first between barriers (a race between them would show)."""
    if prog.code is None:
        raise InterpreterError("a launch needs a program loaded from a code object")
    k = prog.code.kernel(name)
    _check_modes(k)
    if len(kernarg) != k.kernarg_size:
        raise InterpreterError(f"{name} takes {k.kernarg_size} bytes of arguments, given {len(kernarg)}")
    threads = block[0] * block[1] * block[2]
    if threads > k.max_workgroup_size or threads == 0:
        raise InterpreterError(f"{name}: a workgroup of {threads} work-items (its limit is {k.max_workgroup_size})")
    karg = mem.alloc(kernarg)
    stats = LaunchStats()
    tid = np.arange(threads, dtype=np.uint32)
    tx, ty, tz = tid % block[0], (tid // block[0]) % block[1], tid // (block[0] * block[1])
    packed = tx | (ty << 10) | (tz << 20)
    nwaves = (threads + WAVE - 1) // WAVE
    for gz in range(grid[2]):
        for gy in range(grid[1]):
            for gx in range(grid[0]):
                lds = np.zeros(max(k.group_segment_size, 4), np.uint8)
                waves = []
                for wi in range(nwaves):
                    s = [POISON] * 128
                    s[0], s[1] = karg & 0xFFFFFFFF, karg >> 32
                    nxt = k.user_sgprs
                    if prog.code.isa == "rdna4":
                        s[108 + 9], s[108 + 7] = gx, gy | (gz << 16)
                    else:
                        for on, g in zip(k.workgroup_id_sgprs, (gx, gy, gz), strict=True):
                            if on:
                                s[nxt] = g
                                nxt += 1
                    lanes = packed[wi * WAVE: (wi + 1) * WAVE]
                    s[decode.EXEC_LO], s[decode.EXEC_HI] = (1 << len(lanes)) - 1, 0
                    s[decode.VCC_LO], s[decode.VCC_HI], s[decode.M0] = 0, 0, POISON
                    v = np.full((256, WAVE), POISON, np.uint32)
                    v[0, : len(lanes)] = lanes
                    waves.append(Wave(s, v, lds, mem, prog.code.isa, k.entry))
                _run_workgroup(prog, waves, order, max_steps, name)
                stats.workgroups += 1
                stats.waves += len(waves)
                stats.instructions += sum(w.steps for w in waves)
    return stats


def _run_workgroup(prog: Program, waves: list[Wave], order: str, max_steps: int, name: str) -> None:
    seq = waves if order == "forward" else waves[::-1]
    while True:
        for w in seq:
            _run_until_barrier(prog, w, max_steps, name)
        live = [w for w in waves if not w.done]
        if not live:
            return
        for w in live:  # every live wave waits at the barrier: release them all
            w.at_barrier = False


def _run_until_barrier(prog: Program, w: Wave, max_steps: int, name: str) -> None:
    steps, instrs = prog.steps, prog.instrs
    while not w.done and not w.at_barrier:
        pc = w.pc
        step = steps.get(pc)
        if step is None:
            raise InterpreterError(f"{name}: the program counter {pc:#x} is not at an instruction")
        ins = instrs[pc]
        try:
            nxt = step(w, ins)
        except InterpreterError as e:
            raise InterpreterError(f"{name} at {ins}: {e}") from None
        w.pc = pc + ins.size if nxt is None else nxt
        w.steps += 1
        if w.steps > max_steps:
            raise InterpreterError(f"{name}: more than {max_steps} instructions in one wave (a loop that never ends?)")
