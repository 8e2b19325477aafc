"""The built-in tiny DeepSeek-V4 model: deterministic random weights that llama.cpp loads.

The shape satisfies this llama.cpp's deepseek4 loader: ratios only 0/4/128 with a ratio-4
layer present, 4 hyper-connections, sqrt-softplus gating, one shared KV head, an indexer key
length that is a multiple of 64 and at least the rope dimensions, and quantized rows that are
multiples of 32. The "test" tokenizer built into llama.cpp (5-character chunks) is used.

The bytes depend only on the options: the GGUF writer is fed in a fixed order from one seeded
generator, and the file is written to a temporary name and renamed into place. K-quant presets
(q4_k_m, q6_k) are the f32 model run through the loaded llama.cpp's quantizer (one thread).

The user cache (`ensure`) names each model by a key over everything its bytes depend on that
this module can see: every TinyConfig field, the writer (WRITER_VERSION and the SHA-256 of this
file's own source), and the installed gguf (its version and the SHA-256 of its modules) and numpy
(its Generator streams may change between versions). A sidecar `<model>.json` holds the model's
SHA-256 and size, written at the same time; a model is reused only when its sidecar matches its
bytes, and anything else (missing, truncated, flipped, unreadable) is rewritten. Files reach their
names only by os.replace from a temporary file in the same folder, so a crash leaves no
half-written model under a name that would be reused.
K-quant presets also depend on the llama.cpp library whose quantizer made them; its identity is
not known here, so their key holds only what `ensure(..., quantizer_key=)` is given (nothing by
default): a cached K-quant model is reused across library builds.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash.core.fileio import fsync_dir, fsync_file, sha256_file, temp_path, write_text_atomic

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

ARCH = "deepseek4"
HC = 4  # hyper-connection count (the loader asserts 4)

# Weight presets: the type of each family of matrices.
# F32/F16/Q8_0/Q4_0 put every big matrix in that type; "mxfp4" is the shape of official
# DeepSeek-V4 conversions (Q8_0 dense, MXFP4 routed experts, BF16 embeddings/output/router).
# K-quants are made by llama.cpp's own quantizer from the f32 model (the llama_ftype of each);
# matrices whose rows cannot hold 256-element blocks fall back to other types there.
QUANTIZED = {"q4_k_m": 15, "q6_k": 18}  # LLAMA_FTYPE_MOSTLY_Q4_K_M, LLAMA_FTYPE_MOSTLY_Q6_K
DIRECT = ("mxfp4", "f32", "f16", "q8_0", "q4_0")  # written by this module alone
WEIGHTS = DIRECT + tuple(QUANTIZED)
DEFAULT_WEIGHTS = "mxfp4"

Quantizer = Callable[[str, str, int], None]  # (f32 source, destination, llama_ftype)

# numpy's default_rng takes any non-negative integer; dflash keeps seeds to 32 bits (numpy's
# legacy seed range), which every preset and the cache file names accept.
SEED_MAX = 2**32 - 1
# Bump when the bytes change for a reason the source hash below cannot see (it also versions the
# cache layout: the key and the sidecar).
WRITER_VERSION = 1


MAX_IDX_HEADS = 128             # indexer heads
IDX_DIMS = (64, 128, 256)       # indexer key length: >= n_rot, a power of two (its Hadamard rotation)
MAX_TOP_K = 65536               # indexer top-k


@dataclass(frozen=True)
class TinyConfig:
    weights: str = DEFAULT_WEIGHTS
    seed: int = 1234
    ratios: tuple[int, ...] = (0, 4, 128, 4, 128)
    n_vocab: int = 512
    n_embd: int = 256
    n_head: int = 4
    head_dim: int = 128
    n_rot: int = 64
    q_lora: int = 128
    o_groups: int = 2
    o_lora: int = 64
    idx_heads: int = 4
    idx_dim: int = 64
    top_k: int = 16
    sliding_window: int = 64
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 128
    n_shared: int = 1
    hash_layers: int = 1
    n_ctx_train: int = 16384
    mtp: bool = False  # one next-n (multi-token prediction) block after the others: what `--spec mtp` drafts with

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"unknown weights {self.weights!r} (use one of {', '.join(WEIGHTS)})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in 0..{SEED_MAX}, not {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # a numpy integer keys the cache as an int
        if any(r not in (0, 4, 128) for r in self.ratios) or 4 not in self.ratios:
            raise ValueError("ratios must be 0/4/128 with at least one ratio-4 layer")
        if not 1 <= self.idx_heads <= MAX_IDX_HEADS:
            raise ValueError(f"idx_heads must be in 1..{MAX_IDX_HEADS}, not {self.idx_heads!r}")
        if self.idx_dim not in IDX_DIMS:  # at least the rope part; a power of two (its Hadamard rotation)
            raise ValueError(f"idx_dim must be one of {', '.join(map(str, IDX_DIMS))}, not {self.idx_dim!r}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 1..{MAX_TOP_K}, not {self.top_k!r}")

    @property
    def file_name(self) -> str:
        return f"tiny-ds4-{self.weights}-s{self.seed}{'-mtp' if self.mtp else ''}.gguf"

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """Every block's compress ratio: the main ones, then the next-n block's (0: sliding window only)."""
        return (*self.ratios, *((0,) if self.mtp else ()))


def _types(weights: str) -> dict[str, GGMLQuantizationType]:
    from gguf import GGMLQuantizationType as QT
    if weights == "mxfp4":
        return {"dense": QT.Q8_0, "exps": QT.MXFP4, "embd": QT.BF16, "out": QT.BF16, "router": QT.BF16}
    one = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}[weights]
    router = QT.F16 if one not in (QT.F32, QT.F16) else one
    return {"dense": one, "exps": one, "embd": one, "out": one, "router": router}


def needs_quantizer(weights: str) -> bool:
    """True for presets made by llama.cpp's quantizer (the library must be loaded first)."""
    return weights in QUANTIZED


