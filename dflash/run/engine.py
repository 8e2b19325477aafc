"""From settings and a model path to a ready context: library, model, prompt, plan.

This is the layer the commands call: it validates input before anything is allocated in
llama.cpp and turns every failure into a DflashError with one line of text.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.core import cpu_isa
from dflash.core.errors import DflashError, LibraryNotBuilt, UsageError, arg
from dflash.core.settings import ENV_TILE, Settings
from dflash.core.settings import resolve as resolve_settings
from dflash.model import gguf_meta, tiny_model
from dflash.native import build, devices, library_id, llama, narrow
from dflash.native.rpc import Remote, check_builds
from dflash.run import bands

Log = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


MAX_THREADS = 512   # ggml's GGML_MAX_N_THREADS (its thread pool arrays); more crashes llama.cpp
MAX_CTX = 2**32 - 1  # llama_context_params.n_ctx is a uint32_t

# A built-in prompt long enough to cross the ratio-4 and ratio-128 boundaries and the tiny
# model's 64-token sliding window (the test tokenizer makes one token of every 5 characters).
DEFAULT_PROMPT = " ".join(
    f"The band scheduler keeps every compressor emission at the end of its band {i}."
    for i in range(24))


def resolve_model(path: str | None, weights: str = tiny_model.DEFAULT_WEIGHTS) -> Path:
    """The model to run: the given path, or the built-in tiny model (written on first use; the
    K-quant presets need the llama.cpp library loaded, its quantizer makes them)."""
    if path:
        return Path(path)
    return tiny_model.ensure(tiny_model.TinyConfig(weights=weights), quantize=llama.quantize)


def check_prompt(prompt: str | None) -> str:
    """The prompt to run (None: the built-in one); an empty or blank prompt is a usage error."""
    if prompt is None:
        return DEFAULT_PROMPT
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the prompt is not valid UTF-8") from None
    return prompt


def library_dir(settings: Settings, log: Log = _quiet, gpu: str = "none", build_missing: bool = False) -> Path:
    """The llama.cpp library folder for the settings (and GPU backend). A library that is not
    built yet is built only with `build_missing` (the CLI's way; Session(build=True)); otherwise
    LibraryNotBuilt names the command that builds it."""
    if settings.lib_dir:
        d = Path(settings.lib_dir)
        if not (d / "libllama.so").is_file():
            raise UsageError(f"DFLASH_LLAMA_LIB_DIR={d} has no libllama.so")
        return d
    cpu = settings.cpu
    if cpu != cpu_isa.NATIVE:
        if gpu != "none":
            raise UsageError(f"{arg('cpu')} {cpu} is a CPU build: a GPU run loads its backend's native build")
        cpu_isa.refuse_unrunnable(cpu)
    if not build_missing and not build.is_built(settings.lib, gpu, cpu):
        what = f"the {settings.lib} llama.cpp library" + ("" if gpu == "none" else f" for {gpu}") + \
            ("" if cpu == cpu_isa.NATIVE else f" ({cpu})")
        cmd = f"dflash build --lib {settings.lib}" + ("" if gpu == "none" else f" --gpu {gpu}") + \
            ("" if cpu == cpu_isa.NATIVE else f" --cpu {cpu}")
        raise LibraryNotBuilt(f"{what} is not built yet: run `{cmd}` (a few minutes, once), or open the "
                              f"Session with build=True")
    return build.build_library(settings.lib, gpu, log=log, cpu=cpu)


_SET_AT_RUN_TIME = (ENV_TILE,)  # library flags open_engine sets per engine, not at load


def load_library(settings: Settings, log: Log = _quiet, gpu: str = "none", build_missing: bool = False) -> Path:
    """Load the settings' llama.cpp library into this process; `gpu` is the backend of a hip:N /
    cuda:N run (DFLASH_LLAMA_LIB_DIR, when set, names it instead). The flags the library reads
    once (settings.library_env) are exported before it loads; a process that already loaded it
    with other values is refused (they cannot change any more), except the indexer tile, which
    open_engine sets in the loaded library for each engine."""
    lib_dir = library_dir(settings, log, gpu, build_missing)
    want = settings.library_env()
    if llama.library_dir() is None:
        os.environ.update(want)  # before the load: the library's narrow path sees dflash's ceiling
    else:
        changed = [f"{k}={os.environ.get(k)!r}" for k, v in want.items()
                   if k not in _SET_AT_RUN_TIME and os.environ.get(k) != v]
        if changed:
            raise DflashError(f"this process loaded llama.cpp with {', '.join(changed)}; settings that need "
                              f"{', '.join(f'{k}={v!r}' for k, v in want.items())} need a process of their own "
                              f"(dflash.worker)")
        os.environ.update({k: want[k] for k in _SET_AT_RUN_TIME if k in want})
    llama.load_library(lib_dir, verbose=settings.verbose)
    return lib_dir


def write_tiny_model(cfg: tiny_model.TinyConfig, out: str | None = None, settings: Settings | None = None,
                     log: Log = _quiet, build_missing: bool = False) -> Path:
    """The built-in model at `out`, or in the user cache (reused). K-quant presets load the
    llama.cpp library first (the exact one unless `settings` say otherwise): its quantizer makes them."""
    if tiny_model.needs_quantizer(cfg.weights):
        load_library(settings or resolve_settings({}, lib="exact"), log, build_missing=build_missing)
    if out:
        return tiny_model.write(out, cfg, llama.quantize)
    return tiny_model.ensure(cfg, llama.quantize)


@dataclass
class Engine:
    settings: Settings
    info: gguf_meta.ModelInfo
    model: llama.Model
    lib_dir: Path
    threads: int
    device: str = "cpu"
    gpu_archs: tuple[str, ...] = ()  # the --device GPUs' architectures (gfx1201, ...); () on the CPU
    remote: Remote | None = None     # the --rpc servers
    placement: tuple[dict, ...] = ({"id": "cpu"},)  # every device of --device, as devices_json says
    rpc_warnings: tuple[str, ...] = ()
    repack: bool = True  # weights in llama.cpp's extra buffer types (AMX, repacked); off: --no-repack, RPC runs
    indexer_shortcut: bool = False  # the library applies DeepSeek-V4's all-pooled indexer shortcut
    indexer_tile: int = 0           # the DeepSeek-V4 indexer tile the library applies (0: none)

    @property
    def uncovered_weight_types(self) -> dict[str, int]:
        """The model's matrix weight types (-> tensor count, gguf_meta's matrix_types) outside the
        narrow path on this device (dflash/native/narrow.py); {} on the CPU, and on a Vulkan device, where the
        exact flavor runs every product through one shader family (vulkan_kernels/README.md)."""
        if devices.parse_spec(self.device).kind == "vulkan":
            return {}
        return narrow.uncovered_weight_types(self.info.matrix_types, self.gpu_archs, self.settings.narrow)

    def narrow_warnings(self) -> list[str]:
        w = narrow.warning(self.uncovered_weight_types, self.device, self.gpu_archs, self.settings.narrow)
        return [w, *self.rpc_warnings] if w else list(self.rpc_warnings)

    def close(self) -> None:
        """Free the model (contexts are closed by their owners)."""
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tokenize(self, prompt: str) -> list[int]:
        tokens = self.model.tokenize(prompt)
        if not tokens:
            raise UsageError("the prompt has no tokens")
        return tokens

    def context_size(self, n_tokens: int, n_predict: int, ctx: int | None) -> int:
        """The context for a request; a prompt that does not fit is an error here, before
        llama.cpp allocates anything for it."""
        limit = self.model.n_ctx_train or self.info.context_length or 0
        need = n_tokens + n_predict
        if ctx is not None:
            if not 1 <= ctx <= MAX_CTX:  # llama_context_params.n_ctx is 32 bits: no silent wrap
                raise UsageError(f"{arg('ctx')} {ctx} is outside 1..{MAX_CTX}")
            if limit and ctx > limit:
                raise UsageError(f"{arg('ctx')} {ctx} exceeds the model's context length {limit}")
            if need > ctx:
                raise UsageError(f"prompt ({n_tokens} tokens) plus {arg('n_predict')} {n_predict} does not "
                                 f"fit in {arg('ctx')} {ctx}")
            return ctx
        if limit and need > limit:
            raise UsageError(f"prompt ({n_tokens} tokens) plus {arg('n_predict')} {n_predict} exceeds the "
                             f"model's context length {limit}")
        return need

    @property
    def flash_attn(self) -> bool | None:
        """Flash attention as llama.cpp chooses it (None: auto) on the CPU in both flavors and for
        the stock library anywhere: the exact library's CPU kernel runs every query row the same way
        at every width (cpu_kernels/README.md). On for the exact library on Vulkan, whose flavor
        splits a row's cells at fixed cells from cell 0 whatever the batch (vulkan_kernels/README.md,
        patch 0012): on rather than auto, so that a run, a qualification and a server on Vulkan
        always prove that kernel. Off for the exact library on a CUDA or HIP GPU, whose
        flash-attention kernels are not made batch-invariant (the CUDA build leaves them out). RPC
        devices count as what their server serves (`dflash rpc-server` reports it; a server that
        does not is taken for a GPU other than Vulkan)."""
        if self.settings.lib != "exact":
            return None
        spec = devices.parse_spec(self.device)
        if spec.kind == "cpu" and (self.remote is None or self.remote.all_cpu):
            return None
        servers = [sv.device for sv in self.remote.servers] if self.remote is not None else []
        return devices.device_kind(self.device, servers) == "vulkan"

    @property
    def op_offload(self) -> bool | None:
        """llama.cpp's op offload (None: its default, on) for the stock library; off for the exact
        library whenever another device than the CPU takes part. With it on, ggml's
        scheduler moves an op whose weights live in CPU memory to a GPU once the op has enough rows
        (ggml-vulkan: 32, GGML_OP_OFFLOAD_MIN_BATCH; rows of any op, so a band of 9 tokens over 4
        heads already qualifies): the CPU layers' products would then run on the CPU for narrow
        bands and on the GPU for wide ones, another kernel with other bits (measured: a
        cpu,vulkan:0 split differed from q1 at bands of 9 and 64 with it on)."""
        if self.settings.lib != "exact":
            return None
        return None if devices.parse_spec(self.device).entries == ("cpu",) else False

    def context(self, n_ctx: int, max_band: int, eval_callback: object = None) -> llama.Context:
        return llama.Context(self.model, n_ctx, self.threads, flash_attn=self.flash_attn,
                             max_band=max_band, eval_callback=eval_callback, op_offload=self.op_offload)

    def plan(self, n_tokens: int, start: int = 0, cap: int | None = None,
             bands_on: bool | None = None) -> list[bands.Band]:
        s = self.settings
        on = s.bands if bands_on is None else bands_on
        if on and cap is None and s.fixed:  # a record proved bands of this width across boundaries
            return bands.fixed_bands(n_tokens, s.cap, start, s.mmvq_max_ncols)
        return bands.plan(n_tokens, start, self.info.compress_ratios, cap if cap is not None else s.cap,
                          on, s.mmvq_max_ncols)

    def request_bands(self, n_tokens: int, resume_at: int = 0, *, cap: int | None = None,
                      bands_on: bool | None = None) -> list[bands.Band]:
        """Bands for a prompt, optionally as a first part [0, resume_at) and a resumed second part
        planned from the unaligned start."""
        if not 0 <= resume_at < n_tokens:
            raise UsageError(f"{arg('resume_at')} {resume_at} must be in 0..{n_tokens - 1}")
        if resume_at == 0:
            return self.plan(n_tokens, 0, cap, bands_on)
        return self.plan(resume_at, 0, cap, bands_on) + self.plan(n_tokens - resume_at, resume_at, cap, bands_on)


def gpu_placement(ids: list[int]) -> dict:
    """Model placement for --device: cpu; hip:N (all layers on N); hip:N,hip:M (layer split)."""
    if not ids:
        return {}
    _require_gpu_library()
    if len(ids) == 1:
        return {"n_gpu_layers": 999, "main_gpu": ids[0]}
    split = [0.0] * (max(ids) + 1)
    for i in ids:
        split[i] = 1.0
    return {"n_gpu_layers": 999, "main_gpu": ids[0], "tensor_split": split}


def _require_gpu_library() -> None:
    if not llama.supports_gpu():
        raise DflashError("the loaded llama.cpp library has no GPU backend: `dflash build --gpu hip|cuda|vulkan` "
                          "builds one (see hip_kernels/README.md), or set DFLASH_LLAMA_LIB_DIR to one")


def cpu_layers(n_layers: int, parts: int) -> int:
    """Layers the CPU keeps in a split of `parts` devices including the CPU: an even share, at
    least one, and at least one layer left for the others."""
    return min(max(round(n_layers / parts), 1), max(n_layers - 1, 0))


def vulkan_visible(ids: list[int]) -> dict[int, int]:
    """Show ggml's Vulkan backend the devices vulkan:N names (GGML_VK_VISIBLE_DEVICES, read when the
    library loads; without it the backend skips CPU drivers such as lavapipe). Returns each N's index
    among the library's devices. A process that loaded the library showing other devices is refused."""
    want = ",".join(str(i) for i in sorted(ids))
    have = os.environ.get("GGML_VK_VISIBLE_DEVICES")
    if llama.library_dir() is not None and have != want:
        named = ",".join(f"vulkan:{i}" for i in ids)
        raise DflashError(f"this process loaded llama.cpp with GGML_VK_VISIBLE_DEVICES={have!r}; "
                          f"{arg('device')} {named} needs a process of its own (dflash.worker)")
    os.environ["GGML_VK_VISIBLE_DEVICES"] = want
    return {n: i for i, n in enumerate(sorted(ids))}


