"""The `dflash` entry point: commands that load llama.cpp run in a supervised worker process.

The parent imports only this, dflash/run/supervisor.py and dflash/core/stage.py; the worker (the same
command line, run as `python -m dflash ...` with DFLASH_WORKER set) imports the CLI and runs it.
"""
from __future__ import annotations

import sys

from dflash.core import stage
from dflash.run import supervisor

SUPERVISED = frozenset({"prefill", "bench", "qualify", "diff", "tiny-model", "devices", "kernels",
                        "rpc-server", "memory"})
LIVE_NATIVE_OUTPUT = frozenset({"rpc-server"})  # a server's log is passed on as it is written, not at exit


def worker_command(argv: list[str]) -> str | None:
    """The subcommand named in argv when it loads llama.cpp, else None."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a if a in SUPERVISED else None
    return None


def run_cli(argv: list[str]) -> None:
    """Run the CLI in this process (a worker, or a command that loads no llama.cpp)."""
    from dflash.cli import main as cli_main
    try:
        cli_main(argv)
    except SystemExit as e:
        stage.exiting(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
        raise


def main() -> None:
    """The `dflash` command."""
    argv = sys.argv[1:]
    command = worker_command(argv)
    if not stage.become_worker() and command is not None and "--help" not in argv and "-h" not in argv:
        sys.exit(supervisor.supervise([sys.executable, "-m", "dflash", *argv], live=command in LIVE_NATIVE_OUTPUT))
    run_cli(argv)


if __name__ == "__main__":
    main()
