"""llama-server configurations that keep every response exact (pure: no processes, no I/O).

`dflash serve` runs llama.cpp's own llama-server, built from the project's patch set, with the
options below. What they pin, and why:

  -b/-ub W        every ubatch carries at most W tokens, W a width proven exact for this library,
                  model and device (a serve record, or the prefill record's fixed-width run; 1 = q1
                  without either). llama-server decodes a 2-token batch while it starts, so with
                  W = 1 the logical batch is 2 (-b 2 -ub 1): still one token per ubatch. With
                  speculation the logical batch holds every slot's token and drafts (-b at least
                  parallel x (1 + MAX_DRAFT)); ubatches stay W wide
  --swa-full      a full-size sliding-window cache (a window-sized ring is sized by n_ubatch)
  --no-kv-unified one KV stream per slot: a sequence's cells stay in position order whatever the
                  other slots do (a unified cache interleaves sequences, so the order in which
                  attention visits a sequence's cells depends on the others)
  -fa auto|off    flash attention as the exact library expects it (CPU: llama.cpp's choice, every
                  query row by the exact library's batch-invariant kernel; GPU: off)
  -dev Vulkan0 -ngl 999 --no-op-offload (vulkan:N only)
                  every layer on the one Vulkan device the server is shown (GGML_VK_VISIBLE_DEVICES=N),
                  no op offload (the placement dflash prefill runs; Engine.op_offload says why)
  --no-context-shift, --cache-reuse 0
                  no KV shifting: a shifted cache is not the cache a cold run computes
  --fit off       the context and batch sizes are the ones given, never adjusted to free memory
  prompt cache    on (llama-server's default): a reused prefix, a restored checkpoint and the RAM
                  cache are what `dflash qualify --serve` measures against cold runs
  --spec KIND     llama-server's own speculative decoding (none by default): `ngram` drafts from
                  n-grams of the context (ngram-simple), `draft:MODEL` from a second model, `mtp`
                  from the model's own next-n (multi-token prediction) layers. The target verifies
                  a slot's k drafts in one batch of k + 1 tokens; on the exact library a token's
                  logits do not depend on the batch, so greedy responses equal those without
                  speculation. Server patch 0004 reports a verified token's logprobs from its row
                  of that batch (upstream leaves them unset), so qualification compares them too
  DFLASH_CHECKPOINT_EVERY=R (environment, DeepSeek-V4 only; server patch 0003)
                  R = the least common multiple of the model's compress ratios (128): llama-server
                  cannot cut this model's cache to a prefix, so it also checkpoints every position
                  that is a multiple of R, where every compressed row is complete; a request that
                  shares a prefix with a cached one restarts from the last such position.
                  Server patch 0005 (same variable) adds a checkpoint one token before each
                  prompt's end: an exact repeat evaluates its last token only

Options a user passes after `--` go to llama-server as they are, except those dflash sets itself
(refused: use dflash's flag) and those known to break exactness (refused unless allow_inexact).
"""
from __future__ import annotations

import hashlib
import ipaddress
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from dflash.core.errors import UsageError, arg
from dflash.core.results import Json
from dflash.core.settings import MAX_CHUNK
from dflash.run import speculate

DEFAULT_PORT = 8080
CHECKPOINT_ENV = "DFLASH_CHECKPOINT_EVERY"  # read by llama-server (server/patches/0003)
MAX_PARALLEL = 64
NO_SPEC = "none"
SPEC_KINDS = ("ngram", "ngram:N", "mtp", "draft:MODEL")
# ngram: llama-server's ngram-simple, a lookup of the last NGRAM_N tokens (N with ngram:N) in the
# context proposing the NGRAM_M that followed them, as dflash's own speculate.greedy does (llama.cpp's
# defaults are 12 and 48: drafts only after a 12-token repeat)
NGRAM_N, NGRAM_M = speculate.NGRAM_N, speculate.NGRAM_M
MAX_DRAFT = 64  # the longest draft llama-server makes with its defaults (ngram-mod's n_max; ngram-simple's is NGRAM_M)

# llama-server options dflash sets from its own flags
MANAGED: dict[str, str] = {
    **dict.fromkeys(("-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo"), "--model"),
    **dict.fromkeys(("--host",), "--host"),
    **dict.fromkeys(("--port",), "--port"),
    **dict.fromkeys(("-np", "--parallel"), "--parallel"),
    **dict.fromkeys(("-c", "--ctx-size"), "--ctx"),
    **dict.fromkeys(("-t", "--threads", "-tb", "--threads-batch"), "--threads"),
    **dict.fromkeys(("-b", "--batch-size", "-ub", "--ubatch-size"), "--ubatch"),
    **dict.fromkeys(("-fa", "--flash-attn"), "--device (flash attention follows it)"),
    **dict.fromkeys(("-dev", "--device", "-ngl", "--gpu-layers", "--n-gpu-layers", "-sm", "--split-mode",
                     "-ts", "--tensor-split", "-mg", "--main-gpu", "--op-offload", "--no-op-offload"), "--device"),
    **dict.fromkeys(("--rpc",), "--rpc"),
    **dict.fromkeys(("--spec-type", "--spec-default", "-md", "--model-draft", "--spec-draft-model", "-hfd", "-hfrd",
                     "--spec-draft-hf", "--hf-repo-draft"), "--spec"),
    **dict.fromkeys(("--api-key", "--api-key-file"), "--api-key"),
    **dict.fromkeys(("-a", "--alias"), "--alias"),
    **dict.fromkeys(("--swa-full", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "--context-shift",
                     "--no-context-shift", "-fit", "--fit"), "nothing: dflash pins it (see `dflash serve --help`)"),
}

