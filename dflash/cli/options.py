"""Options shared by several commands, and the one place they become Settings."""
from __future__ import annotations

import click

from .. import devices, engine, qualification, settings, tiny_model
from .. import rpc as rpc_mod
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
                 device="cpu", remote: rpc_mod.Remote | None = None, repack: bool = True) -> settings.Settings:
    """Settings for a run. --chunk auto or N > 4 with bands not turned off first looks up what the
    qualification record of this library, model and device proves (see dflash/qualification.py)."""
    req = settings.parse_chunk(chunk)
    if req is None or not settings.needs_record(req) or bands is False:
        return settings.resolve(bands=bands, chunk=req, lib=lib)
    base = settings.resolve(bands=bands, lib=lib)  # environment and --lib checked before any hashing
    q = qualification.lookup(base, req, model, weights, device, warn=output.warn, note=output.note, remote=remote,
                             repack=engine.repack_for(devices.parse_spec(device), repack))
    return settings.resolve(bands=bands, chunk=req, lib=lib, qualified=q)