def gpu_index(spec: devices.DeviceSpec) -> dict[int, int]:
    """Each GPU id --device names -> its index among the loaded library's devices (call before the
    load: vulkan:N sets what the Vulkan backend lists, see vulkan_visible)."""
    return vulkan_visible(spec.gpu_ids) if spec.kind == "vulkan" else {i: i for i in spec.gpu_ids}


def list_placement(spec: devices.DeviceSpec, n_layers: int, remote: Remote | None,
                   index: dict[int, int] | None = None) -> dict:
    """Model placement by an explicit device list (RPC devices, the CPU in a split): the CPU keeps
    the first layers, every other device an even share of the rest (the output layer with the last)."""
    gpus = llama.gpu_devices() if spec.gpu_ids else []
    if spec.gpu_ids:
        _require_gpu_library()
        if max((index or {}).get(i, i) for i in spec.gpu_ids) >= len(gpus):
            raise DflashError(f"the loaded library sees {len(gpus)} GPU device(s), {arg('device')} names {spec}")
    remote_handles = llama.rpc_add_servers(remote.endpoints) if remote is not None else []
    handles = []
    for e in spec.entries:
        kind, _, n = e.partition(":")
        if kind == "rpc":
            handles.append(remote_handles[int(n)])
        elif kind != "cpu":
            handles.append(gpus[(index or {}).get(int(n), int(n))])
    offloaded = n_layers + 1 - (cpu_layers(n_layers, len(spec.entries)) if spec.cpu_share else 0)
    out: dict = {"devices": handles, "n_gpu_layers": offloaded, "main_gpu": 0}
    if len(handles) > 1:
        out["tensor_split"] = [1.0] * len(handles)
    return out