# llama-server options known to change results against a cold single-request run or dflash prefill
INEXACT: dict[str, str] = {
    **dict.fromkeys(("--cache-reuse",), "KV shifting moves cached chunks to other positions; a shifted "
                                         "cache is not what a cold run computes"),
    **dict.fromkeys(("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"),
                    "another KV cache type than dflash prefill's changes every logit"),
    **dict.fromkeys(("--spec-synth-len", "--spec-synth-rates"),
                    "synthetic acceptance accepts drafts at random instead of by the target's choice"),
    **dict.fromkeys(("--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled",
                     "--override-kv", "-ot", "--override-tensor"),
                    "it changes the model that dflash prefill checks responses against"),
    **dict.fromkeys(("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
                     "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast"),
                    "it changes the model's positional encoding"),
}


@dataclass(frozen=True)
class ServeConfig:
    """What decides a llama-server's results beyond its build and model: slots, batch width, KV
    layout, flash attention, context per slot, threads."""
    parallel: int
    ubatch: int
    ctx: int              # tokens per slot (llama-server's -c is ctx * parallel)
    threads: int
    flash_attn: str = "auto"
    kv_unified: bool = False
    spec: str = NO_SPEC   # speculative decoding: none, ngram, mtp or draft:MODEL (see parse_spec)

    def __post_init__(self) -> None:
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise UsageError(f"{arg('parallel')} {self.parallel} is outside 1..{MAX_PARALLEL}")
        if not 1 <= self.ubatch <= MAX_CHUNK:
            raise UsageError(f"{arg('ubatch')} {self.ubatch} is outside 1..{MAX_CHUNK}")
        if self.ctx < 16:
            raise UsageError(f"{arg('ctx')} {self.ctx} is too small (at least 16 tokens per slot)")
        if self.threads < 1:
            raise UsageError(f"{arg('threads')} {self.threads} must be at least 1")
        if self.flash_attn not in ("auto", "on", "off"):
            raise UsageError(f"flash attention {self.flash_attn!r} is not auto, on or off")
        parse_spec(self.spec)

    def args(self) -> list[str]:
        """llama-server's options for this configuration (the exact-keeping ones of the module doc)."""
        batch = max(self.ubatch, 2)
        if self.spec != NO_SPEC:  # llama-server asserts that every slot's token and drafts fit one batch
            batch = max(batch, self.parallel * (1 + MAX_DRAFT))
        return ["-np", str(self.parallel), "-c", str(self.ctx * self.parallel), "-b", str(batch),
                "-ub", str(self.ubatch), "-t", str(self.threads), "-tb", str(self.threads),
                "-fa", self.flash_attn, "--swa-full", "--kv-unified" if self.kv_unified else "--no-kv-unified",
                "--no-context-shift", "--cache-reuse", "0", "--fit", "off", *spec_args(self.spec)]

    def vouched_by(self, other: ServeConfig) -> bool:
        """A record made with `other` vouches for this configuration: the same slots, width, KV layout
        flash attention and speculation (context and threads change no kernel's order of operations)."""
        return (self.parallel, self.ubatch, self.flash_attn, self.kv_unified, self.spec) == \
            (other.parallel, other.ubatch, other.flash_attn, other.kv_unified, other.spec)

    def to_json(self) -> Json:
        return asdict(self)


def parse_spec(text: str) -> str:
    """The canonical form of a --spec value (none, ngram, mtp, draft:MODEL), or a one-line UsageError."""
    t = text.strip()
    if t in (NO_SPEC, "mtp") or speculate.ngram_size(t) is not None:
        return t
    if t.startswith("draft:") and t[len("draft:"):].strip():
        return "draft:" + t[len("draft:"):].strip()
    raise UsageError(f"{arg('spec')} {text!r} is not one of none, {', '.join(SPEC_KINDS)}")


def spec_args(spec: str) -> list[str]:
    """llama-server's options for a --spec value."""
    spec = parse_spec(spec)
    if spec == NO_SPEC:
        return []
    if (n := speculate.ngram_size(spec)) is not None:
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(n),
                "--spec-ngram-simple-size-m", str(NGRAM_M)]
    if spec == "mtp":
        return ["--spec-type", "draft-mtp"]
    return ["--spec-type", "draft-simple", "--spec-draft-model", spec[len("draft:"):]]


