"""`dflash serve`: llama.cpp's own llama-server on the exact build, configured to stay exact."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from types import FrameType

import click

from dflash import serve as serve_lib
from dflash.cli import output
from dflash.cli.options import Command, lib_option, model_option
from dflash.core import settings
from dflash.serving import serve_config, server

DEFAULT_CTX = 4096


@click.command("serve", cls=Command,
               short_help="Serve a model with llama-server built from the exact patch set (OpenAI API).")
@model_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --allow-remote and --api-key.")
@click.option("--port", type=click.IntRange(1, 65535), default=serve_config.DEFAULT_PORT, show_default=True)
@click.option("--parallel", type=click.IntRange(1, serve_config.MAX_PARALLEL), default=None,
              help="Slots (requests decoded together) [default: the serve record's configuration, else 1]. "
                   "More than 1 needs a serve record that vouches for it (`dflash qualify --serve`).")
@click.option("--ubatch", type=click.IntRange(1, settings.MAX_CHUNK), default=None,
              help="Tokens per llama_decode (-b/-ub) [default: the serve record's, else the widest fixed width the "
                   "prefill record proves, else 1].")
@click.option("--ctx", type=click.IntRange(16, 1 << 24), default=DEFAULT_CTX, show_default=True,
              help="Context per slot, in tokens.")
@click.option("--threads", type=click.IntRange(1, 512), default=None, help="CPU threads [default: min(cores, 8)].")
@lib_option
@click.option("--device", default="cpu", show_default=True,
              help="cpu, or vulkan:N: every layer on that Vulkan device (exact library: flash attention on "
                   "and op offload off, as dflash prefill runs it). HIP, CUDA and RPC serving are not wired up yet.")
@click.option("--spec", default=serve_config.NO_SPEC, show_default=True, metavar="none|ngram|mtp|draft:MODEL",
              help="llama-server's speculative decoding: n-grams of the context, the model's next-n (MTP) layers, or a "
                   "draft model. Greedy responses stay identical to those without it; needs a serve record that "
                   "vouches for it (`dflash qualify --serve --spec ...`).")
@click.option("--api-key", default=None, help="Require this key (Authorization: Bearer KEY) on every request.")
@click.option("--allow-remote", is_flag=True, help="Listen on a non-loopback --host (also needs --api-key).")
@click.option("--allow-inexact", is_flag=True,
              help="Let in llama-server options known to break exactness, and slots no serve record vouches for.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line once the server answers.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED, metavar="[-- LLAMA-SERVER OPTIONS]")
def command(model: str | None, weights: str, host: str, port: int, parallel: int | None, ubatch: int | None,
            ctx: int, threads: int | None, lib: str, device: str, spec: str, api_key: str | None, allow_remote: bool,
            allow_inexact: bool, as_json: bool, extra: tuple[str, ...]) -> None:
    """Run llama.cpp's llama-server (built from the same patched source as the library, `dflash
    build --server`, on first use) with the settings that keep every response bit-identical to the
    same request run alone and cold: batches within a proven width, one KV stream per slot, a
    full-size sliding-window cache, no KV shifting, the prompt cache on. OpenAI-compatible
    endpoints (/v1/completions, /v1/chat/completions, /v1/models), /health and /metrics; every
    response names the build and model in system_fingerprint and carries dflash's fingerprints
    (`dflash`: response token ids and their SHA-256, the prompt's and the last prompt position's
    logits' SHA-256, as `dflash prefill --logits last --json` prints them).

    Options after `--` go to llama-server; those dflash sets are refused, and those known to break
    exactness (--cache-reuse N, -ctk/-ctv, synthetic draft acceptance, LoRA, RoPE overrides) are
    refused unless --allow-inexact; speculative decoding is --spec (llama-server's tuning options,
    such as --spec-ngram-simple-size-n, pass through). A llama-server that crashes is restarted
    (the requests in flight fail). Ctrl-C or SIGTERM stop it (exit 0)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    host, remote_warning = serve_config.bind_address(host, allow_remote, api_key)
    extra_args = list(extra)
    warnings = serve_config.check_extra(extra_args, allow_inexact)
    server.check_port(host, port)
    s = settings.Settings.from_env(lib=lib)
    target = serve_lib.target(model, weights=weights, lib=lib, device=device, extra=extra_args, settings=s,
                              build_missing=True, log=output.note)
    n_threads = threads or min(os.cpu_count() or 1, 8)
    config, entry = serve_lib.choose_config(target, parallel=parallel, ubatch=ubatch, ctx=ctx, threads=n_threads,
                                            allow_inexact=allow_inexact, note=output.note, spec=spec)
    for w in [*s.warnings(), *warnings, *([remote_warning] if remote_warning else [])]:
        output.warn(w)
    if entry is None:
        output.warn(f"no serve record vouches for --parallel {config.parallel} --ubatch {config.ubatch} on this "
                    f"build and model" + (" (running one slot)" if config.parallel == 1 else "")
                    + f": run `{serve_lib.qualify_command(target, config)}` to prove it")
    srv = target.server(config, host, port, api_key=api_key, log_line=_relay)
    url = f"http://{host}:{port}"
    fingerprint = target.check.fingerprint_for(config)
    info = {"url": url, "endpoint": f"{host}:{port}", "system_fingerprint": fingerprint, "spec": config.spec,
            "config": config.to_json(), "record": str(target.record_path) if entry else None,
            "vouched": entry is not None, "model": target.check.model, "server_binary": target.check.binary,
            "pid": os.getpid()}

    def ready(start: int) -> None:
        if start:
            output.note(f"llama-server restarted: serving {url} again")
            return
        if as_json:
            click.echo(json.dumps(info, separators=(", ", ": ")))
        else:
            vouch = f"vouched for by {target.record_path}" if entry else "no serve record vouches for it"
            spec_note = f" --spec {config.spec}" if config.spec != serve_config.NO_SPEC else ""
            output.out.print(f"dflash serve: {url} (OpenAI API at {url}/v1), system_fingerprint "
                             f"{fingerprint}; --parallel {config.parallel} --ubatch {config.ubatch}{spec_note} "
                             f"({vouch}); stop with Ctrl-C", highlight=False, markup=False)
        sys.stdout.flush()

    sys.exit(server.serve_forever(srv, stop, output.note, ready))


def _relay(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


commands = [command]
