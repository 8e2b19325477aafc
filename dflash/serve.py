"""dflash serving as a library: the llama-server a model is served by, the configuration that
keeps it exact, and its qualification. `dflash serve`, `dflash qualify --serve` and
benchmarks/serve.py stand on these.

    import dflash.serve as ds

    target = ds.target(None, build=True)               # the built-in tiny model, exact flavor
    config, entry = ds.choose_config(target, parallel=None, ubatch=None, ctx=4096, threads=2)
    with target.server(config) as s:                   # llama-server on a free loopback port
        print(s.url)

Like dflash.Session it reads the environment only through `settings` and builds only when asked.
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash.core.errors import LibraryNotBuilt, UsageError, arg
from dflash.core.settings import AUTO, FIXED, Settings
from dflash.core.sha_cache import file_sha256
from dflash.model import gguf_meta, tiny_model
from dflash.native import build, devices, library_id
from dflash.proof import records
from dflash.proof.provenance import default_evidence_dir
from dflash.run import engine
from dflash.serving import serve_config, serve_record, server
from dflash.serving import serve_workload as workload
from dflash.serving.serve_check import ServeQualifyResult, Target, prefill_with, qualify_serve
from dflash.session import Session

Say = Callable[[str], None]
MAX_BODY_BYTES = 16 << 20  # the largest request body llama-server accepts from dflash serve (413 above)
# llama-server reads any of its options from LLAMA_ARG_* variables: none reach it from the caller's
# environment (dflash sets what it runs on the command line)
_SERVER_ENV_PREFIX = "LLAMA_ARG_"

__all__ = ["ServeTarget", "choose_config", "qualify", "target"]


def _quiet(msg: str) -> None:
    pass


@dataclass(frozen=True)
class ServeTarget:
    """A model served by one flavor's llama-server, with the flags the library reads (the same the
    server's copy of the library reads: they go into its environment)."""
    check: Target
    settings: Settings
    weights: str = tiny_model.DEFAULT_WEIGHTS
    given_model: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def identity(self) -> serve_record.Identity:
        return serve_record.Identity(self.check.flavor, self.check.build_id, self.check.model_sha256,
                                     self.check.device_label)

    @property
    def flash_attn(self) -> str:
        return serve_config.flash_attn_for(self.check.device, self.check.flavor)

    @property
    def record_path(self) -> Path:
        return serve_record.record_path(self.identity)

    def server(self, config: serve_config.ServeConfig, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None, log_line: Say = _quiet) -> server.Server:
        """A llama-server for `config` (not started: use it as a context manager, or start())."""
        return self.check.make_server(config, self.env, host, port, api_key, log_line)


