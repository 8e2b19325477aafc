"""`dflash kernels run`: every narrow-MMVQ kernel of the shipped gfx1151 and gfx1201 code objects
executed instruction by instruction in the project's RDNA interpreter (dflash/native/rdna), on
random blocks of every weight type, and compared bit for bit with the host body
(`dflash_mmvq_host`, emulate.h) and with itself at ncols = 1.

Dense kernels `dflash_mmvq_<type>_nc<k>`, k = 1..4, run on the first k of four activation columns:
each column must equal the host body's column and the same column run alone through `_nc1`. The
routed-expert kernels `dflash_mmvq_<type>_id` run a grid of slots x tokens over four experts: each
output must equal the host body's and `_nc1`'s result for the chosen expert and column.

This is emulated ISA: AMD's documented semantics of the instructions the compiler emitted, not
silicon, not ROCm's compiler, not the HIP runtime (hip_kernels/README.md)."""
from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsInt, cast

import numpy as np

from dflash.core.errors import DflashError
from dflash.native import kernel_selftest as ks

ARCHS = ("gfx1151", "gfx1201")
Q8_1 = ks.Q8_1_BYTES
# the routed-expert grid: experts, slots, tokens (slots x tokens activation columns <= 4, the host's limit)
EXPERTS, SLOTS, TOKENS = 4, 2, 2


@dataclass(frozen=True)
class KernelRun:
    """One kernel of one code object in the interpreter."""
    arch: str
    kernel: str
    type: str
    ncols: int | None              # None: the routed-expert kernel
    identical_to_host: bool
    identical_to_nc1: bool
    first_diff: str | None         # "column c row r" (or "slot s token t row r") of the first differing output
    seconds: float
    instructions: int

    @property
    def ok(self) -> bool:
        return self.identical_to_host and self.identical_to_nc1

    def to_json(self) -> dict[str, Any]:
        return {"arch": self.arch, "kernel": self.kernel, "type": self.type, "ncols": self.ncols,
                "identical_to_host": self.identical_to_host, "identical_to_nc1": self.identical_to_nc1,
                "first_diff": self.first_diff, "seconds": round(self.seconds, 3), "instructions": self.instructions}


def code_object_path(arch: str, build_dir: Path, planted: bool = False) -> Path:
    p = build_dir / f"dflash_mmvq_{arch}{'_planted_order' if planted else ''}.hsaco"
    if not p.is_file():
        raise DflashError(f"no code object at {p}: build the kernels first "
                          f"(cmake -S . -B build/native && cmake --build build/native)")
    return p


def _pack(kernel: Any, values: list[int]) -> bytes:
    """Kernel arguments at the offsets and sizes the code object's metadata gives."""
    if len(values) != len(kernel.args):
        raise DflashError(f"{kernel.name} takes {len(kernel.args)} arguments, given {len(values)}")
    out = bytearray(kernel.kernarg_size)
    for a, v in zip(kernel.args, values, strict=True):
        struct.pack_into({4: "<i", 8: "<q"}[a.size] if a.kind == "by_value" else "<Q", out, a.offset, v)
    return bytes(out)


