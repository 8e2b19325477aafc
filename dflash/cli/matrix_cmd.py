"""`dflash matrix`: one prompt across threads, libraries and devices; a table of hash equality."""
from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import Command, chunk_option, cpu_option, read_prompt
from dflash.compare import matrix
from dflash.core import settings
from dflash.core.errors import NotExactError
from dflash.core.results import MatrixResult
from dflash.model import gguf_meta
from dflash.native import rpc as rpc_mod
from dflash.proof import choice


@click.command("matrix", cls=Command)
@cpu_option
@click.option("--model", default=None, help="GGUF model [default: the built-in tiny model].")
@click.option("--prompt-file", default=None, help="Prompt file [default: the built-in prompt].")
@chunk_option
@click.option("--n-predict", type=click.IntRange(min=0), default=8, show_default=True)
@click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
              help="RPC servers (`dflash rpc-server`): adds rows with every layer remote, the CPU and a remote "
                   "device split, and two remote devices split.")
@click.option("--allow-mixed-builds", is_flag=True, help="Use RPC servers running another library build.")
@click.option("--json", "as_json", is_flag=True)
def command(model: str | None, prompt_file: str | None, chunk: str | None, n_predict: int, rpc: str | None,
            allow_mixed_builds: bool, as_json: bool) -> None:
    """Compare q1 and band fingerprints across CPU threads, exact/stock builds, GPUs and RPC servers.

    Rows on plain CPU buffers (RPC rows, and their local reference `cpu t1 exact no-repack`) are
    compared with that reference; the others with `cpu t1 exact`. Exits 4 when any exact-library
    configuration differs from its reference."""
    remote = rpc_mod.connect(rpc, [0], allow_mixed_builds) if rpc else None  # one line if a server is down
    # a bad --chunk or env flag, or no record for --chunk N > 4 on the exact CPU library, fails
    # here, not in every row (each row looks up its own library's and device's record)
    if model:
        gguf_meta.read(model)  # a bad model is one error here, not a failure in every row
    text = read_prompt(None, prompt_file) if prompt_file else None  # read once (standard input too)
    flags = settings.Settings.from_env()
    s = choice.choose(flags.env, bands=True, chunk=chunk, model=model, warn=output.warn, note=output.note)
    with output.progress_bar("matrix") as progress:
        result = matrix.run(n_predict, s.chunk_requested, model=model, prompt=text, progress=progress,
                            remote=remote, settings=flags)
    output.emit(result, as_json, show)
    if not result.exact_all_equal:
        raise NotExactError("an exact-library configuration differs from the reference")


def show(r: MatrixResult) -> None:
    yes = lambda b: "[green]=[/green]" if b else "[red]≠[/red]"
    t = Table("configuration", "q1 logits", "band logits", "response", "q1 = bands", "= reference",
              title=f"fingerprints (reference: {r.reference}, q1; plain-buffer rows: their own, see --help)")
    for d in r.rows:
        if not d.ran or d.q1_logits_sha256 is None or d.logits_sha256 is None or d.response_sha256 is None:
            t.add_row(d.config, "[red]failed[/red]", escape(d.error or ""), "", "", "")
            continue
        t.add_row(d.config, d.q1_logits_sha256[:12], d.logits_sha256[:12], d.response_sha256[:12],
                  yes(d.q1_equals_bands), yes(d.logits_equal_reference and d.response_equal_reference))
    output.out.print(t)
    for s in r.skipped:
        output.out.print(f"skipped {s.config}: {s.reason}", highlight=False, markup=False)
    output.out.print("exact library: " + ("[green]every configuration equal[/green]" if r.exact_all_equal
                                          else "[red]configurations differ[/red]"))
