"""The `dflash` command group. Domain errors become one-line messages and exit codes here only;
an error names the library's arguments, which are shown as this CLI's flags (chunk -> --chunk).

Exit codes: 0 ok, 1 runtime error (a crash inside llama.cpp included), 2 usage error, 3 no GPU
device, 4 an exactness check failed (results differ bit for bit), 130 interrupted.
"""
from __future__ import annotations

import sys
import traceback

import click

from dflash.core.errors import DflashError
from dflash.core.settings import ENV_DOCS, debug_flag
from dflash.core.stage import Interrupted

EPILOG = ("Exit codes: 0 ok; 1 runtime error (a crash inside llama.cpp included); 2 bad input; 3 no GPU "
          "device; 4 an exactness check failed (--compare-q1, bench, sweep, matrix: results differ bit for bit); "
          "130 interrupted.\n\n\b\nEnvironment flags (read by every command; a flag named beside one overrides it):\n"
          + "\n".join(f"  {name:<31} {doc}" for name, doc in ENV_DOCS.items()))


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from dflash.cli import version
    click.echo(version.text(version.facts()))
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors [env: DFLASH_DEBUG].")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show dflash's version, the llama.cpp commit it builds and this host's build keys, and exit.")
def cli(debug: bool) -> None:
    """dflash: exact, faster prefill for llama.cpp models."""


def _register() -> None:
    from dflash.cli import (
        bench_cmd,
        build_cmd,
        devices_cmd,
        diff_cmd,
        matrix_cmd,
        memory_cmd,
        plan_cmd,
        prefill_cmd,
        qualify_cmd,
        records_cmd,
        rpc_cmd,
        serve_cmd,
        sweep_cmd,
        tiny_cmd,
        verify_cmd,
    )
    for mod in (plan_cmd, prefill_cmd, bench_cmd, sweep_cmd, verify_cmd, qualify_cmd, diff_cmd, matrix_cmd,
                devices_cmd, tiny_cmd, build_cmd, rpc_cmd, memory_cmd, serve_cmd, records_cmd):
        for c in getattr(mod, "commands", None) or [mod.command]:
            cli.add_command(c)


_register()


def _fail(kind: str, msg: str, code: int) -> None:
    click.echo(f"dflash: {kind}: {msg}".splitlines()[0], err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        debug = "--debug" in args or debug_flag()
    except DflashError as e:  # a malformed DFLASH_DEBUG is a usage error like any other flag
        _fail("usage error", e.render(), e.exit_code)
    try:
        rv = cli.main(args=args, prog_name="dflash", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt, Interrupted):
        _fail("error", "interrupted", 130)
    except click.UsageError as e:
        _fail("usage error", e.format_message(), 2)
    except click.ClickException as e:
        _fail("error", e.format_message(), e.exit_code)
    except DflashError as e:
        if debug:
            traceback.print_exc()
        _fail("usage error" if e.exit_code == 2 else "error", e.render(), e.exit_code)
    except OSError as e:  # a read-only cache, a full disk, ...: name the file, not "internal error"
        if debug:
            traceback.print_exc()
        where = e.filename if e.filename is not None else ""
        _fail("error", f"{e.strerror or type(e).__name__}" + (f": {where}" if where else "")
              + (f" -> {e.filename2}" if e.filename2 else ""), 1)
    except Exception as e:  # an unforeseen failure still gets one line (after the traceback with --debug)
        if debug:
            traceback.print_exc()
        _fail("internal error", f"{type(e).__name__}: {e} (rerun with --debug for a traceback)", 1)
    sys.exit(rv if isinstance(rv, int) else 0)
