"""The state the interpreter keeps: device memory (host buffers at flat 64-bit addresses, every
access checked to lie inside one buffer) and a wave (its SGPRs, VGPRs, the workgroup's LDS, SCC and
program counter)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dflash.core.errors import DflashError
from dflash.native.rdna import decode

WAVE = 32
POISON = 0xBAADF00D
BASE = 0x7F00_0000_0000   # where device memory starts (a pointer-looking address)
GUARD = 4096              # unmapped bytes between two buffers: an access across them stops the run


class InterpreterError(DflashError):
    """The program did what the interpreter cannot run, or what no correct kernel does."""


@dataclass
class Memory:
    """Device memory: buffers at addresses of a flat 64-bit space."""
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def alloc(self, content: bytes | int) -> int:
        n = content if isinstance(content, int) else len(content)
        start = BASE + ((len(self.data) + GUARD + 255) // 256) * 256
        end = start + max(n, 1)
        grown = np.zeros(end - BASE, np.uint8)
        grown[: len(self.data)] = self.data
        self.data = grown
        if not isinstance(content, int):
            self.data[start - BASE: start - BASE + n] = np.frombuffer(content, np.uint8)
        self.starts.append(start)
        self.ends.append(end)
        return start

    def read(self, addr: int, n: int) -> bytes:
        self._check(np.array([addr], np.uint64), n, "read")
        return self.data[addr - BASE: addr - BASE + n].tobytes()

    def _check(self, addrs: np.ndarray, width: int, what: str) -> np.ndarray:
        starts = np.asarray(self.starts, np.uint64)
        i = np.searchsorted(starts, addrs, side="right") - 1
        ok = (i >= 0) & (addrs + np.uint64(width) <= np.asarray(self.ends, np.uint64)[np.maximum(i, 0)])
        if not ok.all():
            bad = int(addrs[~ok][0])
            raise InterpreterError(f"{what} of {width} bytes at {bad:#x} lies outside every buffer")
        return (addrs - np.uint64(BASE)).astype(np.int64)

    def load(self, addrs: np.ndarray, width: int) -> np.ndarray:
        """(lanes, width) bytes."""
        off = self._check(addrs, width, "load")
        return self.data[off[:, None] + np.arange(width)]

    def store(self, addrs: np.ndarray, values: np.ndarray) -> None:
        off = self._check(addrs, values.shape[1], "store")
        self.data[off[:, None] + np.arange(values.shape[1])] = values


@dataclass
class Wave:
    s: list[int]                 # SGPRs 0..127 (VCC 106/107, TTMP 108..123, M0 125, EXEC 126/127)
    v: np.ndarray                # VGPRs (n, 32) uint32
    lds: np.ndarray              # the workgroup's LDS (shared by its waves)
    mem: Memory
    isa: str
    pc: int
    scc: int = 0
    done: bool = False
    at_barrier: bool = False
    steps: int = 0
    lane_ids: np.ndarray = field(default_factory=lambda: np.arange(WAVE, dtype=np.uint32))

    @property
    def exec(self) -> int:
        return self.s[decode.EXEC_LO]

    def mask(self, bits: int | None = None) -> np.ndarray:
        b = self.exec if bits is None else bits
        return ((np.uint32(b) >> self.lane_ids) & 1).astype(bool)


Step = Callable[[Wave, decode.Instr], int | None]