def devices_json(spec: devices.DeviceSpec, remote: Remote | None, gpus: list[devices.Device]) -> tuple[dict, ...]:
    """Every device of --device for results and evidence: local ones by id (GPUs with name and
    architecture), RPC ones with their endpoint and the build their server reports."""
    by_id = {d.id: d for d in gpus}
    remote_devs = remote.devices if remote is not None else []
    out = []
    for e in spec.entries:
        if e.startswith("rpc:"):
            out.append(remote_devs[int(e[4:])].to_json())
        elif e in by_id:
            d = by_id[e]
            out.append({"id": e, "name": d.name, "arch": d.arch})
        else:
            out.append({"id": e})
    return tuple(out)


def open_engine(settings: Settings, model_path: str | None = None, *, threads: int | None = None,
                weights: str = tiny_model.DEFAULT_WEIGHTS, device: str = "cpu",
                remote: Remote | None = None, repack: bool = True, no_alloc: bool = False,
                mmap: bool = True, build_missing: bool = False, log: Log = _quiet) -> Engine:
    """Library, model and placement for a run. `remote` is the handshake with the --rpc servers
    (dflash.native.rpc.connect, done before anything is loaded); a server running another library build
    is refused here unless the run allows mixed builds. `repack=False` (--no-repack) keeps the
    weights in plain CPU buffers; a run with RPC devices always does (see repack_for). `no_alloc`
    loads the model's metadata and shapes only, for memory estimates (dflash/run/memory.py); `mmap=False`
    reads the weights into allocated buffers instead of mapping the file (what those estimate).
    `build_missing` builds a library that is not built yet (else LibraryNotBuilt)."""
    quantized = model_path is None and tiny_model.needs_quantizer(weights)
    path = None if quantized else resolve_model(model_path, weights)
    info = gguf_meta.read(path) if path else None  # validates the file before llama.cpp sees it
    spec = devices.parse_spec(device)
    if spec.rpc_ids and remote is None:
        raise UsageError(f"{arg('device')} {spec} needs {arg('rpc')} HOST:PORT (the server serving rpc:N)")
    kind = devices.device_kind(device, [sv.device for sv in remote.servers] if remote is not None else ())
    gpus = devices.require_gpu(device)  # exit 3 with the reason, before any build or load
    archs = tuple(d.arch for d in gpus)
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise UsageError(f"{arg('threads')} {threads} is outside 1..{MAX_THREADS} (ggml's thread limit)")
    rpc_warnings: list[str] = []
    if remote is not None:  # before the build or the model load: a refused server costs nothing
        rpc_warnings = check_builds(remote.servers, library_id.build_id(settings, kind), remote.allow_mixed_builds)
    index = gpu_index(spec)
    lib_dir = load_library(settings, log, gpu="none" if kind == "cpu" else kind, build_missing=build_missing)
    if path is None:  # a K-quant built-in model: made by the library just loaded
        path = resolve_model(None, weights)
        info = gguf_meta.read(path)
    assert info is not None  # read above, before or after the library's quantizer made the file
    if spec.by_device_list:
        placement = list_placement(spec, info.n_layers or 1, remote, index)
    else:
        placement = gpu_placement([index[i] for i in spec.gpu_ids])
    extra = repack_for(spec, repack)
    model = llama.Model(path, **placement, extra_bufts=extra, no_alloc=no_alloc, mmap=mmap)
    # the library read DFLASH_DS4_INDEXER_TILE when this process first loaded it; a later run (a
    # Session after a --memory-budget estimate that chose a tile) sets its own
    llama.set_indexer_tile(settings.indexer_tile, settings.indexer_tile_plant)
    return Engine(settings, info, model, lib_dir, threads or min(os.cpu_count() or 1, 8), str(spec), archs,
                  remote, devices_json(spec, remote, gpus), tuple(rpc_warnings), extra, llama.indexer_shortcut(),
                  llama.indexer_tile())


def repack_for(spec: devices.DeviceSpec, repack: bool = True) -> bool:
    """Whether a run puts weights in llama.cpp's extra CPU buffer types (AMX, repacked). Never with
    RPC devices: the RPC backend allocates plain buffers on its server, so a CPU served over RPC
    runs the plain kernels, and the client's own CPU layers do the same; every layer of the run
    then uses the kernels a local `--no-repack` run uses, and the two can be compared bit for bit."""
    return repack and not spec.rpc_ids
