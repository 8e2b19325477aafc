"""Options shared by several commands, and the one place they become Settings."""
from __future__ import annotations

import click

from .. import devices, engine, memory, qualification, settings, tiny_model
from .. import rpc as rpc_mod
from ..errors import UsageError
from . import output


class Command(click.Command):
    """A dflash command: an option or argument given as an empty (or all-blank) string is a usage
    error, never a silent default."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        for p in self.params:
            value = ctx.params.get(p.name) if p.name else None
            if isinstance(value, str) and not value.strip():
                name = p.opts[0] if isinstance(p, click.Option) else p.human_readable_name
                raise click.UsageError(f"{name} is empty", ctx)
        return rest


MAX_THREADS, MAX_CTX = engine.MAX_THREADS, engine.MAX_CTX


def model_option(f):
    f = click.option("--weights", type=click.Choice(tiny_model.WEIGHTS), default=tiny_model.DEFAULT_WEIGHTS,
                     show_default=True, help="Weight types of the built-in tiny model (when no --model).")(f)
    return click.option("--model", "model", type=str, default=None,
                        help="GGUF model file (default: the built-in tiny DeepSeek-V4 model).")(f)


def prompt_options(f):
    f = click.option("--prompt-file", default=None,
                     help="Read the prompt from a UTF-8 file (- reads standard input).")(f)
    return click.option("--prompt", default=None,
                        help="Prompt text [default: a built-in prompt, 373 tokens on the tiny model].")(f)


def threads_option(f):
    return click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                        help=f"CPU threads, 1..{MAX_THREADS} [default: min(cores, 8)].")(f)


def ctx_option(f):
    return click.option("--ctx", type=click.IntRange(1, MAX_CTX), default=None,
                        help="Context size, at most the model's context length "
                             "[default: prompt + n-predict].")(f)


def lib_option(f):
    return click.option("--lib", type=click.Choice(settings.LIBS), default="exact", show_default=True,
                        help="llama.cpp build: exact (batch-invariant) or stock (llama.cpp defaults).")(f)


def device_option(f):
    """--device, and the RPC servers its rpc:N devices live on (--rpc, --allow-mixed-builds)."""
    f = click.option("--no-repack", is_flag=True,
                     help="Keep weights in plain CPU buffers (no AMX or repacked copies), as llama.cpp's "
                          "--no-repack: the kernels a CPU served over RPC runs (runs with rpc:N always do).")(f)
    f = click.option("--allow-mixed-builds", is_flag=True,
                     help="Use RPC servers that run another library build than this client (exactness is "
                          "claimed within one build; qualify such a setup).")(f)
    f = click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                     help="RPC servers (`dflash rpc-server`) whose devices --device names as rpc:N, "
                          "in this order.")(f)
    return click.option("--device", default="cpu", show_default=True,
                        help="cpu; hip:N or cuda:N (every layer on that GPU); rpc:N (the N-th device of the "
                             "--rpc servers); several joined by commas split the layers evenly "
                             "(hip:0,hip:1; cpu,rpc:0: the CPU takes the first layers; rpc:0,rpc:1).")(f)


def connect_remote(device: str, rpc: str | None, allow_mixed_builds: bool) -> rpc_mod.Remote | None:
    """Parse --device and handshake with every --rpc server before anything is built or loaded."""
    return rpc_mod.connect(rpc, devices.parse_spec(device).rpc_ids, allow_mixed_builds)


CHUNK_HELP = (f"Widest band: 1..{settings.MAX_BAND}, or up to {settings.MAX_CHUNK} or {settings.AUTO} "
              "(the widest width proven) "
              f"with a `dflash qualify` record for this library, model and device; those imply --bands")


def chunk_option(f):
    return click.option("--chunk", default=None, metavar="N|auto",
                        help=f"{CHUNK_HELP} [default: {settings.MAX_BAND}].")(f)


def run_options(f):
    """--chunk, --bands/--no-bands, --threads, --lib: how prefill runs."""
    f = lib_option(threads_option(f))
    f = click.option("--bands/--no-bands", default=None,
                     help=f"Use q2..q4 bands (overrides {settings.ENV_BANDS}; default: the env flag, else q1).")(f)
    return chunk_option(f)


def settings_from(bands, chunk, lib="exact") -> settings.Settings:
    return settings.resolve(bands=bands, chunk=chunk, lib=lib)


def run_settings(bands, chunk, lib="exact", *, model=None, weights=tiny_model.DEFAULT_WEIGHTS,
                 device="cpu", remote: rpc_mod.Remote | None = None, repack: bool = True,
                 budget: memory.Budget | None = None) -> settings.Settings:
    """Settings for a run. --chunk auto or N > 4 with bands not turned off first looks up what the
    qualification record of this library, model and device proves (see dflash/qualification.py).
    With a --memory-budget, auto takes the widest proven width that fits it (without a record: 4,
    or the widest narrower one that fits), and a width that does not fit is a usage error."""
    s = _run_settings(bands, chunk, lib, model=model, weights=weights, device=device, remote=remote,
                      repack=repack, budget=budget)
    if budget is None:
        return s
    if s.chunk_requested == settings.AUTO and s.qualified is None and s.bands:
        fitting = [w for w in range(s.chunk, 0, -1) if budget.fits(w)]  # 4, 3, 2, 1: no record needed
        if fitting and fitting[0] != s.chunk:
            output.note(f"--chunk auto: width {s.chunk} does not fit --memory-budget, running {fitting[0]}")
            s = settings.resolve(bands=True, chunk=fitting[0], lib=lib)
    budget.require(s.cap)
    return s


def _run_settings(bands, chunk, lib, *, model, weights, device, remote, repack, budget) -> settings.Settings:
    req = settings.parse_chunk(chunk)
    if req is None or not settings.needs_record(req) or bands is False:
        return settings.resolve(bands=bands, chunk=req, lib=lib)
    base = settings.resolve(bands=bands, lib=lib)  # environment and --lib checked before any hashing
    q = qualification.lookup(base, req, model, weights, device, warn=output.warn, note=output.note, remote=remote,
                             repack=engine.repack_for(devices.parse_spec(device), repack),
                             fits=budget.fits if budget is not None else None)
    return settings.resolve(bands=bands, chunk=req, lib=lib, qualified=q)


def parse_widths(text: str) -> list[int]:
    """--widths: distinct band widths in 1..512, sorted."""
    try:
        ws = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--widths {text!r} is malformed (use e.g. 2,3,4)") from None
    if not ws or ws[0] < 1 or ws[-1] > settings.MAX_CHUNK:
        raise UsageError(f"--widths {text!r}: widths must be in 1..{settings.MAX_CHUNK}")
    return ws


def memory_budget_option(f):
    return click.option("--memory-budget", default=None, metavar="SIZE",
                        help="Bytes the run may allocate (weights, caches, compute; e.g. 96GiB): --chunk auto "
                             "takes the widest proven width that fits, a width that does not fit exits 2.")(f)


def open_budget(memory_budget: str | None, text: str, *, bands, chunk, model, weights, device, remote, repack, lib,
                threads, n_predict: int, ctx: int | None) -> memory.Budget | None:
    """--memory-budget: the request's context sized by llama.cpp's no_alloc estimate (the model's
    metadata only, before its weights load) for the widths a run may pick. None without a budget.
    The estimate loads the library the run then uses, with the same flags exported (a library
    reads them once): bands on exactly when the run's will be."""
    if memory_budget is None:
        return None
    limit = memory.parse_size(memory_budget)
    on = True if bands is None and settings.needs_record(settings.parse_chunk(chunk)) else bands
    est = engine.open_engine(settings.resolve(bands=on, lib=lib), model, threads=threads, weights=weights,
                             device=device, remote=remote, repack=repack, no_alloc=True, mmap=False, log=output.note)
    n_ctx = est.context_size(len(est.tokenize(text)), n_predict, ctx)
    return memory.Budget(est, n_ctx, limit)


def budgeted_settings(memory_budget: str | None, text: str, bands, chunk, lib, *, model, weights, device, remote,
                      repack: bool, threads, n_predict: int, ctx: int | None) -> tuple[settings.Settings, dict | None]:
    """run_settings under --memory-budget (when given), and the budget's record for --json and
    evidence (None without one). The estimate's model is freed before the run loads its own."""
    budget = open_budget(memory_budget, text, bands=bands, chunk=chunk, model=model, weights=weights, device=device,
                         remote=remote, repack=repack, lib=lib, threads=threads, n_predict=n_predict, ctx=ctx)
    try:
        s = run_settings(bands, chunk, lib, model=model, weights=weights, device=device, remote=remote, repack=repack,
                         budget=budget)
        return s, budget.to_json(s.cap) if budget is not None else None
    finally:
        if budget is not None:
            budget.close()

