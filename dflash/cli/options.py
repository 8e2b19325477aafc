"""Options shared by several commands, the prompt they read, and the one place flags become a
Session (the environment's flags are read here, with Settings.from_env)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dflash.cli import output
from dflash.core import cpu_isa, settings
from dflash.core.errors import UsageError, arg
from dflash.model import gguf_meta, tiny_model
from dflash.run import engine
from dflash.session import Session

F = TypeVar("F", bound=Callable[..., Any])


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


def model_option(f: F) -> F:
    f = click.option("--weights", type=click.Choice(tiny_model.WEIGHTS), default=tiny_model.DEFAULT_WEIGHTS,
                     show_default=True, help="Weight types of the built-in tiny model (when no --model).")(f)
    return click.option("--model", "model", type=str, default=None,
                        help="GGUF model file (default: the built-in tiny DeepSeek-V4 model).")(f)


def prompt_options(f: F) -> F:
    f = click.option("--prompt-file", default=None,
                     help="Read the prompt from a UTF-8 file (- reads standard input).")(f)
    return click.option("--prompt", default=None,
                        help="Prompt text [default: a built-in prompt, 373 tokens on the tiny model].")(f)


def threads_option(f: F) -> F:
    return click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                        help=f"CPU threads, 1..{MAX_THREADS} [default: min(cores, 8)].")(f)


def ctx_option(f: F) -> F:
    return click.option("--ctx", type=click.IntRange(1, MAX_CTX), default=None,
                        help="Context size, at most the model's context length "
                             "[default: prompt + n-predict].")(f)


def _env_for_command(name: str) -> Callable[[click.Context, click.Parameter, object], None]:
    """A click callback making option value V the environment flag `name`=V for this command: every
    Settings.from_env of the command, and the workers it starts, see it; the previous value comes
    back when the command ends (--cpu, --indexer-tile)."""
    def callback(ctx: click.Context, param: click.Parameter, value: object) -> None:
        if value is None:
            return
        before = os.environ.get(name)
        os.environ[name] = str(value)

        def restore() -> None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
        ctx.call_on_close(restore)
    return callback


def cpu_option(f: F) -> F:
    return click.option("--cpu", type=click.Choice(cpu_isa.CPU_VARIANTS), default=None, expose_value=False,
                        callback=_env_for_command(settings.ENV_CPU), is_eager=True,
                        help=f"CPU build variant of the library (`dflash build --cpu`): native (-march=native), "
                             f"avx512, avx512-noamx or avx2 [default: native; env: {settings.ENV_CPU}].")(f)


def indexer_tile_option(f: F) -> F:
    return click.option("--indexer-tile", type=click.IntRange(0, settings.MAX_TILE), default=None,
                        expose_value=False, callback=_env_for_command(settings.ENV_TILE), is_eager=True, metavar="N",
                        help="DeepSeek-V4 (exact library): score and take the indexer's top-k over a ubatch's "
                             "query rows N at a time, bit-identical, so the score scratch follows N instead of "
                             f"the width; 0: the whole ubatch [default: 0; env: {settings.ENV_TILE}].")(f)


def lib_option(f: F) -> F:
    f = indexer_tile_option(cpu_option(f))
    return click.option("--lib", type=click.Choice(settings.LIBS), default="exact", show_default=True,
                        help="llama.cpp build: exact (batch-invariant) or stock (llama.cpp defaults).")(f)


def device_option(f: F) -> F:
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
                        help="cpu; hip:N, cuda:N or vulkan:N (every layer on that GPU; vulkan:N is the N-th device "
                             "`vulkaninfo --summary` lists, Mesa's lavapipe included); rpc:N (the N-th device of the "
                             "--rpc servers); several joined by commas split the layers evenly "
                             "(hip:0,hip:1; cpu,rpc:0: the CPU takes the first layers; rpc:0,rpc:1).")(f)


CHUNK_HELP = (f"Widest band: 1..{settings.MAX_BAND}, or up to {settings.MAX_CHUNK} or {settings.AUTO} "
              "(the widest width proven) "
              f"with a `dflash qualify` record for this library, model and device; those imply --bands")


def chunk_option(f: F) -> F:
    return click.option("--chunk", default=None, metavar="N|auto",
                        help=f"{CHUNK_HELP} [default: {settings.MAX_BAND}].")(f)


def run_options(f: F) -> F:
    """--chunk, --bands/--no-bands, --threads, --lib: how prefill runs."""
    f = lib_option(threads_option(f))
    f = click.option("--bands/--no-bands", default=None,
                     help=f"Use q2..q4 bands [default: q1; env: {settings.ENV_BANDS}].")(f)
    return chunk_option(f)


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """--prompt, or --prompt-file (- reads standard input), or the built-in prompt."""
    if prompt is not None and prompt_file is not None:
        raise UsageError(f"give {arg('prompt')} or {arg('prompt_file')}, not both")
    if prompt_file == "-":
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError("the prompt on standard input is not valid UTF-8") from None
        except OSError as e:
            raise UsageError(f"cannot read the prompt from standard input: {e.strerror}") from None
    elif prompt_file is not None:
        p = Path(prompt_file)
        problem = gguf_meta.path_problem(p)
        if problem:
            raise UsageError(f"prompt file {problem}: {prompt_file}")
        try:
            prompt = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read prompt file {prompt_file}: {e}") from None
    return engine.check_prompt(prompt)


def open_session(*, model: str | None, weights: str = tiny_model.DEFAULT_WEIGHTS, lib: str = "exact",
                 device: str = "cpu", rpc: str | None = None, allow_mixed_builds: bool = False,
                 no_repack: bool = False, **options: Any) -> Session:
    """The Session a command runs on: the environment's flags, libraries built on first use (with
    progress notes), warnings and notes on stderr."""
    return Session(model, weights=weights, lib=lib, device=device, rpc=rpc, allow_mixed_builds=allow_mixed_builds,
                   repack=not no_repack, settings=settings.Settings.from_env(lib=lib), build=True, log=output.note,
                   warn=output.warn, **options)


def parse_widths(text: str) -> list[int]:
    """--widths: distinct band widths in 1..4096, sorted."""
    try:
        ws = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--widths {text!r} is malformed (use e.g. 2,3,4)") from None
    if not ws or ws[0] < 1 or ws[-1] > settings.MAX_CHUNK:
        raise UsageError(f"--widths {text!r}: widths must be in 1..{settings.MAX_CHUNK}")
    return ws


def memory_budget_option(f: F) -> F:
    return click.option("--memory-budget", default=None, metavar="SIZE",
                        help="Bytes the run may allocate (weights, caches, compute; e.g. 96GiB): --chunk auto "
                             "takes the widest proven width that fits, a width that does not fit exits 2.")(f)
