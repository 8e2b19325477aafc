"""The narrow-MMVQ kernel body (hip_kernels/) on the CPU, checked against gguf's dequantizer.

The host binary runs the very template body the GPU kernels run, lane by lane, in the GPU's
reduction order (hip_kernels/include/dflash_mmvq/emulate.h). Weights are real GGUF block bytes:
gguf.quants.quantize for Q8_0 / Q4_0 / MXFP4, and for Q4_K (which gguf can only dequantize) the
small quantizer below, whose output gguf's dequantizer reads back.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "hip_kernels"
TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "mxfp4": Q.MXFP4}
NIBBLE_TYPES = ["q4_0", "q4_k", "mxfp4"]
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


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Plain min/max Q4_K quantizer: per 32 values scale and min, 6-bit codes per super-block."""
    n = rows.shape[0]
    b = rows.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(b.min(-1), 0.0), b.max(-1)
    scale, mn = (hi - lo) / 15.0, -lo
    d, dmin = (scale.max(-1) / 63.0).astype(np.float16), (mn.max(-1) / 63.0).astype(np.float16)

    def code(v, step):
        step = step.astype(np.float32)[:, None]
        out = np.divide(v, step, out=np.zeros_like(v), where=step > 0)
        return np.clip(np.round(out), 0, 63).astype(np.uint8)

    sc, m = code(scale, d), code(mn, dmin)
    eff_scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    eff_min = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.divide(b + eff_min, eff_scale, out=np.zeros_like(b), where=eff_scale > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8)
    scales = np.empty((b.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    blocks = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs]
    return np.concatenate(blocks, axis=1).reshape(n, -1)


def make_weights(tname: str, rng: np.random.Generator) -> np.ndarray:
    rows = rng.standard_normal((ROWS, K)).astype(np.float32) * 0.05
    if tname == "q4_k":
        return quantize_q4_k(rows)
    return quants.quantize(rows, TYPES[tname])


def weight_terms(tname: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized weights (gguf) and |each term| before cancellation, to scale the tolerance."""
    deq = quants.dequantize(w, TYPES[tname]).astype(np.float64)
    if tname != "q4_k":
        return deq, np.abs(deq)
    blocks = w.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    q = (blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    mag = np.abs(d * sc)[..., None] * q.reshape(-1, 8, 32) + np.abs(dmin * m)[..., None]
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


@pytest.mark.parametrize("ncols", [1, 2, 3, 4])
@pytest.mark.parametrize("tname", list(TYPES))
def test_matches_dequantize_then_dot(host_bins, tmp_path, tname, ncols):
    rng = np.random.default_rng(1000 * ncols + len(tname))
    w = make_weights(tname, rng)
    x = rng.standard_normal((ncols, K)).astype(np.float32)
    y, xq = run_host(host_bins["good"], tname, w, x, tmp_path)
    err = relative_errors(tname, w, y, xq)
    assert err.max() <= REL_TOL, f"{tname} ncols={ncols}: worst relative error {err.max():.3e}"


@pytest.mark.parametrize("tname", list(TYPES))
def test_columns_bit_identical_across_ncols(host_bins, tmp_path, tname):
    rng = np.random.default_rng(7 + len(tname))
    w = make_weights(tname, rng)
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


def test_q4_k_quantizer_is_read_back_by_gguf():
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((ROWS, K)).astype(np.float32)
    back = quants.dequantize(quantize_q4_k(rows), Q.Q4_K)
    assert back.shape == rows.shape
    assert np.sqrt(np.mean((back - rows) ** 2)) < 0.1 * rows.std()


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
    done = subprocess.run([str(host_bins["good"]), "--type", "q5_k", "--ncols", "1"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown --type" in done.stderr


def _nvidia_gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    done = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return done.returncode == 0 and "GPU" in done.stdout


@pytest.mark.gpu
def test_cuda_selftest_on_gpu(tmp_path):
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc not found: the CUDA self-test needs the CUDA toolkit")
    if not _nvidia_gpu_present():
        pytest.skip("no NVIDIA GPU found by nvidia-smi: the CUDA self-test needs one")
    exe = tmp_path / "cuda_selftest"
    cmd = [nvcc, "-std=c++17", "-O2", "-arch=native", f"-I{KERNELS / 'include'}", f"-I{KERNELS / 'tests'}",
           "-Xcompiler", "-ffp-contract=off", str(KERNELS / "tests" / "cuda_selftest.cu"), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
