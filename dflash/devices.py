"""Devices: the CPU always, AMD GPUs through hip-python when a ROCm runtime and a device exist.

hip-python imports without ROCm; its first call raises RuntimeError when libamdhip64.so is
missing, and hipGetDeviceCount returns hipErrorNoDevice when the runtime finds no GPU. Both
become a plain reason string here, never a traceback.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass

from .errors import NoDeviceError, UsageError


@dataclass(frozen=True)
class Device:
    id: str              # "cpu" or "hip:N"
    name: str
    arch: str            # gfx1201, gfx1151, ... or the CPU's machine type
    memory_bytes: int | None
    compute_units: int

    def to_json(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", errors="replace"):
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu() -> Device:
    name = cpu_model()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return Device("cpu", name, platform.machine(), mem, os.cpu_count() or 1)


def _check(result):
    """hip-python returns (err, value...) tuples; raise on a non-success code."""
    from hip import hip
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != hip.hipError_t.hipSuccess:
        raise RuntimeError(hip.hipGetErrorName(err)[1].decode() if isinstance(hip.hipGetErrorName(err), tuple)
                           else str(err))
    return rest[0] if len(rest) == 1 else rest


def hip_devices() -> tuple[list[Device], str | None]:
    """(devices, reason): reason says why the list is empty."""
    try:
        from hip import hip
    except ImportError as e:
        return [], f"hip-python is not installed ({e.name})"
    try:
        err, count = hip.hipGetDeviceCount()
    except RuntimeError as e:
        if "libamdhip64" in str(e):
            return [], "no ROCm runtime (libamdhip64.so not found)"
        return [], f"the HIP runtime failed to start: {str(e).splitlines()[0]}"
    if err != hip.hipError_t.hipSuccess or count == 0:
        return [], f"the ROCm runtime found no HIP device ({getattr(err, 'name', err)})"
    out = []
    for i in range(count):
        props = _check(hip.hipGetDeviceProperties(i))  # hip-python returns (err, props)
        arch = props.gcnArchName.decode() if isinstance(props.gcnArchName, bytes) else str(props.gcnArchName)
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        out.append(Device(f"hip:{i}", name, arch.split(":")[0], int(props.totalGlobalMem),
                          int(props.multiProcessorCount)))
    return out, None


GPU_KINDS = ("hip", "cuda")


def device_kind(spec: str) -> str:
    """'cpu', 'hip' or 'cuda' (the kind of every device `spec` names; see parse_device)."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return "cpu"
    kinds = {part.split(":", 1)[0] for part in spec.split(",")}
    if len(kinds) != 1 or not kinds <= set(GPU_KINDS):
        raise UsageError(f"--device {spec!r} is malformed (use cpu, hip:N, hip:N,hip:M, cuda:N or cuda:N,cuda:M)")
    return kinds.pop()


def parse_device(spec: str) -> list[int]:
    """'cpu' -> []; 'hip:0' or 'cuda:0' -> [0]; 'hip:0,hip:1' (layer split) -> [0, 1]."""
    kind = device_kind(spec)
    if kind == "cpu":
        return []
    ids = []
    for part in spec.strip().lower().split(","):
        number = part.partition(":")[2]
        if not number.isdigit():
            raise UsageError(f"--device {spec!r} is malformed (use cpu, hip:N, hip:N,hip:M, cuda:N or cuda:N,cuda:M)")
        ids.append(int(number))
    if len(set(ids)) != len(ids):
        raise UsageError(f"--device {spec!r} names a device twice")
    return ids


def cuda_devices() -> tuple[list[Device], str | None]:
    """NVIDIA GPUs as nvidia-smi lists them (arch sm_XY), or ([], the reason there are none)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no NVIDIA driver (nvidia-smi not found)"
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,compute_cap,memory.total,multiprocessor_count",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi failed: {e}"
    if r.returncode != 0:
        return [], f"nvidia-smi found no GPU ({(r.stderr or r.stdout).strip().splitlines()[:1] or ['no output']})"
    out = []
    for line in r.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        mem = int(float(fields[3]) * 2**20) if fields[3].replace(".", "", 1).isdigit() else None
        cus = int(fields[4]) if fields[4].isdigit() else 0
        out.append(Device(f"cuda:{fields[0]}", fields[1], "sm_" + fields[2].replace(".", ""), mem, cus))
    return (out, None) if out else ([], "nvidia-smi lists no GPU")


def require_gpu(spec: str) -> list[Device]:
    """The GPUs `spec` names (hip:N or cuda:N), or NoDeviceError (exit 3) saying why they are not
    there; [] for the CPU."""
    kind, ids = device_kind(spec), parse_device(spec)
    if kind == "cpu":
        return []
    return require_hip(ids) if kind == "hip" else _pick("cuda", "CUDA", cuda_devices(), ids)


def require_hip(ids: list[int]) -> list[Device]:
    """The named HIP devices, or NoDeviceError (exit 3) saying why they are not there."""
    return _pick("hip", "HIP", hip_devices(), ids)


def _pick(kind: str, label: str, found: tuple[list[Device], str | None], ids: list[int]) -> list[Device]:
    devs, reason = found
    if not devs:
        raise NoDeviceError(f"no {label} device: {reason}")
    missing = [i for i in ids if i >= len(devs)]
    if missing:
        raise NoDeviceError(f"{kind}:{missing[0]} does not exist ({len(devs)} {label} device(s) present)")
    return [devs[i] for i in ids]
