"""The narrow-MMVQ kernel body (hip_kernels/) on the CPU, checked against gguf's dequantizer.

The host binary runs the very template body the GPU kernels run, lane by lane, in the GPU's
reduction order (hip_kernels/include/dflash_mmvq/emulate.h). Weights are real GGUF block bytes:
gguf.quants.quantize for Q8_0 / Q4_0 / Q5_0 / MXFP4, and for Q4_K / Q5_K / Q6_K (which gguf can
only dequantize) the small quantizers below, whose output gguf's dequantizer reads back. Random
block bytes (every bit pattern, sane scales) check the decode of each layout against gguf too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "hip_kernels"
TYPES = {
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_k": Q.Q4_K,
    "mxfp4": Q.MXFP4,
    "q5_0": Q.Q5_0,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
}
NIBBLE_TYPES = ["q4_0", "q4_k", "mxfp4", "q5_0", "q5_k", "q6_k"]
K_QUANTIZERS = ["q4_k", "q5_k", "q6_k"]
ROWS, K = 23, 1280  # K = 5 Q4_K super-blocks; 160 slices for the 32-value types: ragged lanes
REL_TOL = 1e-5  # of sum |w| |x|, as in hip_kernels/tests/host_data.h


@pytest.fixture(scope="session")
def host_bins(tmp_path_factory) -> dict[str, Path]:
    cmake, cxx = shutil.which("cmake"), shutil.which("g++") or shutil.which("c++")
    if not cmake or not cxx:
        pytest.fail("cmake and a C++ compiler (g++) are needed to build dflash_mmvq_host: run scripts/setup")
    build = tmp_path_factory.mktemp("hip_kernels_build")
    for cmd in (
        [cmake, "-S", str(KERNELS), "-B", str(build), "-DDFLASH_KERNELS_HOST_ONLY=ON", "-DCMAKE_BUILD_TYPE=Release"],
        [cmake, "--build", str(build), "-j2", "--target", "dflash_mmvq_host", "dflash_mmvq_host_planted"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return {"good": build / "dflash_mmvq_host", "planted": build / "dflash_mmvq_host_planted"}


def quantize_q4_k(rows: np.ndarray, qmax: int = 15) -> np.ndarray:
    """Plain min/max Q4_K (qmax 15) or Q5_K (qmax 31) quantizer: per 32 values scale and min,
    6-bit codes per super-block."""
    n = rows.shape[0]
    b = rows.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(b.min(-1), 0.0), b.max(-1)
    scale, mn = (hi - lo) / qmax, -lo
    d, dmin = (scale.max(-1) / 63.0).astype(np.float16), (mn.max(-1) / 63.0).astype(np.float16)

    def code(v, step):
        step = step.astype(np.float32)[:, None]
        out = np.divide(v, step, out=np.zeros_like(v), where=step > 0)
        return np.clip(np.round(out), 0, 63).astype(np.uint8)

    sc, m = code(scale, d), code(mn, dmin)
    eff_scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    eff_min = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.divide(b + eff_min, eff_scale, out=np.zeros_like(b), where=eff_scale > 0)
    q = np.clip(np.round(q), 0, qmax).astype(np.uint8)
    scales = np.empty((b.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = ((q[:, 0::2, :] & 15) | ((q[:, 1::2, :] & 15) << 4)).reshape(-1, 128)
    blocks = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales]
    if qmax == 31:  # Q5_K: qh[l] bit j = fifth bit of value l of sub-block j
        qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
        blocks.append(qh)
    return np.concatenate(blocks + [qs], axis=1).reshape(n, -1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    return quantize_q4_k(rows, qmax=31)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Plain Q6_K quantizer: signed scale per 16 values (int8 codes of one half d per 256),
    q = round(v / scale) + 32 in 0..63; layout ql[128], qh[64], scales[16], d."""
    n = rows.shape[0]
    b = rows.reshape(-1, 16, 16).astype(np.float32)
    imax = np.abs(b).argmax(-1)[..., None]
    scale = np.take_along_axis(b, imax, -1)[..., 0] / -32.0  # signed, like ggml's make_qx_quants
    d = (np.abs(scale).max(-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), -128, 127)
    eff = (d32 * sc)[..., None]
    q = np.clip(np.round(np.divide(b, eff, out=np.zeros_like(b), where=eff != 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [half n, group g, l]: value 128n + 32g + l
    ql = ((q[:, :, 0:2, :] & 15) | ((q[:, :, 2:4, :] & 15) << 4)).reshape(-1, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    blocks = [ql, qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)]
    return np.concatenate(blocks, axis=1).reshape(n, -1)


OWN_QUANTIZERS = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k}


def make_weights(tname: str, rng: np.random.Generator) -> np.ndarray:
    rows = rng.standard_normal((ROWS, K)).astype(np.float32) * 0.05
    if tname in OWN_QUANTIZERS:
        return OWN_QUANTIZERS[tname](rows)
    return quants.quantize(rows, TYPES[tname])


def random_block_bytes(tname: str, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks: every quant bit pattern, scale fields set to sane values."""
    qk, size = quants.GGML_QUANT_SIZES[TYPES[tname]]
    b = rng.integers(0, 256, (ROWS * K // qk, size), dtype=np.uint8)
    sign = np.where(rng.integers(0, 2, (len(b), 1)) == 1, -1.0, 1.0)

    def half(lo: float, hi: float, sign: np.ndarray | float) -> np.ndarray:
        return (sign * rng.uniform(lo, hi, (len(b), 1))).astype(np.float16).view(np.uint8)

    if tname == "mxfp4":
        b[:, 0] = rng.integers(112, 136, len(b))
    elif tname in ("q4_k", "q5_k"):
        b[:, 0:2], b[:, 2:4] = half(0.001, 0.011, 1.0), half(0.001, 0.011, 1.0)
    elif tname == "q6_k":
        b[:, 208:210] = half(0.0002, 0.002, sign)
    else:
        b[:, 0:2] = half(0.002, 0.022, sign)
    return b.reshape(ROWS, -1)


def weight_terms(tname: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized weights (gguf) and |each term| before cancellation, to scale the tolerance."""
    deq = quants.dequantize(w, TYPES[tname]).astype(np.float64)
    if tname not in ("q4_k", "q5_k"):
        return deq, np.abs(deq)
    blocks = w.reshape(-1, 144 if tname == "q4_k" else 176)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:] if tname == "q4_k" else blocks[:, 48:]
    q = ((qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 8, 32)
    if tname == "q5_k":
        q = q | (((blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    mag = np.abs(d * sc)[..., None] * q + np.abs(dmin * m)[..., None]
    return deq, mag.reshape(ROWS, K)


def dequant_q8_1(raw: bytes, ncols: int) -> np.ndarray:
    a = np.frombuffer(raw, np.uint8).reshape(ncols, K // 32, 36)
    d = a[..., 0:2].copy().view(np.float16).astype(np.float64)
    return (d * a[..., 4:].view(np.int8)).reshape(ncols, K)


def run_host(binary: Path, tname: str, w: np.ndarray, x: np.ndarray, tmp: Path) -> tuple[np.ndarray, bytes]:
    ncols = x.shape[0]
    paths = {name: tmp / f"{name}-{ncols}.bin" for name in ("w", "x", "y", "xq")}
    w.tofile(paths["w"])
    x.astype(np.float32).tofile(paths["x"])
    cmd = [str(binary), "--type", tname, "--ncols", str(ncols), "--rows", str(ROWS), "--cols", str(K)]
    for name, flag in (("w", "--w"), ("x", "--x"), ("y", "--y"), ("xq", "--xq-out")):
        cmd += [flag, str(paths[name])]
    subprocess.run(cmd, check=True, capture_output=True)
    return np.fromfile(paths["y"], np.float32).reshape(ncols, ROWS), paths["xq"].read_bytes()


def relative_errors(tname: str, w: np.ndarray, y: np.ndarray, xq: bytes) -> np.ndarray:
    deq, mag = weight_terms(tname, w)
    xd = dequant_q8_1(xq, y.shape[0])
    ref, scale = xd @ deq.T, np.abs(xd) @ mag.T
    return np.abs(y - ref) / np.where(scale > 0, scale, 1.0)


def worst_error(host_bins, tmp_path, tname, w, ncols, rng) -> float:
    """The host body on `w` and random activations against gguf's dequantize-then-dot."""
    x = rng.standard_normal((ncols, K)).astype(np.float32)
    y, xq = run_host(host_bins["good"], tname, w, x, tmp_path)
    return float(relative_errors(tname, w, y, xq).max())


@pytest.mark.parametrize("ncols", [1, 2, 3, 4])
@pytest.mark.parametrize("tname", list(TYPES))
def test_matches_dequantize_then_dot(host_bins, tmp_path, tname, ncols):
    rng = np.random.default_rng(1000 * ncols + len(tname))
    err = worst_error(host_bins, tmp_path, tname, make_weights(tname, rng), ncols, rng)
    assert err <= REL_TOL, f"{tname} ncols={ncols}: worst relative error {err:.3e}"


@pytest.mark.parametrize("ncols", [1, 3])
@pytest.mark.parametrize("tname", list(TYPES))
def test_random_block_bytes_match_gguf_dequantize(host_bins, tmp_path, tname, ncols):
    """Every bit of each layout (signed Q6_K scales, high scale bits, fifth/sixth bits) decoded as gguf does."""
    rng = np.random.default_rng(31 * ncols + len(tname))
    err = worst_error(host_bins, tmp_path, tname, random_block_bytes(tname, rng), ncols, rng)
    assert err <= REL_TOL, f"{tname} random bytes ncols={ncols}: worst relative error {err:.3e}"


@pytest.mark.parametrize("random_bytes", [False, True])
@pytest.mark.parametrize("tname", list(TYPES))
def test_columns_bit_identical_across_ncols(host_bins, tmp_path, tname, random_bytes):
    rng = np.random.default_rng(7 + len(tname))
    w = random_block_bytes(tname, rng) if random_bytes else make_weights(tname, rng)
    x = rng.standard_normal((4, K)).astype(np.float32)
    singles = [run_host(host_bins["good"], tname, w, x[c : c + 1], tmp_path)[0][0] for c in range(4)]
    for ncols in (2, 3, 4):
        y, _ = run_host(host_bins["good"], tname, w, x[:ncols], tmp_path)
        for c in range(ncols):
            assert y[c].tobytes() == singles[c].tobytes(), f"{tname}: column {c} of ncols={ncols} differs from ncols=1"


@pytest.mark.parametrize("tname", NIBBLE_TYPES)
def test_planted_nibble_swap_fails_reference(host_bins, tmp_path, tname):
    rng = np.random.default_rng(99)
    w = make_weights(tname, rng)
    x = rng.standard_normal((2, K)).astype(np.float32)
    y, xq = run_host(host_bins["planted"], tname, w, x, tmp_path)
    assert relative_errors(tname, w, y, xq).max() > 100 * REL_TOL, "the planted nibble swap went unnoticed"


@pytest.mark.parametrize("tname", K_QUANTIZERS)
def test_own_quantizer_is_read_back_by_gguf(tname):
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((ROWS, K)).astype(np.float32)
    w = OWN_QUANTIZERS[tname](rows)
    assert w.shape == (ROWS, K // 256 * quants.GGML_QUANT_SIZES[TYPES[tname]][1])
    back = quants.dequantize(w, TYPES[tname])
    assert back.shape == rows.shape
    bound = {"q4_k": 0.1, "q5_k": 0.05, "q6_k": 0.03}[tname]  # 4, 5, 6 bits: error shrinks with each bit
    assert np.sqrt(np.mean((back - rows) ** 2)) < bound * rows.std()


def test_quantized_input_path_matches(host_bins, tmp_path):
    """--xq (pre-quantized q8_1, what a GPU self-test uploads) gives the same y as --x."""
    rng = np.random.default_rng(11)
    w = make_weights("mxfp4", rng)
    x = rng.standard_normal((3, K)).astype(np.float32)
    y, xq = run_host(host_bins["good"], "mxfp4", w, x, tmp_path)
    (tmp_path / "xq.bin").write_bytes(xq)
    out = tmp_path / "y2.bin"
    cmd = [str(host_bins["good"]), "--type", "mxfp4", "--ncols", "3", "--rows", str(ROWS), "--cols", str(K),
           "--w", str(tmp_path / "w-3.bin"), "--xq", str(tmp_path / "xq.bin"), "--y", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    assert out.read_bytes() == y.tobytes()


def test_selfcheck_and_bad_arguments(host_bins):
    done = subprocess.run([str(host_bins["good"]), "--selfcheck"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([str(host_bins["planted"]), "--selfcheck", "--expect-planted"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([str(host_bins["good"]), "--type", "q3_k", "--ncols", "1"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown --type" in done.stderr


class HostGpu:
    """Stands in for kernel_selftest._Gpu: checks each launch's name, grid, block and arguments
    against the buffers it was given, then answers with the host body run on exactly the uploaded
    weight and q8_1 bytes (`--xq`), as a correct GPU would. `corrupt`: kernel names whose output
    gets one bit flipped."""

    def __init__(self, binary: Path, tmp: Path, corrupt: frozenset[str] = frozenset()) -> None:
        self.binary, self.tmp, self.corrupt = binary, tmp, corrupt
        self.mem: dict[int, bytes] = {}
        self.launched: list[str] = []

    def buffer(self, data: bytes) -> int:
        self.mem[len(self.mem)] = data
        return len(self.mem) - 1

    def launch(self, name, grid, block, args) -> None:
        import ctypes

        from dflash.native import kernel_selftest as ks
        assert block == (32, 4, 1) and grid[1:] == (1, 1), (name, grid, block)
        m = re.fullmatch(r"dflash_mmvq_(\w+)_nc([1-4])", name)
        assert m and m[1] in ks.TYPES, name
        tname, ncols = m[1], int(m[2])
        w, xq, y = args[:3]
        assert all(isinstance(a, int) for a in (w, xq, y))
        assert [type(a) for a in args[3:]] == [ctypes.c_int32] * 2 + [ctypes.c_int64] * 3
        nbytes, nvals = ks.TYPES[tname]
        nblocks, nrows, w_row, x_col, y_col = (a.value for a in args[3:])
        assert nrows == grid[0] and w_row == nblocks * nbytes and len(self.mem[w]) == nrows * w_row
        assert x_col == nblocks * nvals // 32 and len(self.mem[xq]) == ncols * x_col * 36
        assert y_col == nrows and len(self.mem[y]) == 4 * ncols * nrows
        (self.tmp / "w.bin").write_bytes(self.mem[w])
        (self.tmp / "xq.bin").write_bytes(self.mem[xq])
        cmd = [str(self.binary), "--type", tname, "--ncols", str(ncols), "--rows", str(nrows),
               "--cols", str(nblocks * nvals), "--w", str(self.tmp / "w.bin"), "--xq", str(self.tmp / "xq.bin"),
               "--y", str(self.tmp / "y.bin")]
        subprocess.run(cmd, check=True, capture_output=True)
        out = bytearray((self.tmp / "y.bin").read_bytes())
        if name in self.corrupt:
            out[5] ^= 0x01
        self.mem[y] = bytes(out)
        self.launched.append(name)

    def read(self, ptr: int, nbytes: int) -> bytes:
        assert len(self.mem[ptr]) == nbytes
        return self.mem[ptr]

    def free(self, *ptrs: int) -> None:
        for p in ptrs:
            del self.mem[p]


def _selftest_on(host_bins, tmp_path, monkeypatch, corrupt=frozenset()):
    from dflash.native import devices, kernel_selftest
    build = tmp_path / "build"
    build.mkdir()
    (build / "dflash_mmvq_host").symlink_to(host_bins["good"])
    (build / "dflash_mmvq_gfx1201.hsaco").write_bytes(b"")
    gpu = HostGpu(host_bins["good"], tmp_path, corrupt)
    monkeypatch.setattr(kernel_selftest, "_Gpu", lambda index, co: gpu)
    dev = devices.Device("hip:0", "stand-in", "gfx1201", None, 0)
    return gpu, kernel_selftest.selftest(dev, 0, build)


def test_kernel_selftest_runs_every_dense_kernel_of_all_seven_types(host_bins, tmp_path, monkeypatch):
    """`dflash kernels selftest` launches each of the 28 dense kernels once (the seven types the
    code objects hold, this file's TYPES, x ncols 1..4) on host-made inputs of that type, and names
    the seven `_id` kernels it does not run."""
    from dflash.native import kernel_selftest
    gpu, rows = _selftest_on(host_bins, tmp_path, monkeypatch)
    dense = {f"dflash_mmvq_{t}_nc{n}" for t in TYPES for n in (1, 2, 3, 4)}
    assert sorted(gpu.launched) == sorted(dense) and {r["kernel"] for r in rows} == dense
    assert all(r["bit_identical"] for r in rows) and not gpu.mem  # every buffer freed
    assert set(kernel_selftest.NOT_COVERED) == {f"dflash_mmvq_{t}_id" for t in TYPES}


def test_kernel_selftest_reports_a_differing_kernel(host_bins, tmp_path, monkeypatch):
    bad = frozenset({"dflash_mmvq_q6_k_nc3", "dflash_mmvq_q5_0_nc1"})
    _, rows = _selftest_on(host_bins, tmp_path, monkeypatch, corrupt=bad)
    assert {r["kernel"] for r in rows if not r["bit_identical"]} == bad
    assert all(r["first_diff"] == 1 for r in rows if r["kernel"] in bad)  # byte 5: the second float


@pytest.mark.parametrize("tname", list(TYPES))
def test_kernel_selftest_weights_are_valid_blocks(tname):
    """The self-test's random weights decode to finite values in gguf, for every type."""
    from dflash.native import kernel_selftest
    nbytes, nvals = kernel_selftest.TYPES[tname]
    assert (nbytes, nvals) == (quants.GGML_QUANT_SIZES[TYPES[tname]][1], quants.GGML_QUANT_SIZES[TYPES[tname]][0])
    raw = kernel_selftest.random_weights(tname, 8, 512, np.random.default_rng(3))
    deq = quants.dequantize(np.frombuffer(raw, np.uint8).reshape(8, -1), TYPES[tname])
    assert deq.shape == (8, 512) and np.isfinite(deq).all() and np.abs(deq).max() > 0


def _nvidia_gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    done = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return done.returncode == 0 and "GPU" in done.stdout


CUDA_SELFTEST = KERNELS / "tests" / "cuda_selftest.cu"
NVCC_FLAGS = ["-std=c++17", "-O2", f"-I{KERNELS / 'include'}", f"-I{KERNELS / 'tests'}", "-Xcompiler",
              "-ffp-contract=off"]
SM90 = ["-gencode=arch=compute_90,code=sm_90"]  # H100/H200 machine code: ptxas runs, no GPU needed
ALL_KERNELS = {f"dflash_mmvq_{t}_{k}" for t in TYPES for k in ("nc1", "nc2", "nc3", "nc4", "id")}


def nvcc_compile(out: Path, *flags: str) -> Path:
    """cuda_selftest.cu compiled by the nvcc dflash's CUDA build uses (dflash.native.build._nvcc: PATH, then
    /usr/local/cuda/bin). No nvcc: a skip; nvcc there and the compile failing: a failure."""
    from dflash.native import build
    nvcc = build._nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on PATH or in /usr/local/cuda/bin: the CUDA self-test needs the CUDA toolkit")
    cmd = [nvcc, *NVCC_FLAGS, *flags, str(CUDA_SELFTEST), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def cuda_selftest_bins(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cuda_selftest")
    return {"good": nvcc_compile(d / "cuda_selftest", *SM90),
            "planted": nvcc_compile(d / "cuda_selftest_planted", *SM90, "-DDFLASH_MMVQ_PLANTED_BUG=1")}


def _selfcheck_lines(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in TYPES}


def test_cuda_selftest_compiles_for_sm90_and_runs_its_host_half(cuda_selftest_bins, host_bins):
    """Without a GPU: nvcc builds the CUDA self-test for sm_90 (device code through ptxas), and the
    binary's own host emulation, the side each GPU result is compared with, passes the host
    self-check for every type and gives the same output bits as the g++ build of the emulation.
    The planted twin fails it, so the check can fail. Launching the kernels needs a GPU
    (test_cuda_selftest_on_gpu); here the binary must say that it found none."""
    done = subprocess.run([str(cuda_selftest_bins["good"]), "--host-only"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    nvcc_lines = _selfcheck_lines(done.stdout)
    assert set(nvcc_lines) == set(TYPES)
    assert all("reference ok" in ln and "bit-identical: yes" in ln for ln in nvcc_lines.values()), done.stdout
    gxx = subprocess.run([str(host_bins["good"]), "--selfcheck"], capture_output=True, text=True, timeout=300)
    assert gxx.returncode == 0, gxx.stdout + gxx.stderr
    gxx_lines = _selfcheck_lines(gxx.stdout)
    for t in TYPES:
        assert nvcc_lines[t].split("bits ")[1] == gxx_lines[t].split("bits ")[1], (nvcc_lines[t], gxx_lines[t])
    planted = str(cuda_selftest_bins["planted"])
    assert subprocess.run([planted, "--host-only"], capture_output=True, timeout=300).returncode == 1
    caught = subprocess.run([planted, "--host-only", "--expect-planted"], capture_output=True, text=True, timeout=300)
    assert caught.returncode == 0, caught.stdout
    if not _nvidia_gpu_present():
        gpu_half = subprocess.run([str(cuda_selftest_bins["good"])], capture_output=True, text=True, timeout=300)
        assert gpu_half.returncode == 3 and "no CUDA device" in gpu_half.stdout, gpu_half.stdout + gpu_half.stderr


def ptx_problems(ptx: str) -> list[str]:
    """What keeps the CUDA kernels from the host emulation's bits: a kernel missing (or unknown), a
    fused multiply-add (one rounding where the emulation rounds twice), f32 subnormals flushed."""
    entries = set(re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.M))
    found = [f"kernels missing: {sorted(ALL_KERNELS - entries)}"] if ALL_KERNELS - entries else []
    found += [f"unknown kernels: {sorted(entries - ALL_KERNELS)}"] if entries - ALL_KERNELS else []
    for what, pattern in (("fused multiply-add", r"\bfma\.[\w.]*f32\b"), ("flush to zero", r"\.ftz\b")):
        n = len(re.findall(pattern, ptx))
        found += [f"{n} x {what}"] if n else []
    return found


def test_cuda_kernels_ptx_rounds_like_the_emulation(tmp_path):
    """The PTX nvcc makes of the 35 kernels (sm_90): every kernel, each float operation rounded once
    (mul/add/sub.rn, never fma), subnormals kept. A fast-math build (ftz) is caught."""
    good = nvcc_compile(tmp_path / "k.ptx", "-arch=compute_90", "-ptx").read_text()
    assert ptx_problems(good) == []
    assert len(re.findall(r"\b(?:mul|add|sub)\.rn\.f32\b", good)) > 100
    fast = nvcc_compile(tmp_path / "fast.ptx", "-arch=compute_90", "-ptx", "-use_fast_math").read_text()
    assert any("flush to zero" in p for p in ptx_problems(fast))


@pytest.mark.gpu
def test_cuda_selftest_on_gpu(tmp_path):
    """The GPU half: every kernel launched, bit for bit against this binary's host emulation."""
    if not _nvidia_gpu_present():
        pytest.skip("no NVIDIA GPU found by nvidia-smi: launching the kernels needs one (the compile and the "
                    "host half run in test_cuda_selftest_compiles_for_sm90_and_runs_its_host_half)")
    exe = nvcc_compile(tmp_path / "cuda_selftest", "-arch=native")
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda selftest: PASS" in done.stdout


ISA_KERNELS = ",".join(sorted(ALL_KERNELS))


@pytest.mark.skipif(shutil.which("clang++-19") is None or shutil.which("llvm-readelf-19") is None,
                    reason="clang++-19 and llvm-19 are not installed (scripts/setup installs them)")
@pytest.mark.parametrize("flush", [False, True])
def test_isa_check_sees_subnormal_flushing(tmp_path, flush):
    """The ISA check reads every kernel descriptor's FLOAT_DENORM_MODE_32: the kernels keep f32
    subnormals (as the host emulation does); a code object built to flush them is refused."""
    co, remarks = tmp_path / "k.hsaco", tmp_path / "k.remarks.txt"
    cmd = ["clang++-19", "-x", "hip", "--offload-arch=gfx1201", "--cuda-device-only", "--no-gpu-bundle-output",
           "-nogpulib", "-nogpuinc", "-O3", "-std=c++17", f"-I{KERNELS / 'include'}",
           "-Rpass-analysis=kernel-resource-usage", "-c", str(KERNELS / "src" / "dflash_mmvq.hip"), "-o", str(co)]
    if flush:
        cmd.append("-fgpu-flush-denormals-to-zero")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    remarks.write_text(r.stderr)
    check = subprocess.run(["cmake", f"-DCO={co}", "-DARCH=gfx1201", "-DREADELF=llvm-readelf-19",
                            "-DOBJDUMP=llvm-objdump-19", f"-DREMARKS={remarks}", "-DVGPR_BUDGET=80",
                            "-DMIN_OCCUPANCY=16", f"-DKERNELS={ISA_KERNELS}", "-P",
                            str(KERNELS / "cmake" / "check_isa.cmake")], capture_output=True, text=True)
    if flush:
        assert check.returncode != 0 and "FLOAT_DENORM_MODE_32 = 0" in check.stderr
    else:
        assert check.returncode == 0, check.stderr[-2000:]
        assert "f32 subnormals kept" in check.stderr
