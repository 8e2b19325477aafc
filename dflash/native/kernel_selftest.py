"""`dflash kernels selftest`: run every dense narrow-MMVQ kernel (`dflash_mmvq_<type>_nc<n>`, all
seven weight types of the code objects, ncols 1..4) on an AMD GPU and compare with the host body
bit for bit.

The host side (random GGUF-format weights, q8_1 activations and the expected outputs from the
`dflash_mmvq_host` binary, which runs the same kernel body lane by lane) runs anywhere. The GPU
side loads `dflash_mmvq_<arch>.hsaco` with hipModuleLoadData and launches through hip-python;
it has not been run on hardware yet (no AMD GPU in this project's machines).

Not run here: the seven routed-expert kernels `dflash_mmvq_<type>_id` (`NOT_COVERED`, also in the
command's output); their 15-argument launch has not been written for hip-python yet. CTest's ISA
checks cover their code, and the CUDA self-test runs them (`_id` == `_nc1` on the selected expert)
on an NVIDIA GPU.
"""
from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dflash.core.errors import DflashError
from dflash.core.paths import REPO_ROOT
from dflash.native.devices import Device

# every weight type of the code objects (hip_kernels/src/dflash_mmvq.hip): bytes, values per block
TYPES = {"q8_0": (34, 32), "q4_0": (18, 32), "q4_k": (144, 256), "mxfp4": (17, 32), "q5_0": (22, 32),
         "q5_k": (176, 256), "q6_k": (210, 256)}
NCOLS = (1, 2, 3, 4)
Q8_1_BYTES = 36
DEFAULT_BUILD = REPO_ROOT / "build" / "native" / "hip_kernels"
NOT_COVERED = {f"dflash_mmvq_{name}_id": "routed-expert kernel: no hip-python launch yet (its ISA is checked by "
               "CTest, and the CUDA self-test runs it on an NVIDIA GPU)" for name in TYPES}


@dataclass
class Case:
    type: str
    rows: int
    cols: int
    w: bytes
    x: np.ndarray  # (ncols, cols) float32


def random_weights(tname: str, rows: int, cols: int, rng: np.random.Generator) -> bytes:
    """Random but valid blocks: scale fields are finite halves, every other byte is random (the
    quants, Q5_0's and Q5_K's fifth bits, the 6-bit K-quant scales, Q6_K's int8 scales)."""
    nbytes, nvals = TYPES[tname]
    nblk = rows * cols // nvals
    raw = rng.integers(0, 256, size=(nblk, nbytes), dtype=np.uint8)
    half = lambda lo, hi: np.asarray(rng.uniform(lo, hi, size=nblk), dtype=np.float16).view(np.uint8).reshape(nblk, 2)
    if tname in ("q8_0", "q4_0", "q5_0"):  # d, then the quants (Q5_0: 4 bytes of fifth bits first)
        raw[:, 0:2] = half(0.001, 0.05)
    elif tname in ("q4_k", "q5_k"):  # d, dmin, then 12 bytes of 6-bit scales and mins
        raw[:, 0:2] = half(0.001, 0.05)
        raw[:, 2:4] = half(0.001, 0.05)
    elif tname == "q6_k":  # ql[128], qh[64], int8 scales[16], then d
        raw[:, 208:210] = half(0.0002, 0.002)
    elif tname == "mxfp4":
        raw[:, 0] = rng.integers(118, 130, size=nblk)  # E8M0 scale near 2^0
    else:
        raise DflashError(f"no random weights for {tname!r}")
    return raw.tobytes()


def make_case(tname: str, ncols: int, rows: int = 64, cols: int = 512, seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    return Case(tname, rows, cols, random_weights(tname, rows, cols, rng),
                rng.standard_normal((ncols, cols)).astype(np.float32))


def host_binary(build_dir: Path = DEFAULT_BUILD) -> Path:
    p = build_dir / "dflash_mmvq_host"
    if not p.is_file():
        raise DflashError(f"{p} is missing: build the kernels first "
                          "(cmake -S . -B build/native && cmake --build build/native)")
    return p


def host_expected(case: Case, build_dir: Path = DEFAULT_BUILD) -> tuple[np.ndarray, bytes]:
    """(y of shape (ncols, rows), the q8_1 activations the host produced) from the host body."""
    ncols = case.x.shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "w.bin").write_bytes(case.w)
        case.x.astype("<f4").tofile(d / "x.f32")
        cmd = [str(host_binary(build_dir)), "--type", case.type, "--ncols", str(ncols), "--rows",
               str(case.rows), "--cols", str(case.cols), "--w", str(d / "w.bin"), "--x", str(d / "x.f32"),
               "--y", str(d / "y.f32"), "--xq-out", str(d / "xq.bin")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise DflashError(f"dflash_mmvq_host failed: {(r.stderr or r.stdout).strip()[:200]}")
        y = np.fromfile(d / "y.f32", dtype="<f4").reshape(ncols, case.rows)
        return y, (d / "xq.bin").read_bytes()


def code_object(arch: str, build_dir: Path = DEFAULT_BUILD) -> Path:
    p = build_dir / f"dflash_mmvq_{arch}.hsaco"
    if not p.is_file():
        raise DflashError(f"no code object for {arch} at {p} (built arches: "
                          f"{', '.join(sorted(q.stem.split('_')[-1] for q in build_dir.glob('*.hsaco'))) or 'none'})")
    return p


class Gpu(Protocol):
    """What a launch needs of a device: hip-python's (_Gpu), or the RDNA interpreter's
    (kernel_run.InterpreterGpu)."""

    def buffer(self, data: bytes) -> Any: ...

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[object, ...]) -> None: ...

    def read(self, ptr: Any, nbytes: int) -> bytes: ...

    def free(self, *ptrs: Any) -> None: ...


