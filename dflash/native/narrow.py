"""Which weight types the HIP build's batch-invariant narrow path covers (hip_kernels/README.md).

A HIP build of the exact library routes MUL_MAT / MUL_MAT_ID with 1..LUCE_MMVQ_MAX_NCOLS columns
to dflash's narrow kernels (quantized types) or to ggml's own MMVF (F32/F16/BF16), on RDNA3,
RDNA3.5 and RDNA4 only. A weight of any other type runs ggml's stock kernels, whose result for a
column may depend on the batch width: `dflash qualify` and `dflash prefill` name those types.
On the CPU this says nothing (the CPU kernels are a different story, cpu_kernels/README.md).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

# GGUF/ggml type names. Keep in step with dflash_mmvq_type_ok / dflash_mmvf_type in
# hip_kernels/ggml/dflash-mmvq.cu.
NARROW_KERNEL_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_K", "MXFP4", "Q6_K", "Q5_K", "Q5_0"})
MMVF_TYPES = frozenset({"F32", "F16", "BF16"})
COVERED_WEIGHT_TYPES = NARROW_KERNEL_TYPES | MMVF_TYPES

# The architectures the hooks route on: GGML_CUDA_CC_IS_RDNA3 / _RDNA4 (gfx11xx, gfx12xx) in the
# HIP build, every NVIDIA GPU (sm_XY) in the CUDA flavor (GGML_DFLASH_MMVQ_CUDA).
ROUTED_ARCH_PREFIXES = ("gfx11", "gfx12", "sm_")


def arch_routed(arch: str) -> bool:
    return arch.startswith(ROUTED_ARCH_PREFIXES)


def uncovered_weight_types(weight_types: Mapping[str, int], archs: Iterable[str],
                           narrow: bool = True) -> dict[str, int]:
    """The model's tensor types (name -> tensor count) that run outside the narrow path on the
    selected GPU(s) `archs` (empty: the CPU, nothing to say). With the hooks switched off
    (DFLASH_NARROW_MMVQ=0), or on a GPU the hooks do not route on, that is every type."""
    gpus = list(archs)
    if not gpus:
        return {}
    everything = not narrow or not all(arch_routed(a) for a in gpus)
    return {t: n for t, n in sorted(weight_types.items()) if everything or t not in COVERED_WEIGHT_TYPES}


def describe(uncovered: Mapping[str, int]) -> str:
    """'Q6_K (12 tensors), IQ4_XS (3)': the largest count first."""
    items = sorted(uncovered.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{t} ({n} tensor{'s' if n != 1 else ''})" if i == 0 else f"{t} ({n})"
                     for i, (t, n) in enumerate(items))


def reason(archs: Iterable[str], narrow: bool = True) -> str:
    """Why every type is uncovered, when it is ('' otherwise)."""
    if not narrow:
        return " (DFLASH_NARROW_MMVQ=0: every dflash hook is off)"
    other = sorted({a for a in archs if not arch_routed(a)})
    return f" ({', '.join(other)}: the hooks route on RDNA3/3.5/4 and NVIDIA only)" if other else ""


def warning(uncovered: Mapping[str, int], device: str, archs: Iterable[str] = (), narrow: bool = True) -> str | None:
    """The one warning line for `uncovered`, or None when everything is covered."""
    if not uncovered:
        return None
    return (f"weights outside the batch-invariant narrow path on {device}{reason(archs, narrow)}: "
            f"{describe(uncovered)}; their products run ggml's stock kernels, which may differ between "
            f"band widths")
