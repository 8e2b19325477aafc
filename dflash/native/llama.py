"""The only module that talks to llama.cpp (through llama-cpp-python's low-level ctypes API).

One process loads one llama.cpp library: `llama_cpp` reads LLAMA_CPP_LIB_PATH when it is first
imported, so `load_library` sets it and imports. Comparing libraries takes two processes.
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from dflash.core.errors import DflashError, LlamaError, ModelError
from dflash.core.stage import stage

_L: ModuleType | None = None  # the llama_cpp module once loaded (its attributes are Any here)
_LIB_DIR: Path | None = None
_LOG: list[str] = []  # recent llama.cpp warnings/errors, for error messages
_log_cb: ctypes._CFunctionType | None = None  # keep the ctypes callback alive
_RPC_REGISTERED: set[str] = set()  # endpoints whose devices are in ggml's backend registry


def load_library(lib_dir: str | os.PathLike[str], verbose: bool = False) -> ModuleType:
    """Import llama_cpp bound to libllama.so in `lib_dir` (once per process); `verbose` passes
    llama.cpp's log through to stderr."""
    global _L, _LIB_DIR, _log_cb
    lib_dir = Path(lib_dir).resolve()
    if _L is not None:
        if lib_dir != _LIB_DIR:
            raise DflashError(f"this process already loaded llama.cpp from {_LIB_DIR}; "
                              f"run another process for {lib_dir}")
        return _L
    if not (lib_dir / "libllama.so").is_file():
        raise DflashError(f"no libllama.so in {lib_dir}")
    if "llama_cpp" in sys.modules:
        raise DflashError("llama_cpp was imported before dflash chose its library")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    stage(f"library load ({lib_dir})")
    try:
        _preload_ggml(lib_dir)
        import llama_cpp as L
    except (OSError, RuntimeError, AttributeError) as e:  # AttributeError: a symbol of another version
        raise LlamaError(f"cannot load llama.cpp from {lib_dir}: {e}".splitlines()[0]) from None

    @L.llama_log_callback
    def _cb(level: int, text: bytes, user: int | None) -> None:  # c_int, c_char_p (never NULL), c_void_p
        msg = text.decode(errors="replace")
        if verbose:
            sys.stderr.write(msg)
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            _LOG.append(msg.strip())
            del _LOG[:-20]

    _log_cb = _cb
    L.llama_log_set(_log_cb, ctypes.c_void_p())
    L.llama_backend_init()
    _L, _LIB_DIR = L, lib_dir
    return L


def _preload_ggml(lib_dir: Path) -> None:
    """Load libggml-base, the backends, then libggml from `lib_dir` by full path, so libllama's
    dependencies resolve to these files whatever the install's rpath says."""
    base = lib_dir / "libggml-base.so"
    backends = sorted(p for p in lib_dir.glob("libggml-*.so") if p != base)
    for p in [base, *backends, lib_dir / "libggml.so"]:
        if p.is_file():
            ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)


def indexer_shortcut() -> bool:
    """Whether the loaded library applies DeepSeek-V4's all-pooled indexer shortcut: the exact
    library has it (llama_dflash_indexer_shortcut, from its patch set) and reads
    DFLASH_DS4_INDEXER_SHORTCUT once; other libraries do not have it."""
    if _LIB_DIR is None:
        raise DflashError("llama.cpp library not loaded (call load_library first)")
    fn = getattr(ctypes.CDLL(str(_LIB_DIR / "libllama.so")), "llama_dflash_indexer_shortcut", None)
    if fn is None:
        return False
    fn.restype, fn.argtypes = ctypes.c_int, []
    return bool(fn() != 0)


def _dflash_fn(name: str) -> Any:
    if _LIB_DIR is None:
        raise DflashError("llama.cpp library not loaded (call load_library first)")
    return getattr(ctypes.CDLL(str(_LIB_DIR / "libllama.so")), name, None)


def indexer_tile() -> int:
    """The DeepSeek-V4 indexer tile the loaded library applies (0: none; the exact library reads
    DFLASH_DS4_INDEXER_TILE when it loads; other libraries have no tiles)."""
    fn = _dflash_fn("llama_dflash_indexer_tile")
    if fn is None:
        return 0
    fn.restype, fn.argtypes = ctypes.c_int, []
    return int(fn())


