"""`dflash devices`, `dflash kernels selftest` and `dflash kernels run`: what hardware is here, and
whether the narrow kernels give the host body's bits on it, or in the RDNA interpreter."""
from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import Command
from dflash.core.errors import DflashError, UsageError
from dflash.native import devices, kernel_run, kernel_selftest


@click.command("devices", cls=Command)
@click.option("--json", "as_json", is_flag=True)
def devices_command(as_json: bool) -> None:
    """List the CPU, every HIP device (name, gfx arch, memory, compute units) and every Vulkan
    device (name, driver and its version; Mesa's lavapipe included)."""
    hip, reason = devices.hip_devices()
    vulkan, vulkan_reason = devices.vulkan_devices()
    devs = [devices.cpu(), *hip, *vulkan]
    if as_json:
        output.emit_json({"devices": [d.to_json() for d in devs], "hip_available": bool(hip),
                          "hip_reason": reason, "vulkan_available": bool(vulkan), "vulkan_reason": vulkan_reason})
        return
    t = Table("id", "name", "arch", "memory", "compute units")
    for d in devs:
        mem = f"{d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "?"
        t.add_row(d.id, escape(d.name), escape(d.arch), mem, str(d.compute_units) if d.compute_units else "?")
    output.out.print(t)
    if reason:
        output.out.print(f"HIP: {reason}", highlight=False, markup=False)
    if vulkan_reason:
        output.out.print(f"Vulkan: {vulkan_reason}", highlight=False, markup=False)


@click.group("kernels")
def kernels_group() -> None:
    """The narrow-MMVQ HIP kernels."""


@kernels_group.command("selftest", cls=Command)
@click.option("--device", default="hip:0", show_default=True, help="HIP device to test.")
@click.option("--build-dir", default=str(kernel_selftest.DEFAULT_BUILD), show_default=True,
              help="Where cmake put the code objects and dflash_mmvq_host.")
@click.option("--json", "as_json", is_flag=True)
def selftest_command(device: str, build_dir: str, as_json: bool) -> None:
    """Run every dense kernel (all 7 weight types x ncols 1..4) on the GPU and compare with the host
    body bit for bit. The 7 routed-expert `_id` kernels are not run yet (listed in the output).

    Exit 0 all identical, 1 a difference or failure, 3 no HIP device."""
    ids = devices.parse_device(device)
    if len(ids) != 1:
        raise UsageError(f"--device {device!r}: the kernel self-test runs on one HIP device (hip:N)")
    dev = devices.require_hip(ids[:1])[0]
    with output.progress_bar("selftest") as progress:
        rows = kernel_selftest.selftest(dev, ids[0], Path(build_dir), progress)
    ok = all(r["bit_identical"] for r in rows)
    not_covered = kernel_selftest.NOT_COVERED
    if as_json:
        output.emit_json({"device": dev.to_json(), "results": rows, "ok": ok, "not_covered": not_covered})
    else:
        t = Table("kernel", "bit-identical", "first diff", "max |diff|", title=f"{dev.id} {dev.name} ({dev.arch})")
        for r in rows:
            t.add_row(r["kernel"], "yes" if r["bit_identical"] else "[red]no[/red]",
                      str(r["first_diff"]), f"{r['max_abs_diff']:.3g}")
        output.out.print(t)
        for reason in sorted(set(not_covered.values())):
            names = ", ".join(k for k, v in not_covered.items() if v == reason)
            output.out.print(f"not run: {names}: {reason}", highlight=False, markup=False)
    if not ok:
        raise DflashError("some kernels differ from the host body on this device")


@kernels_group.command("run", cls=Command)
@click.option("--arch", "archs", default=",".join(kernel_run.ARCHS), show_default=True,
              help="Code objects to run, comma-separated.")
@click.option("--type", "types", default=",".join(kernel_selftest.TYPES), show_default=True,
              help="Weight types, comma-separated.")
@click.option("--rows", default=8, show_default=True, help="Output rows (one workgroup each).")
@click.option("--cols", default=2048, show_default=True,
              help="Values per row, a multiple of 256 (2048: every lane of the 4 waves has slices).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random blocks and activations.")
@click.option("--planted", is_flag=True,
              help="Run the planted-order twin (dflash_mmvq_<arch>_planted_order.hsaco) instead: its ncols > 1 "
                   "kernels must differ.")
@click.option("--build-dir", default=str(kernel_selftest.DEFAULT_BUILD), show_default=True,
              help="Where cmake put the code objects and dflash_mmvq_host.")
@click.option("--json", "as_json", is_flag=True)
def run_command(archs: str, types: str, rows: int, cols: int, seed: int, planted: bool, build_dir: str,
                as_json: bool) -> None:
    """Execute every narrow-MMVQ kernel of the gfx1151 and gfx1201 code objects (dense ncols 1..4 and
    the routed-expert `_id`, every weight type) in dflash's RDNA instruction-level interpreter, on
    random blocks, and compare each output bit for bit with the host body and with the same column
    through `_nc1`. Emulated ISA: AMD's documented instruction semantics, not silicon.

    Exit 0 all identical, 1 a difference (--planted: expected), 2 bad arguments."""
    arch_list = [a.strip() for a in archs.split(",") if a.strip()]
    type_list = tuple(t.strip() for t in types.split(",") if t.strip())
    for a in arch_list:
        if a not in kernel_run.ARCHS:
            raise UsageError(f"--arch {a!r}: the code objects are built for {', '.join(kernel_run.ARCHS)}")
    for tname in type_list:
        if tname not in kernel_selftest.TYPES:
            raise UsageError(f"--type {tname!r}: one of {', '.join(kernel_selftest.TYPES)}")
    if rows < 1 or cols < 256 or cols % 256:
        raise UsageError("--rows must be at least 1 and --cols a positive multiple of 256")
    results: list[kernel_run.KernelRun] = []
    total = len(arch_list) * len(type_list) * 5
    with output.progress_bar("kernels", enabled=not as_json) as progress:
        def done(r: kernel_run.KernelRun) -> None:
            results.append(r)
            progress(len(results), total)
        for a in arch_list:
            kernel_run.run(a, Path(build_dir), type_list, rows, cols, seed, planted, done)
    ok = all(r.ok for r in results)
    if as_json:
        output.emit_json({"emulated_isa": True, "planted": planted, "rows": rows, "cols": cols, "seed": seed,
                          "results": [r.to_json() for r in results], "ok": ok,
                          "seconds": round(sum(r.seconds for r in results), 3)})
    else:
        t = Table("arch", "kernel", "= host", "= nc1", "first diff", "s", "instructions",
                  title="RDNA interpreter (emulated ISA)" + (": planted-order twin" if planted else ""))
        for r in results:
            t.add_row(r.arch, r.kernel, "yes" if r.identical_to_host else "[red]no[/red]",
                      "yes" if r.identical_to_nc1 else "[red]no[/red]", escape(r.first_diff or ""),
                      f"{r.seconds:.2f}", str(r.instructions))
        output.out.print(t)
    if not ok:
        raise DflashError(f"{sum(not r.ok for r in results)} of {len(results)} kernels differ"
                          + (" (the planted twin: expected)" if planted else ""))


commands = [devices_command, kernels_group]
