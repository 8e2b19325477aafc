"""`dflash verify`: check an evidence directory against its manifest, byte for byte."""
from __future__ import annotations

import re
from pathlib import Path

import click
from rich.markup import escape

from dflash.cli import output
from dflash.cli.options import Command
from dflash.core.errors import DflashError, UsageError
from dflash.proof import evidence


@click.command("verify", cls=Command)
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--manifest-sha256", "expected", default=None, metavar="HEX",
              help="Also require manifest.json to have this SHA-256 (the one quoted when it was written).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (exit 1 still means a problem).")
def command(directory: Path, expected: str | None, as_json: bool) -> None:
    """Verify the evidence directory DIRECTORY: every file's size and SHA-256, no unlisted files,
    the manifest's own checksum and its hash checks (e.g. identical responses across requests).

    Only real regular files inside DIRECTORY are read: a symlink, FIFO, device or socket in it is
    a problem. DIRECTORY itself may be a symlink.

    Exit codes: 0 verified; 1 any problem (the first is printed as one line naming the file);
    2 a missing DIRECTORY, one that is not a directory, or a malformed --manifest-sha256.
    """
    if expected is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", expected.strip()):
        raise UsageError(f"--manifest-sha256 {expected!r} is not 64 hex digits")
    report = evidence.verify(evidence.resolve_dir(directory), expected)
    if as_json:
        output.emit_json(report.to_json())
        if not report.ok:
            click.get_current_context().exit(1)
        return
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise DflashError(f"evidence {directory} failed verification: {report.problems[0]}{more}")
    for line in report.checks:
        output.out.print(f"[green]ok[/green]  {escape(line)}", highlight=False)
    output.out.print(f"verified {escape(str(directory))}: {report.n_files} files, "
                     f"{report.n_hash_checks} hash checks, "
                     f"manifest sha256 {report.manifest_sha256}", highlight=False)