def indexer_tile_supported() -> bool:
    """Whether the loaded library has DeepSeek-V4 indexer tiles (the exact library)."""
    return _dflash_fn("llama_dflash_set_indexer_tile") is not None


def set_indexer_tile(tile: int, plant: bool = False) -> bool:
    """Set the indexer tile for graphs built from now on (contexts created afterwards); False when
    the loaded library has no tiles."""
    fn = _dflash_fn("llama_dflash_set_indexer_tile")
    if fn is None:
        return False
    fn.restype, fn.argtypes = None, [ctypes.c_int, ctypes.c_int]
    fn(int(tile), int(plant))
    return True


def supports_gpu() -> bool:
    return bool(_lib().llama_supports_gpu_offload())


def library_dir() -> Path | None:
    return _LIB_DIR


def library_files() -> list[Path]:
    """The shared libraries of the loaded llama.cpp (libllama and its ggml siblings)."""
    if _LIB_DIR is None:
        return []
    return sorted(p for p in _LIB_DIR.iterdir() if p.name.startswith(("libllama", "libggml"))
                  and ".so" in p.name and p.is_file() and not p.is_symlink())


def _lib() -> ModuleType:
    if _L is None:
        raise DflashError("llama.cpp library not loaded (call load_library first)")
    return _L


def _last_log() -> str:
    """What llama.cpp said about the failure since the last _LOG.clear(): the line that names the
    cause ("error loading model: unknown model architecture: ...") rather than the generic last
    one ("failed to load model")."""
    for msg in _LOG:
        if "error" in msg.lower() and not msg.rstrip().endswith("failed to load model"):
            return msg
    return _LOG[-1] if _LOG else "no message from llama.cpp"


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: int, requantize: bool = False) -> None:
    """Quantize the GGUF `src` to the llama_ftype `ftype` with llama.cpp's own quantizer, one
    thread (deterministic), into `dst`. `requantize` lets it start from quantized tensors (ftype 0,
    all F32, then writes each tensor's exact dequantization)."""
    L = _lib()
    params = L.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = ftype
    params.allow_requantize = requantize
    _LOG.clear()
    stage(f"quantization of {src}")
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LlamaError(f"llama.cpp could not quantize {src} to ftype {ftype}: {_last_log()}")


# ---------------------------------------------------------------------------------------------
# ggml devices and its RPC backend (libggml, libggml-base and libggml-rpc of the loaded library)