def require_interpreter() -> None:
    """The interpreter's packages (the `rdna` extra), or a one-line error."""
    import importlib.util
    missing = [m for m in ("tinygrad", "elftools", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise DflashError(f"the RDNA interpreter needs {', '.join(missing)}: pip install 'dflash-exact[rdna]'")


class InterpreterGpu:
    """kernel_selftest's GPU interface (buffer, launch, read, free) on the RDNA interpreter, so the
    dense launches are kernel_selftest.run_dense's own; `instructions` counts the last launch's."""

    def __init__(self, co_path: Path) -> None:
        require_interpreter()
        from dflash.native.rdna import codeobj, machine, state
        self.machine, self.state = machine, state
        self.code = codeobj.load(co_path)
        self.prog = machine.load_program(self.code)
        self.mem = state.Memory()
        self.live = 0
        self.instructions = 0

    def buffer(self, data: bytes) -> int:
        self.live += 1
        return self.mem.alloc(data)

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[object, ...]) -> None:
        values = [int(cast(SupportsInt, getattr(a, "value", a))) for a in args]  # ctypes scalars, addresses
        stats = self.machine.launch(self.prog, name, grid, block, _pack(self.code.kernel(name), values), self.mem)
        self.instructions = stats.instructions

    def read(self, ptr: int, nbytes: int) -> bytes:
        return self.mem.read(ptr, nbytes)

    def free(self, *ptrs: object) -> None:
        self.live -= len(ptrs)
        if self.live <= 0:  # nothing left in use: start the next launch on empty memory
            self.mem, self.live = self.state.Memory(), 0


def run_routed(gpu: Any, tname: str, w: bytes, xq: bytes, ids: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """y (tokens, slots, rows) of `_id` over EXPERTS experts: ids (tokens, slots); activation column
    token * SLOTS + slot of xq."""
    nbytes, nvals = ks.TYPES[tname]
    nblocks, nb32 = cols // nvals, cols // 32
    wa, xa, ya = gpu.buffer(w), gpu.buffer(xq), gpu.buffer(bytes(4 * TOKENS * SLOTS * rows))
    ia = gpu.buffer(ids.astype("<i4").tobytes())
    try:
        w_row = nblocks * nbytes
        gpu.launch(f"dflash_mmvq_{tname}_id", (rows, SLOTS, TOKENS), (32, 4, 1),
                   (wa, xa, ya, ia, nblocks, rows, w_row, rows * w_row, nb32, SLOTS * nb32, SLOTS, rows, SLOTS * rows,
                    1, SLOTS))
        return np.frombuffer(gpu.read(ya, 4 * TOKENS * SLOTS * rows), "<f4").reshape(TOKENS, SLOTS, rows)
    finally:
        gpu.free(wa, xa, ya, ia)


def _column(case: ks.Case, xq: bytes, c: int) -> tuple[ks.Case, bytes]:
    """Column c of a case and of its q8_1 activations, as a case of its own."""
    nb = case.cols // 32 * Q8_1
    return ks.Case(case.type, case.rows, case.cols, case.w, case.x[c: c + 1]), xq[c * nb:(c + 1) * nb]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, "<f4").view(np.uint32)


def _first_diff(a: np.ndarray, b: np.ndarray, names: tuple[str, ...]) -> str | None:
    bad = np.argwhere(_bits(a) != _bits(b))
    if not len(bad):
        return None
    return " ".join(f"{n} {i}" for n, i in zip(names, bad[0].tolist(), strict=True))


def run(arch: str, build_dir: Path = ks.DEFAULT_BUILD, types: tuple[str, ...] = tuple(ks.TYPES),
        rows: int = 8, cols: int = 2048, seed: int = 0, planted: bool = False,
        progress: Callable[[KernelRun], None] = lambda r: None) -> list[KernelRun]:
    """Every dense and routed-expert kernel of `types` in `arch`'s code object (its planted-order twin
    when `planted`), each checked against the host body and against `_nc1`."""
    if arch not in ARCHS:
        raise DflashError(f"no code object for {arch}: the kernels are built for {', '.join(ARCHS)}")
    for t in types:
        if t not in ks.TYPES:
            raise DflashError(f"unknown weight type {t!r} ({', '.join(ks.TYPES)})")
    if cols % 256 or cols <= 0 or rows <= 0:
        raise DflashError("--cols must be a positive multiple of 256 and --rows positive")
    gpu = InterpreterGpu(code_object_path(arch, build_dir, planted))
    out: list[KernelRun] = []

    def record(kernel: str, tname: str, ncols: int | None, got: np.ndarray, host: np.ndarray, nc1: np.ndarray,
               names: tuple[str, ...], secs: float) -> None:
        host_diff, nc1_diff = _first_diff(got, host, names), _first_diff(got, nc1, names)
        r = KernelRun(arch, kernel, tname, ncols, host_diff is None, nc1_diff is None, host_diff or nc1_diff, secs,
                      gpu.instructions)
        out.append(r)
        progress(r)

    for tname in types:
        rng = np.random.default_rng(seed)
        w = ks.random_weights(tname, EXPERTS * rows, cols, rng)
        x = rng.standard_normal((4, cols)).astype(np.float32)
        case = ks.Case(tname, rows, cols, w[: len(w) // EXPERTS], x)
        want, xq = ks.host_expected(case, build_dir)
        alone = np.stack([ks.run_dense(gpu, *_column(case, xq, c))[0] for c in range(4)])  # each column through _nc1
        for ncols in (1, 2, 3, 4):
            t0 = time.perf_counter()
            got = ks.run_dense(gpu, ks.Case(tname, rows, cols, case.w, x[:ncols]), xq[: ncols * cols // 32 * Q8_1])
            secs = time.perf_counter() - t0
            record(f"dflash_mmvq_{tname}_nc{ncols}", tname, ncols, got, want[:ncols], alone[:ncols], ("column", "row"),
                   secs)
        # routed experts: the host body over all experts' rows at once, one column per (token, slot)
        ids = rng.integers(0, EXPERTS, size=(TOKENS, SLOTS)).astype(np.int32)
        every = ks.Case(tname, EXPERTS * rows, cols, w, x[: TOKENS * SLOTS])
        want_all, xq_all = ks.host_expected(every, build_dir)
        t0 = time.perf_counter()
        got = run_routed(gpu, tname, w, xq_all, ids, rows, cols)
        secs = time.perf_counter() - t0
        host = np.stack([np.stack([want_all[tok * SLOTS + s, ids[tok, s] * rows:(ids[tok, s] + 1) * rows]
                                   for s in range(SLOTS)]) for tok in range(TOKENS)])
        nc1 = np.empty_like(host)
        for tok in range(TOKENS):
            for s in range(SLOTS):
                e = int(ids[tok, s])
                expert = ks.Case(tname, rows, cols, w[e * len(w) // EXPERTS:(e + 1) * len(w) // EXPERTS], every.x)
                nc1[tok, s] = ks.run_dense(gpu, *_column(expert, xq_all, tok * SLOTS + s))[0]
        record(f"dflash_mmvq_{tname}_id", tname, None, got, host, nc1, ("token", "slot", "row"), secs)
    return out
