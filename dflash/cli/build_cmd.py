"""`dflash build`: build (or locate) the cached llama.cpp libraries and llama-server binaries."""
from __future__ import annotations

import click

from dflash.cli import output
from dflash.cli.options import Command
from dflash.core import cpu_isa
from dflash.core.errors import DflashError
from dflash.native import build


@click.command("build", cls=Command)
@click.option("--lib", "libs", type=click.Choice(build.FLAVORS), multiple=True,
              help="Flavor(s) to build [default: exact and stock].")
@click.option("--gpu", type=click.Choice(["none", *build.GPU_BACKENDS]), default="none", show_default=True,
              help="hip: the ggml HIP backend with dflash's narrow kernels (needs ROCm >= 6.1); use the "
                   "printed folder as DFLASH_LLAMA_LIB_DIR. cuda: the same ggml-cuda sources for NVIDIA "
                   "(needs nvcc; cuBLAS comes from PyPI; CUDA_ARCHITECTURES, default 90-real: sm_90 code; "
                   "flash-attention kernels left out); --device cuda:N loads it. vulkan: ggml's Vulkan "
                   "backend (needs glslc, libvulkan-dev, spirv-headers: scripts/setup --vulkan installs them); "
                   "the exact flavor routes every product and attention one way at every width "
                   "(vulkan_kernels/README.md); --device vulkan:N loads it.")
@click.option("--compile-only", is_flag=True,
              help="With --gpu hip: compile the whole patched ggml-hip for gfx1151 and gfx1201 without ROCm "
                   "(clang 19, HIP headers from the triton wheel) and link it against link stubs; prints the "
                   "library (JSON key 'library'). Proves it builds; it runs only with ROCm's real libraries.")
@click.option("--server", is_flag=True,
              help="Build llama.cpp's llama-server (what `dflash serve` runs): the same pinned source with the "
                   "exact patch set and server/patches, linked against the exact library's ggml; it runs against "
                   "any flavor's library. Builds the exact library first when it is missing.")
@click.option("--cpu", type=click.Choice(build.CPU_VARIANTS), default="native", show_default=True,
              help="Instruction sets of the CPU backend: native (-march=native, llama.cpp's default), avx512 "
                   "(AVX-512 with VNNI, BF16, VBMI and AMX), avx512-noamx (the same without AMX: Zen 4/5), avx2 "
                   "(AVX2, FMA, F16C). A variant is llama.cpp's own GGML_<ISA> options; it builds only "
                   "libggml-cpu and sits beside copies of the native build's other libraries.")
@click.option("--check-isa", is_flag=True,
              help="Disassemble each library's libggml-cpu and check it holds its variant's instruction sets "
                   "and no others (exit 1 when not); JSON key 'isa'.")
@click.option("--json", "as_json", is_flag=True)
def command(libs: tuple[str, ...], gpu: str, compile_only: bool, server: bool, cpu: str, check_isa: bool,
            as_json: bool) -> None:
    """Build the exact and stock llama.cpp libraries, or with --server llama-server (cached, keyed by
    their inputs)."""
    if compile_only:
        if gpu != "hip" or libs or server:
            raise click.UsageError("--compile-only goes with --gpu hip and no --lib or --server")
        lib = build.build_hip_compile_only(log=output.note)
        if as_json:
            output.emit_json({"library": str(lib), "archs": list(build.HIP_ARCHS)})
        else:
            output.out.print(f"library: {lib}", highlight=False, markup=False)
        return
    if cpu != "native" and (gpu != "none" or server):
        raise click.UsageError("--cpu builds a CPU library: no --gpu or --server")
    if server:
        if libs or gpu != "none":
            raise click.UsageError("--server builds one llama-server for every flavor and backend: no --lib or --gpu")
        done: dict[str, object] = {"server": str(build.build_server(log=output.note))}
    else:
        done = {flavor: str(build.build_library(flavor, gpu, log=output.note, cpu=cpu))
                for flavor in libs or build.FLAVORS}
    problems: list[str] = []
    if check_isa:
        reports = {}
        for flavor in libs or build.FLAVORS:
            lib = build.library_dir(flavor, gpu, cpu) / "libggml-cpu.so"
            try:
                report = cpu_isa.disassemble(lib)
            except (OSError, RuntimeError) as e:
                raise DflashError(f"cannot disassemble {lib}: {e}") from None
            reports[flavor] = report.to_json(cpu)
            problems += [f"{flavor} {cpu}: {p}" for p in reports[flavor]["problems"]]
        done["isa"] = reports
    if as_json:
        output.emit_json(done)
    else:
        for flavor, d in done.items():
            if flavor == "isa" and isinstance(d, dict):
                for fl, r in d.items():
                    output.out.print(f"isa {fl} {cpu}: {', '.join(r['classes'])}"
                                     + (f" — {'; '.join(r['problems'])}" if r["problems"] else " (as expected)"),
                                     highlight=False, markup=False)
            else:
                output.out.print(f"{flavor}: {d}", highlight=False, markup=False)
    if problems:
        raise DflashError("the libraries do not hold their variant's instruction sets: " + "; ".join(problems))