def target(model: str | None = None, *, weights: str = tiny_model.DEFAULT_WEIGHTS, lib: str = "exact",
           device: str = "cpu", extra: Sequence[str] = (), settings: Settings | None = None,
           build_missing: bool = False, log: Say = _quiet) -> ServeTarget:
    """What `dflash serve` runs: llama-server (built with build_missing, else LibraryNotBuilt) on
    the flavor's library, the model (the built-in tiny one when None) and its SHA-256."""
    spec = devices.parse_spec(device)
    if spec.entries != ("cpu",) and not (spec.kind == "vulkan" and len(spec.entries) == 1):
        raise UsageError(f"{arg('device')} {device!r}: dflash serve runs on the CPU or on one Vulkan device "
                         f"(vulkan:N); HIP, CUDA, RPC and layer splits are not wired up for serving yet")
    kind = spec.kind
    gpus = devices.require_gpu(str(spec))  # exit 3 with the reason, before any build
    label = " ".join([str(spec), *(f"{d.name} / {d.arch}" for d in gpus)])
    s = settings or Settings.from_env({}, lib=lib)
    if not build_missing and not build.server_built():
        raise LibraryNotBuilt("llama-server is not built yet: run `dflash build --server` (several minutes, once), "
                              "or pass build_missing=True")
    gpu = "none" if kind == "cpu" else kind
    lib_dir = engine.library_dir(s, log, gpu, build_missing=build_missing)
    binary = build.build_server(log=log)
    if model is None and tiny_model.needs_quantizer(weights):
        engine.gpu_index(spec)  # what a Vulkan library lists is fixed when it loads
        engine.load_library(s, log, gpu, build_missing=build_missing)  # its quantizer writes the preset
    path = engine.resolve_model(model, weights)
    if model is not None:
        records.model_file(model, weights)  # a readable GGUF, or a one-line error
    _, library_key = library_id.library_key(s, kind)
    check = Target(str(binary), str(lib_dir), str(path), lib, library_key, build.server_key(),
                   file_sha256(str(path)), str(spec), tuple(extra), label)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SERVER_ENV_PREFIX)}
    env.update({**s.library_env(), **build.server_env(lib, gpu, lib_dir=lib_dir),
                "DFLASH_SYSTEM_FINGERPRINT": check.fingerprint, "DFLASH_MAX_BODY_BYTES": str(MAX_BODY_BYTES)})
    if kind == "vulkan":
        env["GGML_VK_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_ids)
    env.pop(serve_config.CHECKPOINT_ENV, None)
    every = serve_config.checkpoint_every(gguf_meta.read(path).compress_ratios)
    if every and kind == "vulkan":
        # a DeepSeek-V4 context restored from a checkpoint on ggml-vulkan computes the next tokens
        # with other bits than the run that made the checkpoint (measured on lavapipe: the same
        # 4 tokens after restoring the state at 69 of a 73-token prompt; identical on the CPU, cause
        # not found): no checkpoints and no RAM prompt cache (it restores saved states too), so a
        # request re-evaluates its whole prompt
        check = replace(check, checkpoints=False)
    elif every:
        env[serve_config.CHECKPOINT_ENV] = str(every)
    return ServeTarget(check, s, weights, model, env)


def check_spec(t: ServeTarget, spec: str) -> str:
    """The canonical --spec value, after checking it fits the target (a one-line UsageError
    otherwise): `mtp` needs a model with next-n layers, `draft:MODEL` a readable GGUF, and
    DeepSeek-V4 on a Vulkan device no speculation (a rejected draft restores a checkpoint, which
    ggml-vulkan does not restore exactly: see target())."""
    spec = serve_config.parse_spec(spec)
    if spec == serve_config.NO_SPEC:
        return spec
    if not t.check.checkpoints:
        raise UsageError(f"{arg('spec')} {spec}: a rejected draft on this model restores a saved state, and on "
                         f"{t.check.device} restored DeepSeek-V4 states do not compute what the run that saved "
                         f"them computes; speculate on the CPU")
    if spec == "mtp" and not gguf_meta.read(t.check.model).nextn_layers:
        raise UsageError(f"{arg('spec')} mtp: {t.check.model} has no next-n (multi-token prediction) layers "
                         f"(the tiny model gets one with `dflash tiny-model --mtp`)")
    if spec.startswith("draft:"):
        draft = Path(spec[len("draft:"):]).resolve()
        gguf_meta.read(draft)  # a readable GGUF, or a one-line error
        spec = f"draft:{draft}"  # records and fingerprints name one file whatever the working directory
    return spec


def _prefill_width(t: ServeTarget) -> int:
    """The widest width the prefill record proves in fixed-width runs (those cross compressor
    boundaries, as llama-server's batches do), 1 without one."""
    q = records.lookup(t.settings, AUTO, t.given_model, t.weights, t.check.device, _quiet, _quiet)
    return q.width if q is not None and q.mode == FIXED else 1


def qualify_command(t: ServeTarget, config: serve_config.ServeConfig) -> str:
    """The `dflash qualify --serve` command whose record vouches for `config` on this target: the same
    model (or tiny-model weights), flavor, device, options that enter the library key, and llama-server
    options."""
    parts = ["dflash qualify --serve", f"--parallel {config.parallel}", f"--ubatch {config.ubatch}"]
    if config.spec != serve_config.NO_SPEC:
        parts.append(f"--spec {shlex.quote(config.spec)}")
    if t.given_model:
        parts.append(f"--model {shlex.quote(t.given_model)}")
    elif t.weights != tiny_model.DEFAULT_WEIGHTS:
        parts.append(f"--weights {t.weights}")
    if t.check.flavor != "exact":
        parts.append(f"--lib {t.check.flavor}")
    if t.check.device != "cpu":
        parts.append(f"--device {shlex.quote(t.check.device)}")
    options = records.graph_options(t.settings)
    env = [o for o in options if "=" in o]
    parts += [o for o in options if "=" not in o]
    if t.check.extra:
        parts.append("-- " + " ".join(shlex.quote(x) for x in t.check.extra))
    return " ".join([*env, *parts])


def choose_config(t: ServeTarget, *, parallel: int | None, ubatch: int | None, ctx: int, threads: int,
                  allow_inexact: bool = False, note: Say = _quiet, spec: str = serve_config.NO_SPEC,
                  ) -> tuple[serve_config.ServeConfig, serve_record.Entry | None]:
    """The configuration `dflash serve` runs and the serve record entry that vouches for it (None:
    none does). Without --parallel/--ubatch: the configuration of the record's exact entry with
    the most slots (and the same speculation), else one slot and the prefill record's width. A
    --parallel or --ubatch no entry vouches for is refused unless allow_inexact, and so is
    speculation no entry vouches for."""
    spec = check_spec(t, spec)
    try:
        record = serve_record.load(t.identity)
    except serve_record.RecordError as e:
        note(f"ignoring serve record {e}")
        record = None
    exact = sorted((e for e in (record.configs if record else ()) if e.exact and e.config.spec == spec),
                   key=lambda e: (e.config.parallel, e.config.ubatch))
    if parallel is None and ubatch is None and exact:
        base = exact[-1].config
    else:
        fits = [e for e in exact if (parallel is None or e.config.parallel == parallel)
                and (ubatch is None or e.config.ubatch == ubatch)]
        if fits:
            base = fits[-1].config
        else:
            base = serve_config.ServeConfig(parallel or 1, ubatch or _prefill_width(t), ctx, threads, t.flash_attn,
                                            spec=spec)
    config = replace(base, ctx=ctx, threads=threads)
    entry = serve_record.find(record, config)
    if entry is None and not allow_inexact:
        cmd = qualify_command(t, config)
        if spec != serve_config.NO_SPEC:
            raise UsageError(f"{arg('spec')} {spec}: no serve record vouches for speculation at --parallel "
                             f"{config.parallel} --ubatch {config.ubatch} with this server build and model: run "
                             f"`{cmd}` first, or pass --allow-inexact")
        if config.parallel > 1:
            raise UsageError(f"{arg('parallel')} {config.parallel}: no serve record vouches for {config.parallel} "
                             f"slots at ubatch {config.ubatch} with this server build and model: run `{cmd}` first, "
                             f"or pass --allow-inexact")
        if ubatch is not None and ubatch > _prefill_width(t):
            raise UsageError(f"{arg('ubatch')} {ubatch}: no serve record or qualification record proves width "
                             f"{ubatch} exact for this library and model: run `{cmd}` first, or pass --allow-inexact")
    if entry is None and ubatch is None and config.ubatch == 1:
        note("no record proves a width for this library and model: llama-server prefills one token per step "
             "(-ub 1); `dflash qualify --serve` proves a wider one")
    return config, entry


def qualify(t: ServeTarget, parallels: Sequence[int], ubatch: int, ctx: int, threads: int,
            shape: workload.Shape, evidence_dir: str | os.PathLike[str] | None = None,
            argv: list[str] | None = None, log: Say = _quiet, log_line: Say = _quiet,
            spec: str = serve_config.NO_SPEC) -> ServeQualifyResult:
    """Run the serve qualification (dflash/serving/serve_check.py) for each --parallel value (with
    the speculation `spec`); dflash prefill runs in this process on the same flavor's library."""
    spec = check_spec(t, spec)
    configs = [serve_config.ServeConfig(p, ubatch, ctx, threads, t.flash_attn, spec=spec) for p in parallels]
    out = Path(evidence_dir) if evidence_dir else default_evidence_dir("serve-qualify")
    with Session(t.given_model, weights=t.weights, lib=t.check.flavor, device=t.check.device, threads=threads,
                 bands=False, settings=t.settings, build=True, log=log) as session:
        return qualify_serve(t.check, configs, shape, prefill_with(session), out, argv, log, log_line,
                             env=t.env)
