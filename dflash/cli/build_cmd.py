"""`dflash build`: build (or locate) the cached llama.cpp libraries."""
from __future__ import annotations

import click

from .. import build
from . import output
from .options import Command


@click.command("build", cls=Command)
@click.option("--lib", "libs", type=click.Choice(build.FLAVORS), multiple=True,
              help="Flavor(s) to build [default: exact and stock].")
@click.option("--gpu", type=click.Choice(["none", "hip"]), default="none", show_default=True,
              help="hip: the ggml HIP backend with dflash's narrow kernels (needs ROCm >= 6.1); "
                   "use the printed folder as DFLASH_LLAMA_LIB_DIR.")
@click.option("--json", "as_json", is_flag=True)
def command(libs, gpu, as_json):
    """Build the exact and stock llama.cpp libraries (cached, keyed by their inputs)."""
    done = {}
    for flavor in libs or build.FLAVORS:
        done[flavor] = str(build.build_library(flavor, gpu, log=output.note))
    if as_json:
        output.emit_json(done)
    else:
        for flavor, d in done.items():
            output.out.print(f"{flavor}: {d}", highlight=False, markup=False)
