"""`dflash records`: list, show and remove the records that change what dflash runs (qualification
records, which `--chunk auto` and `--chunk N > 4` read, and serve records, which `dflash serve`
reads), all under <cache_root()>/qualifications/."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import Command
from dflash.core.errors import UsageError
from dflash.proof import records
from dflash.serving import serve_record

_KEY = re.compile(r"(serve-)?[0-9a-f]{4,24}")


@dataclass(frozen=True)
class Entry:
    """One record file: its kind and key, and what it says (None with `error` when unreadable)."""
    kind: str    # "qualification" or "serve"
    key: str     # the file's name without .json (serve records: serve-<key>)
    path: Path
    data: dict[str, Any] | None
    error: str | None

    def summary(self) -> dict[str, Any]:
        d = self.data or {}
        out: dict[str, Any] = {"kind": self.kind, "key": self.key, "path": str(self.path), "error": self.error,
                               "device": d.get("device"), "model": (d.get("model") or {}).get("path"),
                               "updated_utc": d.get("updated_utc")}
        if self.kind == "qualification":
            out["library"] = d.get("library")
            out["exact_widths"] = [w["width"] for w in d.get("widths", []) if w["planner_exact"] or w["fixed_exact"]]
            out["inexact_widths"] = [w["width"] for w in d.get("widths", [])
                                     if not (w["planner_exact"] or w["fixed_exact"])]
        else:
            out["server"] = d.get("server")
            out["exact_parallel"] = [c["config"]["parallel"] for c in d.get("configs", []) if c["exact"]]
        return out


def read_all() -> list[Entry]:
    d = records.records_dir()
    found = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        kind = "serve" if p.name.startswith("serve-") else "qualification"
        try:
            raw = p.read_bytes()
            data = serve_record.parse(raw).to_json() if kind == "serve" else records.to_json(records.parse(raw))
            found.append(Entry(kind, p.stem, p, data, None))
        except (OSError, records.RecordError) as e:
            found.append(Entry(kind, p.stem, p, None, str(e).splitlines()[0]))
    return found


def pick(key: str, entries: list[Entry]) -> Entry:
    """The one record whose key (or serve-<key>) starts with `key`; a usage error otherwise."""
    key = key.strip().lower()
    if not _KEY.fullmatch(key):
        raise UsageError(f"record key {key!r} is not 4..24 hex digits (optionally after serve-)")
    hits = [e for e in entries if e.key.startswith(key) or e.key.startswith("serve-" + key)]
    if len(hits) != 1:
        what = "no record" if not hits else f"{len(hits)} records ({', '.join(e.key for e in hits)})"
        raise UsageError(f"{what} under {records.records_dir()} match {key!r} (`dflash records list` names them)")
    return hits[0]


@click.group("records")
def group() -> None:
    """List, show and remove qualification and serve records (<cache>/qualifications/).

    Qualification records (written by `dflash qualify`) let `--chunk auto` and `--chunk N` (N > 4)
    run what they prove; serve records (written by `dflash qualify --serve`) let `dflash serve` run
    the configuration they prove. Removing one takes that proof back: the next run refuses (or
    falls back to q1..q4) until the qualify command runs again."""


@group.command("list", cls=Command)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {\"folder\", \"records\": [...]}.")
def list_cmd(as_json: bool) -> None:
    """One line per record: kind, key, device, the widths (or server slots) proven exact, the model."""
    entries = [e.summary() for e in read_all()]
    if as_json:
        output.emit_json({"folder": str(records.records_dir()), "records": entries})
        return
    if not entries:
        output.out.print(f"no records under {escape(str(records.records_dir()))}", highlight=False)
        return
    t = Table("kind", "key", "device", "proven exact", "model", "updated")
    for e in entries:
        if e["error"]:
            t.add_row(e["kind"], e["key"], "", f"[red]unreadable: {escape(e['error'])}[/red]", "", "")
            continue
        proven = (", ".join(map(str, e["exact_widths"])) or "none") if e["kind"] == "qualification" else \
            "--parallel " + (", ".join(map(str, e["exact_parallel"])) or "none")
        t.add_row(e["kind"], e["key"], e["device"], proven, escape(str(e["model"])), e["updated_utc"])
    output.out.print(t)


@group.command("show", cls=Command)
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object (its file's form).")
def show_cmd(key: str, as_json: bool) -> None:
    """Show the record whose key starts with KEY (at least 4 hex digits)."""
    e = pick(key, read_all())
    if e.data is None:
        raise UsageError(f"{e.path} is unreadable: {e.error} (`dflash records remove {e.key}` deletes it)")
    if as_json:
        output.emit_json(e.data)
        return
    output.out.print(f"{e.kind} record {e.key}  ({escape(str(e.path))})", highlight=False)
    output.emit_json(e.data)


@group.command("remove", cls=Command)
@click.argument("keys", nargs=-1)
@click.option("--all", "remove_all", is_flag=True, help="Remove every record (qualification and serve).")
@click.option("--json", "as_json", is_flag=True, help="Print {\"removed\": [paths]}.")
def remove_cmd(keys: tuple[str, ...], remove_all: bool, as_json: bool) -> None:
    """Remove the records whose keys start with KEYS (or every record with --all)."""
    entries = read_all()
    if remove_all == bool(keys):
        raise UsageError("name the records to remove (KEY...) or pass --all, not both")
    chosen = entries if remove_all else [pick(k, entries) for k in keys]
    removed = []
    for e in chosen:
        e.path.unlink(missing_ok=True)
        removed.append(str(e.path))
    if as_json:
        output.emit_json({"removed": removed})
        return
    for p in removed:
        output.out.print(f"removed {escape(p)}", highlight=False)
    if not removed:
        output.out.print(f"no records under {escape(str(records.records_dir()))}", highlight=False)


commands = [group]