class _Gpu:
    """The few hip-python calls the self-test needs (not yet run on hardware)."""

    def __init__(self, index: int, co: Path) -> None:
        from hip import hip

        from dflash.native.devices import _check
        self.hip, self.check = hip, _check
        _check(hip.hipSetDevice(index))
        self.module = _check(hip.hipModuleLoadData(co.read_bytes()))

    def buffer(self, data: bytes) -> object:  # a hip-python device pointer
        ptr: object = self.check(self.hip.hipMalloc(max(len(data), 4)))
        if data:
            self.check(self.hip.hipMemcpy(ptr, data, len(data), self.hip.hipMemcpyKind.hipMemcpyHostToDevice))
        return ptr

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[object, ...]) -> None:
        f = self.check(self.hip.hipModuleGetFunction(self.module, name.encode()))
        self.check(self.hip.hipModuleLaunchKernel(f, *grid, *block, sharedMemBytes=0, stream=None,
                                                  kernelParams=None, extra=args))
        self.check(self.hip.hipDeviceSynchronize())

    def read(self, ptr: object, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self.check(self.hip.hipMemcpy(out, ptr, nbytes, self.hip.hipMemcpyKind.hipMemcpyDeviceToHost))
        return bytes(out)

    def free(self, *ptrs: object) -> None:
        for p in ptrs:
            self.check(self.hip.hipFree(p))


def run_dense(gpu: Gpu, case: Case, xq: bytes) -> np.ndarray:
    import ctypes
    ncols = case.x.shape[0]
    nbytes, nvals = TYPES[case.type]
    nblocks = case.cols // nvals
    w, x, y = gpu.buffer(case.w), gpu.buffer(xq), gpu.buffer(bytes(4 * ncols * case.rows))
    try:
        gpu.launch(f"dflash_mmvq_{case.type}_nc{ncols}", (case.rows, 1, 1), (32, 4, 1),
                   (w, x, y, ctypes.c_int32(nblocks), ctypes.c_int32(case.rows),
                    ctypes.c_int64(nblocks * nbytes), ctypes.c_int64(case.cols // 32), ctypes.c_int64(case.rows)))
        return np.frombuffer(gpu.read(y, 4 * ncols * case.rows), dtype="<f4").reshape(ncols, case.rows)
    finally:
        gpu.free(w, x, y)


def selftest(device: Device, index: int, build_dir: Path = DEFAULT_BUILD,
             progress: Callable[[int, int], None] = lambda done, total: None) -> list[dict[str, Any]]:
    """Every dense kernel (each of the seven types in TYPES x ncols 1..4) on the GPU against the
    host body; one row per kernel. The routed-expert `_id` kernels are not run (NOT_COVERED)."""
    gpu = _Gpu(index, code_object(device.arch, build_dir))
    results: list[dict[str, Any]] = []
    total = len(TYPES) * len(NCOLS)
    for tname in TYPES:
        for ncols in NCOLS:
            case = make_case(tname, ncols, seed=ncols)
            want, xq = host_expected(case, build_dir)
            got = run_dense(gpu, case, xq)
            same = np.array_equal(want.view(np.uint32), got.view(np.uint32))
            bad = np.flatnonzero(want.view(np.uint32).ravel() != got.view(np.uint32).ravel())
            results.append({"kernel": f"dflash_mmvq_{tname}_nc{ncols}", "bit_identical": bool(same),
                            "first_diff": int(bad[0]) if bad.size else None,
                            "max_abs_diff": float(np.max(np.abs(want - got))) if bad.size else 0.0})
            progress(len(results), total)
    return results
