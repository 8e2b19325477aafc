"""Devices: the CPU always, AMD GPUs through hip-python when a ROCm runtime and a device exist.

hip-python imports without ROCm; its first call raises RuntimeError when libamdhip64.so is
missing, and hipGetDeviceCount returns hipErrorNoDevice when the runtime finds no GPU. Both
become a plain reason string here, never a traceback.
"""
from __future__ import annotations

import os
import platform
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


def parse_device(spec: str) -> list[int]:
    """'cpu' -> []; 'hip:0' -> [0]; 'hip:0,hip:1' (layer split) -> [0, 1]."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return []
    ids = []
    for part in spec.split(","):
        if not part.startswith("hip:") or not part[4:].isdigit():
            raise UsageError(f"--device {spec!r} is malformed (use cpu, hip:N or hip:N,hip:M)")
        ids.append(int(part[4:]))
    if len(set(ids)) != len(ids):
        raise UsageError(f"--device {spec!r} names a device twice")
    return ids


def require_hip(ids: list[int]) -> list[Device]:
    """The named HIP devices, or NoDeviceError (exit 3) saying why they are not there."""
    devs, reason = hip_devices()
    if not devs:
        raise NoDeviceError(f"no HIP device: {reason}")
    missing = [i for i in ids if i >= len(devs)]
    if missing:
        raise NoDeviceError(f"hip:{missing[0]} does not exist ({len(devs)} HIP device(s) present)")
    return [devs[i] for i in ids]