@functools.lru_cache(maxsize=1)
def _ggml() -> ctypes.CDLL:
    """libggml (the backend registry) with the prototypes dflash calls (one process, one library)."""
    if _LIB_DIR is None:
        raise DflashError("llama.cpp library not loaded (call load_library first)")
    lib = ctypes.CDLL(str(_LIB_DIR / "libggml.so"))
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, res, args in (("ggml_backend_dev_count", sz, []), ("ggml_backend_dev_get", vp, [sz]),
                            ("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
                            ("ggml_backend_register", None, [vp]),
                            ("ggml_backend_reg_dev_count", sz, [vp]), ("ggml_backend_reg_dev_get", vp, [vp, sz]),
                            ("ggml_backend_dev_type", ctypes.c_int, [vp]),
                            ("ggml_backend_dev_backend_reg", vp, [vp]),
                            ("ggml_backend_reg_name", ctypes.c_char_p, [vp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


@functools.lru_cache(maxsize=1)
def _ggml_rpc() -> ctypes.CDLL:
    """libggml-rpc with the prototypes dflash calls."""
    if _LIB_DIR is None:
        raise DflashError("llama.cpp library not loaded (call load_library first)")
    path = _LIB_DIR / "libggml-rpc.so"
    if not path.is_file():
        raise DflashError(f"the llama.cpp library in {_LIB_DIR} has no RPC backend (libggml-rpc.so): "
                          f"dflash's builds have it; rebuild with `dflash build`, or build yours with -DGGML_RPC=ON")
    lib = ctypes.CDLL(str(path))
    vp = ctypes.c_void_p
    lib.ggml_backend_rpc_add_server.restype, lib.ggml_backend_rpc_add_server.argtypes = vp, [ctypes.c_char_p]
    lib.ggml_backend_rpc_start_server.restype = None
    lib.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(vp)]
    return lib


def gpu_devices() -> list[int]:
    """The local GPU devices of the loaded library (ggml device handles), in ggml's order: what
    hip:N / cuda:N / vulkan:N index (vulkan:N through GGML_VK_VISIBLE_DEVICES: engine.vulkan_visible).
    RPC devices are not among them."""
    g = _ggml()
    out: list[int] = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)  # never NULL for i < count
        reg_name = (g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(dev)) or b"").decode()
        if g.ggml_backend_dev_type(dev) in (1, 2) and not reg_name.startswith("RPC"):  # GPU, IGPU
            out.append(int(dev))
    return out


def _extra_buffer_types(g: ctypes.CDLL) -> tuple[str, ...]:
    """The names of the extra buffer types the CPU device of the ggml in `g` (libggml) offers,
    through the CPU backend's `ggml_backend_dev_get_extra_bufts` (ggml_backend_reg_get_proc_address)."""
    vp = ctypes.c_void_p
    g.ggml_backend_dev_by_type.restype, g.ggml_backend_dev_by_type.argtypes = vp, [ctypes.c_int]
    g.ggml_backend_dev_backend_reg.restype, g.ggml_backend_dev_backend_reg.argtypes = vp, [vp]
    g.ggml_backend_reg_get_proc_address.restype = vp
    g.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    g.ggml_backend_buft_name.restype, g.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [vp]
    dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return ()
    fn = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return ()
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(fn)(dev)  # NULL-terminated
    out: list[str] = []
    while bufts and bufts[len(out)]:
        out.append((g.ggml_backend_buft_name(bufts[len(out)]) or b"?").decode(errors="replace"))
    return tuple(out)


def cpu_extra_buffer_types() -> tuple[str, ...]:
    """The extra buffer types the loaded library's CPU device offers (where llama.cpp puts weights
    unless --no-repack), in its order of preference, e.g. ("AMX", "CPU_REPACK"). "AMX" is there only
    when the library has AMX kernels and the kernel granted AMX to this process (ggml_amx_init,
    ggml-cpu/amx/amx.cpp: arch_prctl ARCH_REQ_XCOMP_PERM); without it those weights go to other kernels."""
    return _extra_buffer_types(_ggml())


_PROBE = "import sys; from dflash.native import llama; print('\\n'.join(llama.probe_main(sys.argv[1])))"


def probe_cpu_extra_buffer_types(lib_dir: str | os.PathLike[str], env: dict[str, str] | None = None,
                                 timeout: float = 120) -> tuple[str, ...]:
    """cpu_extra_buffer_types() of the library in `lib_dir` without loading llama.cpp here: in this
    process when it loaded that very library, else in a fresh Python process (with `env`) that loads
    only its ggml, so that nothing is loaded before dflash exports the flags a library reads once.
    LlamaError when that process fails."""
    d = Path(lib_dir).resolve()
    if _LIB_DIR is not None and d == _LIB_DIR:
        return cpu_extra_buffer_types()
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(d)], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaError(f"cannot learn which CPU buffer types {d} offers: {e}".splitlines()[0]) from None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise LlamaError(f"cannot learn which CPU buffer types {d} offers: {tail}")
    return tuple(line.strip() for line in r.stdout.splitlines() if line.strip())


def probe_main(lib_dir: str) -> tuple[str, ...]:
    """The probe process of probe_cpu_extra_buffer_types: ggml of `lib_dir` only (no libllama)."""
    d = Path(lib_dir)
    if not (d / "libggml.so").is_file():
        raise DflashError(f"no libggml.so in {d}")
    _preload_ggml(d)
    return _extra_buffer_types(ctypes.CDLL(str(d / "libggml.so")))


def rpc_add_servers(endpoints: list[str]) -> list[int]:
    """Register RPC servers (as llama.cpp's --rpc does) and return their devices' handles, server
    by server. Call only after dflash.native.rpc.probe answered for each: ggml aborts on a dead server."""
    g, r = _ggml(), _ggml_rpc()
    out: list[int] = []
    for ep in endpoints:
        stage(f"RPC server registration ({ep})")
        reg = r.ggml_backend_rpc_add_server(ep.encode())  # ggml keeps one per endpoint
        if not reg:
            raise LlamaError(f"RPC server {ep} offers no device")
        if ep not in _RPC_REGISTERED:  # a second engine in this process (a memory estimate) reuses it
            g.ggml_backend_register(reg)
            _RPC_REGISTERED.add(ep)
        out += [int(g.ggml_backend_reg_dev_get(reg, i)) for i in range(g.ggml_backend_reg_dev_count(reg))]
    return out