def _temp(directory: Path) -> str:
    """A new empty file in `directory` for a model (fileio.temp_path: created exclusively, with
    the mode umask gives new files, not mkstemp's 0600: the model lands at its name with that mode)."""
    return str(temp_path(directory, ".tiny-", ".gguf"))


def write(path: str | os.PathLike[str], cfg: TinyConfig = TinyConfig(), quantize: Quantizer | None = None) -> Path:
    """Write the model to `path` atomically; returns the path. K-quant presets need `quantize`
    (dflash.native.llama.quantize, with the library loaded): it turns the f32 model into them."""
    path = Path(path)
    _write_atomic(path, cfg, quantize)
    return path


def _write_atomic(path: Path, cfg: TinyConfig, quantize: Quantizer | None,
                  before_replace: Callable[[str], None] = lambda tmp: None) -> None:
    """Write the model to a temporary file next to `path` and rename it into place;
    `before_replace(tmp)` runs on the finished temporary file first."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    if needs_quantizer(cfg.weights) and quantize is None:
        raise ValueError(f"weights {cfg.weights} are made by llama.cpp's quantizer: pass quantize")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmps = [_temp(path.parent)]
    try:
        if needs_quantizer(cfg.weights):
            _write(gguf, QT, tmps[0], replace(cfg, weights="f32"))
            tmps.append(_temp(path.parent))
            assert quantize is not None  # checked above
            quantize(tmps[0], tmps[1], QUANTIZED[cfg.weights])
        else:
            _write(gguf, QT, tmps[0], cfg)
        fsync_file(tmps[-1])  # the bytes are on disk before the name points at them
        before_replace(tmps[-1])
        os.replace(tmps[-1], path)
        fsync_dir(path.parent)  # and the name itself survives a crash
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def ds4_flash_shapes() -> TinyConfig:
    """DeepSeek-V4 Flash's published shapes (its GGUF metadata): 43 layers (two sliding-window-only,
    then ratio 4 and ratio 128 alternating), hidden 4096, 64 heads of 512 (64 rotary), q LoRA 1024,
    output LoRA 1024 in 8 groups, sliding window 128, 256 routed experts of 2048 (6 used, 1 shared,
    3 hash-routed layers), indexer 64 heads of 128 with top-k 512, vocabulary 129,280, context
    1,048,576. For `write_shapes` only: a model this size is not written with weights."""
    return TinyConfig(weights="mxfp4", ratios=(0, 0) + (4, 128) * 20 + (4,), n_vocab=129280, n_embd=4096,
                      n_head=64, head_dim=512, n_rot=64, q_lora=1024, o_groups=8, o_lora=1024, idx_heads=64,
                      idx_dim=128, top_k=512, sliding_window=128, n_expert=256, n_expert_used=6, n_ff_exp=2048,
                      n_shared=1, hash_layers=3, n_ctx_train=1048576)


def write_shapes(path: str | os.PathLike[str], cfg: TinyConfig) -> Path:
    """A GGUF with `cfg`'s metadata and tensor shapes and no weights: the data section is a sparse
    hole of the right size (nothing is written to disk for it, reads give zeros). llama.cpp loads
    it with no_alloc for memory estimates (`dflash memory`); it cannot be run meaningfully."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp(path.parent)
    try:
        _write(gguf, QT, tmp, cfg, shapes_only=True)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _write(gguf: ModuleType, QT: type[GGMLQuantizationType], out: str, c: TinyConfig,
           shapes_only: bool = False) -> None:
    rng = np.random.default_rng(c.seed)
    types = _types(c.weights)
    n_layer = len(c.layer_ratios)  # block_count counts the next-n block
    hc_dim, hc_mix = HC * c.n_embd, (2 + HC) * HC
    w = gguf.GGUFWriter(out, ARCH)
    k = lambda s: f"{ARCH}.{s}"

    w.add_name("dflash-tiny-deepseek4")
    for key, val in [("context_length", c.n_ctx_train), ("embedding_length", c.n_embd),
                     ("embedding_length_out", c.n_embd * HC), ("block_count", n_layer),
                     ("feed_forward_length", c.n_ff_exp), ("expert_feed_forward_length", c.n_ff_exp),
                     ("expert_count", c.n_expert), ("expert_used_count", c.n_expert_used),
                     ("expert_shared_count", c.n_shared), ("expert_gating_func", 4),
                     ("hash_layer_count", c.hash_layers), ("attention.head_count", c.n_head),
                     ("attention.head_count_kv", 1), ("attention.key_length", c.head_dim),
                     ("attention.value_length", c.head_dim), ("attention.q_lora_rank", c.q_lora),
                     ("attention.sliding_window", c.sliding_window),
                     ("attention.output_group_count", c.o_groups),
                     ("attention.output_lora_rank", c.o_lora),
                     ("attention.indexer.head_count", c.idx_heads),
                     ("attention.indexer.key_length", c.idx_dim),
                     ("attention.indexer.top_k", c.top_k), ("rope.dimension_count", c.n_rot),
                     ("hyper_connection.count", HC), ("hyper_connection.sinkhorn_iterations", 20)]:
        w.add_uint32(k(key), val)
    if c.mtp:
        w.add_uint32(k("nextn_predict_layers"), 1)
    for key, fval in [("expert_weights_scale", 1.5), ("attention.layer_norm_rms_epsilon", 1e-6),
                      ("attention.compress_rope_freq_base", 160000.0), ("rope.freq_base", 10000.0),
                      ("hyper_connection.epsilon", 1e-6)]:
        w.add_float32(k(key), fval)
    w.add_bool(k("expert_weights_norm"), True)
    w.add_array(k("swiglu_clamp_exp"), [10.0] * n_layer)
    w.add_array(k("swiglu_clamp_shexp"), [10.0] * n_layer)
    w.add_key_value(k("attention.compress_ratios"), list(c.layer_ratios), gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.UINT32)
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(c.n_vocab)])
    w.add_token_scores([0.0] * c.n_vocab)

    def add(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float | None = None,
            norm: bool = False, values: np.ndarray | None = None) -> None:
        if qtype not in (QT.F32, QT.F16, QT.BF16) and shape[-1] % 32:
            qtype = QT.F16
        if shapes_only:
            nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
            return
        if values is None:
            if norm:
                values = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                values = (std if std is not None else 1.0 / np.sqrt(shape[-1])) * rng.standard_normal(shape)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if qtype == QT.F32:
            w.add_tensor(name, values)
        elif qtype == QT.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            q = gguf.quants.quantize(values, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    f32 = QT.F32
    add("token_embd.weight", (c.n_vocab, c.n_embd), types["embd"], std=1.0)
    add("output_norm.weight", (c.n_embd,), f32, norm=True)
    add("output.weight", (c.n_vocab, c.n_embd), types["out"])
    add("output_hc_fn.weight", (HC, hc_dim), f32, std=0.05)
    add("output_hc_base.weight", (HC,), f32, std=0.5)
    add("output_hc_scale.weight", (1,), f32, values=np.array([0.5]))
    dense, exps = types["dense"], types["exps"]
    for i, r in enumerate(c.layer_ratios):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (c.n_embd,), f32, norm=True)
        add(b + "attn_sinks.weight", (c.n_head,), f32, std=0.5)
        add(b + "attn_q_a.weight", (c.q_lora, c.n_embd), dense)
        add(b + "attn_q_a_norm.weight", (c.q_lora,), f32, norm=True)
        add(b + "attn_q_b.weight", (c.n_head * c.head_dim, c.q_lora), dense)
        add(b + "attn_kv.weight", (c.head_dim, c.n_embd), dense)
        add(b + "attn_kv_a_norm.weight", (c.head_dim,), f32, norm=True)
        add(b + "attn_output_a.weight", (c.o_lora * c.o_groups, c.n_head * c.head_dim // c.o_groups), dense)
        add(b + "attn_output_b.weight", (c.n_embd, c.o_groups * c.o_lora), dense)
        for pre in ("hc_attn_", "hc_ffn_"):
            add(b + pre + "fn.weight", (hc_mix, hc_dim), f32, std=0.05)
            add(b + pre + "base.weight", (hc_mix,), f32, std=0.5)
            add(b + pre + "scale.weight", (3,), f32, values=np.array([0.5, 0.5, 0.5]))
        if r:
            coff = 2 if r == 4 else 1
            add(b + "attn_compressor_kv.weight", (coff * c.head_dim, c.n_embd), dense)
            add(b + "attn_compressor_gate.weight", (coff * c.head_dim, c.n_embd), dense)
            add(b + "attn_compressor_ape.weight", (r, coff * c.head_dim), f32, std=0.5)
            add(b + "attn_compressor_norm.weight", (c.head_dim,), f32, norm=True)
        if r == 4:
            add(b + "indexer.proj.weight", (c.idx_heads, c.n_embd), dense)
            add(b + "indexer.attn_q_b.weight", (c.idx_heads * c.idx_dim, c.q_lora), dense)
            add(b + "indexer_compressor_kv.weight", (2 * c.idx_dim, c.n_embd), dense)
            add(b + "indexer_compressor_gate.weight", (2 * c.idx_dim, c.n_embd), dense)
            add(b + "indexer_compressor_ape.weight", (4, 2 * c.idx_dim), f32, std=0.5)
            add(b + "indexer_compressor_norm.weight", (c.idx_dim,), f32, norm=True)
        add(b + "ffn_gate_inp.weight", (c.n_expert, c.n_embd), types["router"])
        if i < c.hash_layers and shapes_only:
            shape = (c.n_vocab, c.n_expert_used)
            w.add_tensor_info(b + "ffn_gate_tid2eid.weight", shape, np.dtype(np.int32), 4 * c.n_vocab * c.n_expert_used)
        elif i < c.hash_layers:
            tid2eid = np.stack([rng.permutation(c.n_expert)[:c.n_expert_used] for _ in range(c.n_vocab)])
            w.add_tensor(b + "ffn_gate_tid2eid.weight", tid2eid.astype(np.int32))
        else:
            add(b + "exp_probs_b.bias", (c.n_expert,), f32, std=0.05)
        add(b + "ffn_norm.weight", (c.n_embd,), f32, norm=True)
        add(b + "ffn_gate_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd), exps)
        add(b + "ffn_up_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd), exps)
        add(b + "ffn_down_exps.weight", (c.n_expert, c.n_embd, c.n_ff_exp), exps)
        add(b + "ffn_gate_shexp.weight", (c.n_ff_exp * c.n_shared, c.n_embd), dense)
        add(b + "ffn_up_shexp.weight", (c.n_ff_exp * c.n_shared, c.n_embd), dense)
        add(b + "ffn_down_shexp.weight", (c.n_embd, c.n_ff_exp * c.n_shared), dense)
        if i >= len(c.ratios):  # the next-n block: token embedding and hidden state, normed, projected
            add(b + "nextn.eh_proj.weight", (c.n_embd, 2 * c.n_embd), dense)
            add(b + "nextn.enorm.weight", (c.n_embd,), f32, norm=True)
            add(b + "nextn.hnorm.weight", (c.n_embd,), f32, norm=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if shapes_only:  # tensor infos, then a hole as large as the data section
        w.write_ti_data_to_file()
        assert w.fout is not None
        (fout,) = w.fout
        w.write_padding(fout, fout.tell())
        data = sum(w.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values())
        fout.flush()
        fout.truncate(fout.tell() + data)
    else:
        w.write_tensors_to_file()
    w.close()


@functools.lru_cache(maxsize=1)
def writer_fingerprint() -> str:
    """WRITER_VERSION and the SHA-256 of this module's source (any edit makes new cache files)."""
    try:
        source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    except OSError:  # no readable source (a zipped install): the explicit version alone
        source = "unreadable"
    return f"{WRITER_VERSION}:{source}"


@functools.lru_cache(maxsize=1)
def gguf_version() -> str:
    """The installed gguf: its version and a SHA-256 over its modules (an editable gguf-py keeps
    its version number while its writer changes)."""
    import gguf
    try:
        version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256()
    for p in sorted(Path(gguf.__file__).parent.glob("*.py")):
        try:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        except OSError:
            h.update(p.name.encode() + b"\0?")
    return f"{version}:{h.hexdigest()}"


def numpy_version() -> str:
    return np.__version__


def cache_inputs(cfg: TinyConfig, quantizer_key: str | None = None) -> dict[str, Any]:
    """Everything the cached model's key covers (JSON-ready)."""
    return {"config": dataclasses.asdict(cfg), "writer": writer_fingerprint(), "gguf": gguf_version(),
            "numpy": numpy_version(),
            "quantizer": quantizer_key if needs_quantizer(cfg.weights) else None}


def cache_key(cfg: TinyConfig, quantizer_key: str | None = None) -> str:
    blob = json.dumps(cache_inputs(cfg, quantizer_key), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def default_path(cfg: TinyConfig = TinyConfig(), quantizer_key: str | None = None) -> Path:
    """Where `ensure` keeps the model for `cfg` (it may not exist yet)."""
    from dflash.core.paths import cache_root
    stem = Path(cfg.file_name).stem
    return cache_root() / "models" / f"{stem}-{cache_key(cfg, quantizer_key)[:16]}.gguf"


def sidecar_path(model: Path) -> Path:
    return model.with_name(model.name + ".json")


def verify(path: Path, key: str) -> bool:
    """True when `path` is a model whose sidecar names `key` and matches its size and SHA-256."""
    try:
        meta = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("key") != key:
            return False
        if not path.is_file() or path.stat().st_size != meta.get("bytes"):
            return False
        return sha256_file(path) == meta.get("sha256")
    except (OSError, ValueError):  # ValueError: bad JSON or text
        return False


def ensure(cfg: TinyConfig = TinyConfig(), quantize: Quantizer | None = None,
           quantizer_key: str | None = None) -> Path:
    """The tiny model in the user cache: reused when its sidecar vouches for its bytes, else
    (first use, a stale or corrupt file) written again. `quantizer_key`, for K-quant presets,
    names the library whose quantizer `quantize` runs (part of the cache key)."""
    from dflash.core.errors import DflashError
    p = default_path(cfg, quantizer_key)
    key = cache_key(cfg, quantizer_key)
    if verify(p, key):
        return p
    side = sidecar_path(p)

    def seal(tmp: str) -> None:
        """The sidecar of the finished temporary model; it lands before the model does, so a
        crash between the two renames leaves a mismatch (rewritten next time), never a pass."""
        meta = {"key": key, "sha256": sha256_file(tmp), "bytes": os.path.getsize(tmp),
                "inputs": cache_inputs(cfg, quantizer_key)}
        write_text_atomic(side, json.dumps(meta, indent=1, sort_keys=True))

    try:
        if p.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(p))
        _write_atomic(p, cfg, quantize, before_replace=seal)
    except OSError as e:
        raise DflashError(f"cannot write the tiny model to {p}: {e.strerror or e}") from None
    return p
