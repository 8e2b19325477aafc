"""`dflash plan`: show the bands for a prompt length and where each downshift comes from."""
from __future__ import annotations

import click
from rich.table import Table

from dflash.cli import output
from dflash.cli.options import Command, chunk_option, device_option, lib_option
from dflash.core import settings
from dflash.core.errors import UsageError
from dflash.model import gguf_meta
from dflash.native import devices
from dflash.native import rpc as rpc_mod
from dflash.proof import choice, records
from dflash.run.bands import FULL, Q1, Band, fixed_bands, plan, positive_ratios, widths

DS4_RATIOS = "4,128"


def parse_ratios(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--ratios {text!r} is malformed (use e.g. 4,128 or none)") from None
    if any(v < 0 for v in vals):
        raise UsageError(f"--ratios {text!r} has a negative ratio")
    return vals


def band_dict(b: Band) -> dict:
    return {"start": b.start, "width": b.width, "kernel": b.kernel, "reason": b.reason, "ratio": b.ratio}


@click.command("plan", cls=Command)
@click.option("--n-tokens", type=click.IntRange(min=0), required=True, help="Tokens to prefill.")
@click.option("--start", type=click.IntRange(min=0), default=0, show_default=True,
              help="First position (non-zero: a resumed prefill).")
@click.option("--ratios", default=None, help=f"Compress ratios, e.g. 4,128, or none [default: {DS4_RATIOS}].")
@click.option("--model", default=None,
              help="Take the ratios from this GGUF instead (and, for --chunk auto or N > 4, its "
                   "qualification record).")
@chunk_option
@click.option("--bands/--no-bands", default=None, help="Override DFLASH_DS4_EXACT_PREFILL_BANDS.")
@lib_option
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(n_tokens: int, start: int, ratios: str | None, model: str | None, chunk: str | None, bands: bool | None,
            lib: str, device: str, rpc: str | None, allow_mixed_builds: bool, no_repack: bool, as_json: bool) -> None:
    """Show the prefill bands for N tokens from a position.

    --chunk auto or N > 4 needs --model: the qualification record of that model, --lib and
    --device decides the width and whether bands cross compressor boundaries (no library is loaded)."""
    if ratios is not None and model is not None:
        raise UsageError("give --ratios or --model, not both")
    if model is None and bands is not False and settings.needs_record(settings.parse_chunk(chunk)):
        raise UsageError(f"--chunk {chunk} needs --model (with --lib and --device): the qualification "
                         f"record that proves a width is per library, model and device")
    remote = rpc_mod.connect(rpc, devices.parse_spec(device).rpc_ids, allow_mixed_builds)  # records name their builds
    s = choice.choose(settings.Settings.from_env(lib=lib).env, bands=bands, chunk=chunk, lib=lib, model=model,
                      device=device, remote=remote, repack=not no_repack, warn=output.warn, note=output.note)
    s, beyond = records.for_prompt(s, start + n_tokens)  # a record covers prompts up to a length
    extra = [beyond] if beyond else []
    for w in extra:  # on stderr, and among the JSON's warnings
        output.warn(w)
    rs = gguf_meta.read(model).compress_ratios if model else parse_ratios(ratios or DS4_RATIOS)
    if s.fixed:  # the record proved bands of this width across compressor boundaries
        chosen = fixed_bands(n_tokens, s.cap, start, s.mmvq_max_ncols)
    else:
        chosen = plan(n_tokens, start, rs, s.cap, s.bands, s.mmvq_max_ncols)
    band_mode = "fixed" if s.fixed else "planner"
    if as_json:
        output.emit_json({"n_tokens": n_tokens, "start": start, "ratios": list(positive_ratios(rs)),
                          "bands_on": s.bands, "cap": s.cap, "mmvq_max_ncols": s.mmvq_max_ncols,
                          "chunk_requested": s.chunk_requested, "band_mode": band_mode,
                          "qualification": s.qualified.to_json() if s.qualified else None,
                          "widths": widths(chosen), "bands": [band_dict(b) for b in chosen],
                          "warnings": s.warnings() + extra})
        return
    for w in s.warnings():
        output.warn(w)
    mode = f"bands on, cap {s.cap}" if s.bands else "bands off (q1)"
    if s.qualified:
        mode += f" ({band_mode} bands proven by {s.qualified.path})"
    output.out.print(f"{len(chosen)} bands for {n_tokens} tokens from {start}; {mode}; ratios "
                     f"{','.join(map(str, positive_ratios(rs))) or 'none'}; narrow ceiling {s.mmvq_max_ncols}",
                     highlight=False, markup=False)
    output.out.print("widths: " + " ".join(map(str, widths(chosen))), highlight=False, markup=False)
    shifts = [b for b in chosen if b.reason not in (FULL, Q1)]
    if shifts:
        t = Table("start", "width", "kernel", "downshift", title="downshifts")
        for b in shifts:
            why = f"{b.reason} (ratio {b.ratio})" if b.ratio else b.reason
            t.add_row(str(b.start), str(b.width), b.kernel, why)
        output.out.print(t)
