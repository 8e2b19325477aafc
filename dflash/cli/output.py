"""Terminal output for commands: JSON for scripts, rich for people, progress on stderr."""
from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Not a terminal (pipes, CI logs): a wide fixed width so tables and hashes are not folded.
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 160)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def _finite(obj: Any) -> Any:
    """NaN and infinities become null: the output stays valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def describe_devices(devs: Iterable[Mapping[str, Any]]) -> str:
    """The devices of a run for people: 'cpu, rpc:0 = 127.0.0.1:50052 (exact-81ad…, serving cpu)'."""
    parts = []
    for d in devs:
        if "endpoint" in d:
            parts.append(f"{d['id']} = {d['endpoint']} ({d.get('build') or 'unknown build'}, "
                         f"serving {d.get('served_device') or '?'})")
        else:
            parts.append(d["id"] + (f" {d['name']} ({d['arch']})" if d.get("name") else ""))
    return ", ".join(parts)


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(_finite(obj), indent=2, allow_nan=False))


class HasJson(Protocol):
    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=HasJson)


def emit(result: R, as_json: bool, show: Callable[[R], None]) -> None:
    """A command's typed result: its one JSON form for --json, else `show` for people."""
    if as_json:
        emit_json(result.to_json())
    else:
        show(result)


def note(msg: str) -> None:
    err.print(f"[dim]{escape(msg)}[/dim]", highlight=False)


def warn(msg: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(msg)}", highlight=False)


@contextlib.contextmanager
def progress_bar(label: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """Yields progress(done, total); draws a bar on stderr when it is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done, total: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as p:
        task = p.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            p.update(task, completed=done, total=total)
        yield update
