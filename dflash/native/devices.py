"""Devices: the CPU always, AMD GPUs through hip-python when a ROCm runtime and a device exist,
NVIDIA GPUs through nvidia-smi, Vulkan devices (Mesa's lavapipe included) through vulkaninfo.

hip-python imports without ROCm; its first call raises RuntimeError when libamdhip64.so is
missing, and hipGetDeviceCount returns hipErrorNoDevice when the runtime finds no GPU. Both
become a plain reason string here, never a traceback.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dflash.core.errors import NoDeviceError, UsageError, arg


@dataclass(frozen=True)
class Device:
    id: str              # "cpu", "hip:N", "cuda:N" or "vulkan:N"
    name: str
    arch: str            # gfx1201, gfx1151, ...; a Vulkan device's driver and its version; the CPU's machine type
    memory_bytes: int | None
    compute_units: int

    def to_json(self) -> dict[str, Any]:
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


def _check(result: object) -> Any:  # hip-python's values are untyped
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


GPU_KINDS = ("hip", "cuda", "vulkan")
_SPEC_HELP = ("use cpu, hip:N, cuda:N or vulkan:N, rpc:N (a device of a --rpc server), or a layer split of those "
              "joined by commas, e.g. hip:0,hip:1, cpu,rpc:0 or rpc:0,rpc:1")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed --device: where the model's layers go.

    entries: the canonical parts in the order given ("cpu", "hip:0", "rpc:1", ...). The CPU holds
    every layer not offloaded; named alone it holds all of them, in a split it takes the first
    layers (llama.cpp offloads the last ones). A split spreads layers evenly over its parts."""
    entries: tuple[str, ...]

    @property
    def kind(self) -> str:
        """The local library's backend: 'hip', 'cuda', 'vulkan', or 'cpu' (also for CPU + RPC devices)."""
        kinds = {e.split(":", 1)[0] for e in self.entries} & set(GPU_KINDS)
        return kinds.pop() if kinds else "cpu"

    @property
    def gpu_ids(self) -> list[int]:
        return [int(e.split(":", 1)[1]) for e in self.entries if e.split(":", 1)[0] in GPU_KINDS]

    @property
    def rpc_ids(self) -> list[int]:
        return [int(e.split(":", 1)[1]) for e in self.entries if e.startswith("rpc:")]

    @property
    def cpu_share(self) -> bool:
        """The CPU takes layers in a split (named with other devices)."""
        return "cpu" in self.entries and len(self.entries) > 1

    @property
    def by_device_list(self) -> bool:
        """Placed by an explicit device list (RPC devices, or the CPU in a split) rather than by
        GPU index and tensor split alone."""
        return bool(self.rpc_ids) or self.cpu_share

    def __str__(self) -> str:
        return ",".join(self.entries)


def parse_spec(spec: str) -> DeviceSpec:
    """--device: cpu | hip:N | cuda:N | vulkan:N | rpc:N, or several joined by commas (a layer split); one GPU
    kind per run (one library); no device twice."""
    text = spec.strip().lower()
    entries = []
    for part in text.split(","):
        part = part.strip()
        kind, sep, number = part.partition(":")
        if part == "cpu":
            entries.append("cpu")
        elif kind in (*GPU_KINDS, "rpc") and sep and number.isdigit():
            entries.append(f"{kind}:{int(number)}")
        else:
            raise UsageError(f"{arg('device')} {spec!r} is malformed ({_SPEC_HELP})")
    if len(set(entries)) != len(entries):
        raise UsageError(f"{arg('device')} {spec!r} names a device twice")
    if len({e.split(":", 1)[0] for e in entries} & set(GPU_KINDS)) > 1:
        raise UsageError(f"{arg('device')} {spec!r} mixes GPU backends (one library per run)")
    return DeviceSpec(tuple(entries))


def device_kind(spec: str, remote_devices: Sequence[str | None] = ()) -> str:
    """'cpu', 'hip', 'cuda' or 'vulkan': the backend of the library a run with this --device loads.
    With no local GPU and RPC servers that all serve a Vulkan device (`remote_devices`: each
    server's --device, None for one that does not say), the Vulkan build: a client runs the build
    its servers run (exactness is claimed within one build), and that build holds the CPU and RPC
    backends as well."""
    kind = parse_spec(spec).kind
    if kind == "cpu" and remote_devices and all(d is not None and parse_spec(d).kind == "vulkan"
                                                for d in remote_devices):
        return "vulkan"
    return kind


def parse_device(spec: str) -> list[int]:
    """The local GPU indices --device names: 'cpu' -> []; 'hip:0' -> [0]; 'hip:0,hip:1' -> [0, 1]."""
    return parse_spec(spec).gpu_ids


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


def vulkan_devices() -> tuple[list[Device], str | None]:
    """Vulkan devices in the loader's order (what vulkan:N numbers), as `vulkaninfo --summary` lists
    them, CPU drivers (Mesa's lavapipe) included; or ([], the reason there are none). The arch is the
    driver and its version ("llvmpipe Mesa 22.3.6 (LLVM 15.0.6)", "radv Mesa 25.0.7"): what a
    qualification record keys, since the driver compiles the shaders."""
    tool = shutil.which("vulkaninfo")
    if tool is None:
        return [], "vulkaninfo not found (apt-get install vulkan-tools mesa-vulkan-drivers)"
    try:
        r = subprocess.run([tool, "--summary"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"vulkaninfo failed: {e}"
    return parse_vulkaninfo(r.stdout) or ([], "vulkaninfo lists no Vulkan device (no driver: apt-get install "
                                              "mesa-vulkan-drivers for lavapipe, or your GPU's)")


def parse_vulkaninfo(text: str) -> tuple[list[Device], None] | None:
    """The devices of `vulkaninfo --summary`'s "Devices:" section (GPU0:, GPU1:, ... blocks)."""
    blocks: list[dict[str, str]] = []
    for line in text.split("Devices:", 1)[-1].splitlines():
        s = line.strip()
        if re.fullmatch(r"GPU\d+:", s):
            blocks.append({})
        elif blocks and "=" in s:
            key, _, value = s.partition("=")
            blocks[-1][key.strip()] = value.strip()
    out = [Device(f"vulkan:{i}", b.get("deviceName", "?"),
                  " ".join(x for x in (b.get("driverName"), b.get("driverInfo")) if x) or "unknown driver",
                  None, 0) for i, b in enumerate(blocks)]
    return (out, None) if out else None


def require_gpu(spec: str) -> list[Device]:
    """The local GPUs `spec` names (hip:N, cuda:N or vulkan:N), or NoDeviceError (exit 3) saying why
    they are not there; [] when it names none."""
    kind, ids = device_kind(spec), parse_device(spec)
    if kind == "cpu":
        return []
    if kind == "vulkan":
        return _pick("vulkan", "Vulkan", vulkan_devices(), ids)
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