def spec_label(spec: str, draft_sha256: str | None = None) -> str:
    """How a fingerprint names the speculation: '' without, 'spec-ngram', 'spec-mtp', or
    'spec-draft-<first 16 hex of the draft model's SHA-256>'."""
    spec = parse_spec(spec)
    if spec == NO_SPEC:
        return ""
    if spec.startswith("draft:"):
        return f"spec-draft-{(draft_sha256 or 'unknown')[:16]}"
    return f"spec-{spec.replace(':', '')}"


def option_name(token: str) -> str | None:
    """'--cache-reuse' for '--cache-reuse=256' or '--cache-reuse'; None for a value."""
    if not token.startswith("-") or token == "-" or _is_number(token):
        return None
    return token.split("=", 1)[0]


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def check_extra(extra: Sequence[str], allow_inexact: bool) -> list[str]:
    """Refuse (UsageError, naming the option and why) what dflash sets itself, and what breaks
    exactness unless allow_inexact; returns warnings for the inexact options let in."""
    warnings = []
    for i, token in enumerate(extra):
        name = option_name(token)
        if name is None:
            continue
        if name in MANAGED:
            raise UsageError(f"llama-server option {name}: dflash serve sets it; use {MANAGED[name]}")
        if name == "--cache-reuse":
            value = token.split("=", 1)[1] if "=" in token else (extra[i + 1] if i + 1 < len(extra) else "")
            if value.strip() == "0":
                continue
        if name in INEXACT:
            if not allow_inexact:
                raise UsageError(f"llama-server option {name} breaks exactness ({INEXACT[name]}); "
                                 f"pass --allow-inexact to run it anyway")
            warnings.append(f"llama-server option {name}: {INEXACT[name]}; responses may differ from cold runs")
    return warnings


def bind_address(host: str, allow_remote: bool, api_key: str | None) -> tuple[str, str | None]:
    """(host, warning): loopback, or another address with both allow_remote and an API key."""
    try:
        addr = ipaddress.ip_address(host.strip())
    except ValueError:
        raise UsageError(f"{arg('host')} {host!r} is not an IP address") from None
    if addr.is_loopback:
        return str(addr), None
    if not allow_remote or not api_key:
        missing = " and ".join(x for x, ok in (("--allow-remote", allow_remote), ("--api-key", api_key)) if not ok)
        raise UsageError(f"{arg('host')} {host} is not a loopback address: serving it needs {missing} "
                         f"(anyone who reaches the port can run the model)")
    return str(addr), (f"serving on {addr}, not a loopback address: requests need the API key, but the "
                       f"connection is not encrypted; serve a trusted network, or put TLS in front")


def fingerprint(flavor: str, library_key: str, server_key: str, model_sha256: str, device_label: str = "cpu",
                spec: str = "") -> str:
    """The system_fingerprint every response carries: the library (flavor and build key), the
    device when it is not the CPU (its id and a hash of its name and driver, which compiles the
    shaders), the llama-server build, the model and the speculation (a spec_label) when on."""
    device = ""
    if device_label != "cpu":
        dev_id, _, about = device_label.partition(" ")
        device = f"-{dev_id.replace(':', '')}-{hashlib.sha256(about.encode()).hexdigest()[:8]}"
    return (f"dflash-{flavor}-{library_key}{device}-server-{server_key[:8]}-model-{model_sha256[:16]}"
            + (f"-{spec}" if spec else ""))


def device_args(device: str, flavor: str) -> list[str]:
    """llama-server's placement options for a --device dflash serve runs on: none for the CPU; for
    one Vulkan device (shown to the server as its only one, GGML_VK_VISIBLE_DEVICES) every layer on
    it, and for the exact library llama.cpp's op offload off, as in dflash prefill (see
    Engine.op_offload)."""
    if device == "cpu":
        return []
    return ["-dev", "Vulkan0", "-ngl", "999", *(["--no-op-offload"] if flavor == "exact" else [])]


def flash_attn_for(device: str, flavor: str) -> str:
    """-fa as dflash prefill runs it (Engine.flash_attn): llama.cpp's choice on the CPU and for the
    stock library; on for the exact library on Vulkan, off on a CUDA or HIP GPU."""
    if flavor != "exact" or device == "cpu":
        return "auto"
    return "on" if device.split(":", 1)[0] == "vulkan" else "off"


def config_key(parts: Sequence[str]) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def checkpoint_every(compress_ratios: Sequence[int]) -> int:
    """The checkpoint spacing for a model's compress ratios (one per layer, 0 = no compressor):
    their least common multiple, the positions where no compressor has a pooled row pending; 0
    for a model without compressors (its cache is cut to any prefix; llama-server makes no
    checkpoints for it)."""
    ratios = sorted({int(r) for r in compress_ratios if int(r) > 0})
    return math.lcm(*ratios) if ratios else 0