def rpc_serve(endpoint: str, threads: int, device: str) -> None:
    """Serve this process's `device` ("cpu" or "gpu:N", the N-th local GPU) over RPC at `endpoint`
    (HOST:PORT): blocks while the server runs (one client at a time); returns only when ggml could
    not set it up (its reason is in the captured native output)."""
    g, r = _ggml(), _ggml_rpc()
    dev: int | None
    if device == "cpu":
        dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    else:
        gpus = gpu_devices()
        n = int(device.partition(":")[2])
        if n >= len(gpus):
            raise LlamaError(f"the loaded library has {len(gpus)} GPU device(s), no {device}")
        dev = gpus[n]
    if not dev:
        raise LlamaError(f"the loaded library has no {device} device")
    devs = (ctypes.c_void_p * 1)(dev)
    stage(f"RPC server at {endpoint}")
    r.ggml_backend_rpc_start_server(endpoint.encode(), None, threads, 1, devs)


class Model:
    """A loaded GGUF. Weights go to llama.cpp's extra buffer types (AMX, repacked) as llama.cpp
    places them by default: in the exact flavor those kernels are batch-invariant too.
    `extra_bufts=False` keeps them in plain CPU buffers (llama.cpp's --no-repack): the kernels a
    CPU served over RPC runs, since the RPC backend allocates plain buffers on the server.

    Placement: n_gpu_layers/main_gpu/tensor_split as llama.cpp takes them; `devices` (ggml device
    handles) restricts offloading to those devices, in that order (RPC devices, a local and a
    remote device); tensor_split then indexes them. `no_alloc` loads metadata and tensor shapes
    only (llama.cpp's no_alloc): contexts on such a model compute what they would allocate
    (memory()) and cannot decode."""

    def __init__(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0,
                 main_gpu: int = 0, tensor_split: list[float] | None = None, devices: list[int] | None = None,
                 extra_bufts: bool = True, no_alloc: bool = False, mmap: bool = True) -> None:
        L = _lib()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        mp.main_gpu = main_gpu
        mp.use_extra_bufts = extra_bufts
        mp.no_alloc = no_alloc  # metadata and tensor shapes only: sizes are computed, nothing is read
        if no_alloc or not mmap:
            mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE: weights read into buffers (no_alloc maps nothing either)
        self._split: ctypes.Array[ctypes.c_float] | None = None
        self._devices: ctypes.Array[ctypes.c_void_p] | None = None
        if devices:
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
            mp.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split:  # layers spread over several devices in these proportions
            self._split = (ctypes.c_float * len(tensor_split))(*tensor_split)
            mp.tensor_split = self._split
            mp.split_mode = L.LLAMA_SPLIT_MODE_LAYER
        elif n_gpu_layers:
            mp.split_mode = L.LLAMA_SPLIT_MODE_NONE  # everything on main_gpu
        _LOG.clear()
        stage(f"model load ({path})")
        self.ptr: int | None = L.llama_model_load_from_file(str(path).encode(), mp)  # llama_model *
        if not self.ptr:
            raise LlamaError(f"llama.cpp could not load {path}: {_last_log()}")
        self.path = str(path)
        self.vocab: int = L.llama_model_get_vocab(self.ptr)  # const llama_vocab *, never NULL
        if L.llama_vocab_type(self.vocab) == L.LLAMA_VOCAB_TYPE_NONE:
            L.llama_model_free(self.ptr)
            self.ptr = None
            raise ModelError(f"{path} has no vocabulary (tokenizer model 'none'): it cannot tokenize a prompt")
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.ptr))

    def tokenize(self, text: str) -> list[int]:
        L = _lib()
        data = text.encode()
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, True, False)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, True, False)
        if n < 0:
            raise LlamaError("tokenization failed")
        return [int(t) for t in buf[:n]]

    def piece(self, token: int) -> bytes:
        L = _lib()
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)]

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self.piece(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return bool(_lib().llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        if getattr(self, "ptr", None):
            _lib().llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Context:
    """One sequence's context. `decode` runs one llama_decode over one band."""

    def __init__(self, model: Model, n_ctx: int, n_threads: int, *, flash_attn: bool | None = False,
                 max_band: int = 512, eval_callback: object = None, swa_full: bool = True,
                 op_offload: bool | None = None) -> None:
        # eval_callback: a ggml_backend_sched_eval_callback (GraphTap.callback), or None;
        # op_offload: None keeps llama.cpp's default (on)
        L = _lib()
        self.model = model
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = max(max_band, 1)
        cp.n_ubatch = max(max_band, 1)
        cp.n_seq_max = 1
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn is None  # llama.cpp's default
                              else L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.no_perf = True
        # a full-size sliding-window cache, pinned (llama.cpp's default today): a window-sized one is a
        # ring of n_swa + n_ubatch cells (src/llama-kv-cache-iswa.cpp:73), so its contents, and which
        # positions a band sees, would depend on the width (see dflash/proof/records.py, kv_cache)
        cp.swa_full = swa_full
        if op_offload is not None:
            cp.op_offload = op_offload
        if eval_callback is not None:
            cp.cb_eval = eval_callback
            cp.cb_eval_user_data = None
        _LOG.clear()
        stage(f"context creation ({n_ctx} tokens)")
        self.ptr: int | None = L.llama_init_from_model(model.ptr, cp)  # llama_context *
        if not self.ptr:
            raise LlamaError(f"llama.cpp could not create a context of {n_ctx} tokens: {_last_log()}")
        self.n_ctx = int(L.llama_n_ctx(self.ptr))
        self.max_band = int(cp.n_batch)
        self.swa_full = bool(cp.swa_full)
        self.mem: int | None = L.llama_get_memory(self.ptr)  # llama_memory_t
        self.batch: ctypes.Structure = L.llama_batch_init(self.max_band, 0, 1)  # llama_batch
        self.n_vocab = model.n_vocab

    def memory(self) -> dict[str, int]:
        """What this context holds, in bytes over every buffer type (for a no_alloc model: what
        llama.cpp would allocate), from llama_dflash_memory (cpu_kernels/patches/common)."""
        _lib()
        assert _LIB_DIR is not None
        fn = getattr(ctypes.CDLL(str(_LIB_DIR / "libllama.so")), "llama_dflash_memory", None)
        if fn is None:
            raise DflashError(f"the llama.cpp library in {_LIB_DIR} cannot report memory sizes "
                              f"(llama_dflash_memory is part of dflash's builds)")
        out = (ctypes.c_uint64 * 8)()
        fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
        fn(self.ptr, out)
        return dict(zip(("weights", "context", "compute", "kv", "compressed_kv", "indexer_cache",
                         "compressor_states", "kv_unused_base"), (int(x) for x in out), strict=True))

    def clear(self) -> None:
        """Forget every cached token (cache-cold start for the next request)."""
        _lib().llama_memory_clear(self.mem, True)

    def truncate(self, pos: int) -> bool:
        """Forget the cached positions from `pos` on; False when the memory cannot drop a suffix
        (a DeepSeek-V4 compressor's pending rows, a recurrent state): restore a saved state instead."""
        return bool(_lib().llama_memory_seq_rm(self.mem, 0, pos, -1))

    def save_state(self) -> bytes:
        """The sequence's whole state (every cache and pending compressor row), for restore_state."""
        L = _lib()
        size = int(L.llama_state_seq_get_size(self.ptr, 0))
        buf = (ctypes.c_uint8 * size)()
        if int(L.llama_state_seq_get_data(self.ptr, buf, size, 0)) != size:
            raise LlamaError(f"llama.cpp could not save the sequence state ({size} bytes): {_last_log()}")
        return bytes(buf)

    def restore_state(self, state: bytes) -> None:
        """Put back a state save_state returned (the cache afterwards is the one saved)."""
        L = _lib()
        L.llama_memory_seq_rm(self.mem, 0, -1, -1)  # a whole sequence is always removable
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(L.llama_state_seq_set_data(self.ptr, buf, len(state), 0)) == 0:
            raise LlamaError(f"llama.cpp could not restore the sequence state ({len(state)} bytes): {_last_log()}")

    def decode(self, tokens: Sequence[int], pos: int, logits: str = "all") -> npt.NDArray[np.float32] | None:
        """Decode `tokens` at positions pos.. in one llama_decode call.

        logits: "all" returns a (width, n_vocab) float32 copy, "last" a (1, n_vocab) copy,
        "none" requests no output rows and returns None."""
        L = _lib()
        w = len(tokens)
        if not 1 <= w <= self.max_band:
            raise LlamaError(f"band width {w} outside 1..{self.max_band}")
        if pos + w > self.n_ctx:
            raise LlamaError(f"positions {pos}..{pos + w - 1} exceed the context of {self.n_ctx}")
        b: Any = self.batch
        for j, t in enumerate(tokens):
            b.token[j] = t
            b.pos[j] = pos + j
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = 0
            b.logits[j] = logits == "all" or (logits == "last" and j == w - 1)
        b.n_tokens = w
        rc = L.llama_decode(self.ptr, b)
        if rc != 0:
            raise LlamaError(f"llama_decode failed (rc={rc}) at position {pos}, width {w}: {_last_log()}")
        if logits == "none":
            return None
        rows = w if logits == "all" else 1
        ptr = L.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).copy()

    def close(self) -> None:
        if getattr(self, "ptr", None):
            L = _lib()
            L.llama_batch_free(self.batch)
            L.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Graph tap: observe node outputs through llama.cpp's cb_eval (ggml_backend_sched_eval_callback)

_GGML_MAX_DIMS, _GGML_MAX_SRC, _GGML_MAX_NAME, _GGML_MAX_OP_PARAMS = 4, 10, 64, 64
_NP_TYPES = {0: np.float32, 1: np.float16, 26: np.int32}  # GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32


class _GgmlTensor(ctypes.Structure):
    """The head of struct ggml_tensor (ggml.h at the pinned commit) up to its name."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
    ]


def _ggml_base() -> ctypes.CDLL:
    if _LIB_DIR is None:
        raise DflashError("llama.cpp library not loaded (call load_library first)")
    lib = ctypes.CDLL(str(_LIB_DIR / "libggml-base.so"))
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
    lib.ggml_op_desc.restype = ctypes.c_char_p
    return lib


class GraphTap:
    """Copies the outputs of graph nodes whose name passes `want(name)` (F32, F16 and I32 only).

    Pass `tap.callback` as a Context's eval_callback; after each decode, `take()` returns the
    list of (name, op, ne, array) in graph order, arrays shaped like numpy views of the tensor
    (ne reversed: outermost first)."""

    def __init__(self, want: Callable[[str], object]) -> None:  # want(name): truthy to copy that node
        L = _lib()
        self._want = want
        self._base = _ggml_base()
        self._nodes: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []
        self._error: BaseException | None = None

        @L.ggml_backend_sched_eval_callback
        def cb(t_ptr: int, ask: bool, user: int | None) -> bool:  # ggml_tensor * (never NULL), bool, void *
            try:
                return observe(t_ptr, ask)
            except BaseException as e:  # ctypes would print and drop it; take() raises it instead
                if self._error is None:
                    self._error = e
                return not ask  # asked: decline the node; observing: let the graph run on

        def observe(t_ptr: int, ask: bool) -> bool:
            t = ctypes.cast(t_ptr, ctypes.POINTER(_GgmlTensor)).contents
            dtype = _NP_TYPES.get(t.type)
            name = t.name.decode(errors="replace")
            if ask:
                return dtype is not None and bool(self._want(name))
            if dtype is None:
                return True
            n = int(self._base.ggml_nbytes(t_ptr))
            raw = np.empty(n, dtype=np.uint8)
            self._base.ggml_backend_tensor_get(t_ptr, raw.ctypes.data, 0, n)
            ne, nb = tuple(t.ne), tuple(t.nb)
            item = np.dtype(dtype).itemsize
            arr = np.lib.stride_tricks.as_strided(
                raw.view(dtype) if n % item == 0 else raw[: n - n % item].view(dtype),
                shape=ne[::-1], strides=nb[::-1]).copy()
            self._nodes.append((name, self._base.ggml_op_desc(t_ptr).decode(), ne, arr))
            return True

        self.callback: ctypes._CFunctionType = cb

    def take(self) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
        """The nodes seen since the last take(); an error raised while copying one is raised here."""
        nodes, self._nodes = self._nodes, []
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return nodes
