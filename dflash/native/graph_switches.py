"""What changes a run's kernels or graph beyond its library files, model and device: the
environment switches llama.cpp reads, and the graph switches of each architecture that depend on
the ubatch width or on how far the context reaches. Both are read off the pinned llama.cpp source
(llama-cpp-python 0.3.36's vendor/llama.cpp) and dflash's patch sets; the citations are
`file:line` there. Qualification records (dflash/proof/records.py) key on the first, and qualify's
coverage check (dflash/proof/qualify.py) reports the second.

Environment switches. ENV_SWITCHES are the ones that choose another kernel or another graph: a
record made with one set (or unset) does not vouch for a run where it differs. "gpu" ones count on
a CUDA/HIP device only. dflash's own flags that the libraries read (ENV_BY_SETTINGS) enter the key
through dflash/core/settings.py. ENV_IGNORED lists every other `getenv` of the pinned source in
ggml-cpu, ggml-cuda, ggml-vulkan, ggml's core and src/: they print, trace or place memory, and change no result.
tests/test_graph_switches.py greps the source and fails on a name in none of the three lists.

Graph switches (GRAPH_SWITCHES, by `general.architecture` as llama.cpp spells it):
  kind "width":    the graph of a ubatch depends on its width (q1's one-token ubatches take one
                   path, wider bands another). qualify compares every width with q1, so a record
                   proves a width only on the side of the threshold it was run on.
  kind "position": the graph flips once the context reaches a position computed from the model's
                   metadata. `position(meta)` is a position at which it has surely flipped
                   (padding can flip it earlier); a prompt longer than that crosses it.
A record never covers a prompt longer than its own (records: `positions`), so a switch that its
prompt did not cross is never vouched for: the covered length stops short of it.
"""
from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.cpu_isa import host_flags


@dataclass(frozen=True)
class EnvSwitch:
    name: str
    source: str   # file:line in the pinned llama.cpp source
    effect: str
    scope: str = "all"  # "all": every run (llama.cpp itself, the CPU backend); "gpu": CUDA/HIP devices


_KLEIDIAI = "ggml/src/ggml-cpu/kleidiai/kleidiai.cpp"
_SPACEMIT = "ggml/src/ggml-cpu/spacemit/ime_env.cpp"
_CUDA = "ggml/src/ggml-cuda/ggml-cuda.cu"
_VK = "ggml/src/ggml-vulkan/ggml-vulkan.cpp"
_VK_EXACT = "vulkan_kernels/patches/exact/0002-ggml-vulkan-one-shader-every-width.patch"  # in this repository

ENV_SWITCHES: tuple[EnvSwitch, ...] = (
    EnvSwitch("GGML_CPU_TILED_MM", "ggml/src/ggml-cpu/tiled/tiled.cpp:577",
              "0 turns the tiled K-quant matrix kernels off (vec_dot kernels run instead)"),
    EnvSwitch("GGML_CPU_TILED_MM_FORCE", "ggml/src/ggml-cpu/tiled/tiled.cpp:588",
              "1 takes the tiled path also where it does not pay"),
    EnvSwitch("GGML_CPU_DISABLE_FUSION", "ggml/src/ggml-cpu/ggml-cpu.c:3928",
              "1 turns the CPU backend's op fusion off"),
    EnvSwitch("GGML_KLEIDIAI_SME", f"{_KLEIDIAI}:309", "KleidiAI's SME kernels on or off (Arm)"),
    EnvSwitch("GGML_TOTAL_THREADS", f"{_KLEIDIAI}:310", "KleidiAI's thread hint, which sizes its work chunks (Arm)"),
    EnvSwitch("GGML_KLEIDIAI_CHUNK_MULTIPLIER", f"{_KLEIDIAI}:311", "how KleidiAI cuts a matrix product (Arm)"),
    EnvSwitch("SPACEMIT_CORE_ARCH", f"{_SPACEMIT}:161", "the SpacemiT IME kernels' core type (RISC-V)"),
    EnvSwitch("SPACEMIT_PERFER_CORE_ARCH", f"{_SPACEMIT}:178", "the SpacemiT IME kernels' preferred core type"),
    EnvSwitch("SPACEMIT_PERFER_CORE_ID", f"{_SPACEMIT}:183", "the SpacemiT IME kernels' preferred core"),
    EnvSwitch("SPACEMIT_MEM_BACKEND", f"{_SPACEMIT}:264", "the SpacemiT IME kernels' memory backend"),
    EnvSwitch("SPACEMIT_DISABLE_TCM", f"{_SPACEMIT}:265", "the SpacemiT IME kernels without tightly coupled memory"),
    EnvSwitch("LLAMA_ATTN_ROT_DISABLE", "src/llama-kv-cache.cpp:315",
              "1 drops the Hadamard rotation of a quantized KV cache (another graph)"),
    EnvSwitch("LLAMA_GRAPH_REUSE_DISABLE", "src/llama-context.cpp:281", "1 rebuilds every graph instead of reusing it"),
    EnvSwitch("GGML_CUDA_DISABLE_FUSION", f"{_CUDA}:3446", "1 turns the CUDA backend's op fusion off", "gpu"),
    EnvSwitch("GGML_CUDA_GRAPH_OPT", f"{_CUDA}:4624", "1 reorders the graph for concurrent streams", "gpu"),
    EnvSwitch("GGML_CUDA_CUBLAS_COMPUTE_TYPE", f"{_CUDA}:1636", "the compute type of cuBLAS matrix products", "gpu"),
    EnvSwitch("GGML_CUDA_MMQ_PREC", "ggml/src/ggml-cuda/mmq.cu:96", "the precision of the MMQ kernels", "gpu"),
    EnvSwitch("GGML_OP_OFFLOAD_MIN_BATCH", f"{_CUDA}:5825",
              "the batch from which ops on host-resident weights run on the GPU (default 32)", "gpu"),
    EnvSwitch("GGML_CUDA_DISABLE_GRAPHS", "ggml/src/ggml-cuda/common.cuh:1289", "CUDA graphs off", "gpu"),
    EnvSwitch("GGML_CUDA_PDL", "ggml/src/ggml-cuda/common.cuh:1694", "programmatic dependent launch off", "gpu"),
    EnvSwitch("GGML_CUDA_DEVICES", f"{_CUDA}:236", "which GPUs the backend sees (what cuda:N names)", "gpu"),
    EnvSwitch("GGML_CUDA_ALLREDUCE", f"{_CUDA}:1220", "the all-reduce of a tensor-parallel split", "gpu"),
    EnvSwitch("GGML_CUDA_AR_COPY_THRESHOLD", "ggml/src/ggml-cuda/allreduce.cu:423", "the all-reduce's copy path",
              "gpu"),
    EnvSwitch("GGML_CUDA_AR_COPY_CHUNK_BYTES", "ggml/src/ggml-cuda/allreduce.cu:426", "the all-reduce's chunks", "gpu"),
    EnvSwitch("GGML_CUDA_AR_BF16_THRESHOLD", "ggml/src/ggml-cuda/allreduce.cu:435",
              "from which size the all-reduce sends BF16", "gpu"),
    EnvSwitch("DFLASH_VK_EXACT", f"{_VK_EXACT}:16",
              "0: llama.cpp's own Vulkan routing in the exact build; plant, plant-fusion, plant-kpar, plant-fa, "
              "plant-chunk: planted bugs",
              "gpu"),
    EnvSwitch("DFLASH_VK_KPAR_CHUNKS", "vulkan_kernels/patches/exact/0006-ggml-vulkan-k-parallel-narrow.patch:20",
              "Vulkan exact narrow products: chunks of a row computed side by side (another geometry)", "gpu"),
    EnvSwitch("DFLASH_VK_FA_SPLIT", "vulkan_kernels/patches/exact/0012-ggml-vulkan-fa-fixed-splits.patch:43",
              "Vulkan exact flash attention: another split size in cells (another sum of a row's cells)", "gpu"),
    EnvSwitch("DFLASH_VK_FA_ROWS", "vulkan_kernels/patches/exact/0013-ggml-vulkan-fa-rows-per-workgroup.patch:17",
              "Vulkan exact flash attention: the most query rows per workgroup (another geometry)", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_COOPMAT", f"{_VK}:4060", "Vulkan: no cooperative-matrix shaders", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_COOPMAT2", f"{_VK}:4068", "Vulkan: no NV cooperative-matrix-2 shaders", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_COOPMAT2_DECODE_VECTOR", f"{_VK}:4072", "Vulkan: another coopmat2 dequant path", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_INTEGER_DOT_PRODUCT", f"{_VK}:4076", "Vulkan: no int8 dot-product (MMQ) shaders", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_BFLOAT16", f"{_VK}:4081", "Vulkan: no bfloat16 shaders", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_DOT2", f"{_VK}:4093", "Vulkan: no mixed-precision dot2 instructions", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_F16", f"{_VK}:4269", "Vulkan: no fp16 arithmetic (f32 accumulators)", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_GRAPH_OPTIMIZE", f"{_VK}:4022", "Vulkan: the graph is not reordered for fusion",
              "gpu"),
    EnvSwitch("GGML_VK_DISABLE_OCP_FP4", f"{_VK}:4506", "Vulkan: another MXFP4 decode", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_MULTI_ADD", f"{_VK}:4512", "Vulkan: additions not fused", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_FUSION", f"{_VK}:4897", "Vulkan: no op fusion", "gpu"),
    EnvSwitch("GGML_VK_DISABLE_MMVQ", f"{_VK}:4908", "Vulkan: no int8 mat-vec shaders", "gpu"),
    EnvSwitch("GGML_VK_FORCE_MMVQ", f"{_VK}:4910", "Vulkan: int8 mat-vec shaders wherever they exist", "gpu"),
    EnvSwitch("GGML_VK_FA_SPARSE_DISABLE", f"{_VK}:8136", "Vulkan: flash attention without the sparse gather", "gpu"),
)

# dflash's flags the libraries read; the record's key covers them through Settings (library_id.library_key)
ENV_BY_SETTINGS = {
    "DFLASH_DS4_INDEXER_SHORTCUT": "cpu_kernels/patches/exact/0006-llama-ds4-indexer-all-pooled-shortcut.patch",
    "DFLASH_DS4_INDEXER_TILE": "cpu_kernels/patches/exact/0007-llama-ds4-indexer-tiles.patch",
    "DFLASH_DS4_RAW_WINDOW": "cpu_kernels/patches/exact/0008-llama-ds4-raw-window.patch",
    "LUCE_MMVQ_MAX_NCOLS": "hip_kernels/ggml/dflash-mmvq.cu:36",
    "DFLASH_NARROW_MMVQ": "hip_kernels/ggml/dflash-mmvq.cu:56",
}

# read by the pinned source, and no kernel or graph depends on them (logging, tracing, memory
# placement, backend loading, thread wake-ups, the RPC build id dflash sets itself)
ENV_IGNORED = frozenset({
    "GGML_NO_BACKTRACE", "GGML_BACKTRACE_LLDB", "GGML_SCHED_DEBUG", "GGML_SCHED_DEBUG_REALLOC", "GGML_META_DEBUG",
    "GGML_BACKEND_PATH", "GGML_DISABLE_VULKAN", "KMP_BLOCKTIME", "OMP_WAIT_POLICY",
    "LLAMA_KV_CACHE_DEBUG", "LLAMA_GRAPH_INPUT_DEBUG", "LLAMA_GRAPH_RESULT_DEBUG", "LLAMA_BATCH_DEBUG",
    "LLAMA_TRACE", "LLAMA_DSV4_COMPRESS_DEBUG",
    "GGML_CUDA_ENABLE_UNIFIED_MEMORY", "GGML_CUDA_P2P", "GGML_CUDA_NO_PINNED", "GGML_CUDA_REGISTER_HOST",
    "DFLASH_RPC_BUILD_ID",
    # the exact Vulkan flavor's flash-attention scratch bound: how many query rows one dispatch takes
    # (a row's arithmetic is the same in any chunk; tests/test_vulkan.py lowers it)
    "DFLASH_VK_FA_SCRATCH",
    # ggml-vulkan: queues, submission, memory placement, logging, debug-build checks; the devices it
    # lists (dflash sets GGML_VK_VISIBLE_DEVICES from --device vulkan:N, and records key the device)
    "GGML_VK_ALLOW_GRAPHICS_QUEUE", "GGML_VK_ALLOW_SYSMEM_FALLBACK", "GGML_VK_ASYNC_USE_TRANSFER_QUEUE",
    "GGML_VK_DEBUG_MARKERS", "GGML_VK_DISABLE_ASYNC", "GGML_VK_DISABLE_DESCRIPTOR_REUSE",
    "GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM", "GGML_VK_ENABLE_MEMORY_PRIORITY", "GGML_VK_FORCE_MAX_ALLOCATION_SIZE",
    "GGML_VK_FORCE_MAX_BUFFER_SIZE", "GGML_VK_MAX_NODES_PER_SUBMIT", "GGML_VK_MEMORY_LOGGER", "GGML_VK_PERF_LOGGER",
    "GGML_VK_PERF_LOGGER_CONCURRENT", "GGML_VK_PERF_LOGGER_FREQUENCY", "GGML_VK_PIPELINE_STATS",
    "GGML_VK_PREFER_HOST_MEMORY", "GGML_VK_SERIALIZE_SUBMISSIONS", "GGML_VK_SUBALLOCATION_BLOCK_SIZE",
    "GGML_VK_SYNC_LOGGER", "GGML_VK_VISIBLE_DEVICES", "GGML_VULKAN_OUTPUT_TENSOR", "GGML_VULKAN_SKIP_CHECKS",
})


def kernel_switches(env: Mapping[str, str], gpu: bool = False) -> tuple[tuple[str, str], ...]:
    """(name, value) of every switch of ENV_SWITCHES set in `env` (the "gpu" ones only with `gpu`),
    in the table's order; a switch set to the empty string counts as set (getenv sees it)."""
    return tuple((s.name, env[s.name]) for s in ENV_SWITCHES
                 if s.name in env and (s.scope == "all" or gpu))


@dataclass(frozen=True)
class GraphSwitch:
    archs: tuple[str, ...]  # general.architecture; () = every architecture
    what: str
    kind: str               # "width" or "position" (see the module doc)
    source: str             # file:line and the condition, in the pinned source
    threshold: int | None = None  # kind width: the graph differs between ubatches of <= and > this many tokens
    position: Callable[[Mapping[str, Any]], int | None] | None = None  # kind position: see the module doc


def _ds4_top_k(meta: Mapping[str, Any]) -> int | None:
    """DeepSeek-V4: the indexer mask of a ubatch has max(256, pad(cells, 256)) columns, about one per 4
    positions (src/llama-kv-cache-dsv4.cpp:641); the top-k takes every column while there are no more
    than indexer_top_k of them. With top-k 256 the first band to reach position 1,024 is past it
    (tests/test_ds4_long_context.py); below 256 it applies from the start."""
    k = meta.get("indexer.top_k")
    return None if not isinstance(k, int) else 4 * 256 * (k // 256)


def _glm5_gather(meta: Mapping[str, Any]) -> int | None:
    k, pool = meta.get("indexer.top_k"), meta.get("indexer.kpool")
    if not isinstance(k, int) or not isinstance(pool, int) or pool <= 0:
        return None
    return pool * (k // pool) + pool - 1  # n_kv >= position + 1 > n_sel, whatever the padding


def _glm5_pools(meta: Mapping[str, Any]) -> int | None:
    k, pool = meta.get("indexer.top_k"), meta.get("indexer.kpool")
    if not isinstance(k, int) or not isinstance(pool, int) or pool <= 0:
        return None
    return pool * (k // pool)  # complete pools outnumber top_k / kpool


def _minimax_blocks(meta: Mapping[str, Any]) -> int | None:
    k, blk = meta.get("indexer.top_k"), meta.get("indexer.block_size")
    if not isinstance(k, int) or not isinstance(blk, int) or blk <= 0:
        return None
    return blk * k  # position blocks (n_pos padded to 256, then to blocks) outnumber top_k


GATED_DELTA_NET = ("qwen3next", "qwen35", "qwen35moe", "qwen4exp", "kimi-linear", "kimi-k3", "bailingmoe3", "glm5-next")

GRAPH_SWITCHES: tuple[GraphSwitch, ...] = (
    GraphSwitch((), "sliding window", "position",
                "src/llama-hparams.h:484 `p1 - p0 >= n_swa` masks a key: from position n_swa on a token's window "
                "no longer holds position 0 (qualify requires the crossing: coverage)"),
    GraphSwitch(("deepseek4",), "compressor boundaries", "position",
                "src/llama-kv-cache-dsv4.cpp:519 `(pos + 1) % ratio`: a ratio-r compressor emits a row at "
                "positions r-1, 2r-1, ... "
                "(qualify requires the prompt to cross every ratio: coverage)"),
    GraphSwitch(("deepseek4",), "indexer top-k", "position",
                "src/models/deepseek4.cpp:671 `n_top_k = indexer_score->ne[0] < indexer_top_k ? ne[0] : "
                "indexer_top_k`; the exact library's all-pooled shortcut (patch 0006) while "
                "`inp_lid.kq_mask->ne[0] <= indexer_top_k`", position=_ds4_top_k),
    GraphSwitch(("glm5-next",), "gathered attention of small ubatches", "width",
                "src/models/glm5-next.cpp:331 `gather = n_tokens <= max_ub (16) && n_kv > n_sel`, "
                "n_sel = kpool*min(n_pool, top_k/kpool) + (kpool-1 with select_tail) (:328-329)",
                threshold=16, position=_glm5_gather),
    GraphSwitch(("glm5-next",), "indexer pool top-k", "position",
                "src/models/glm5-next.cpp:328 `n_top_pool = min(n_pool, indexer_top_k / kpool)`, n_pool "
                "padded to 64 (src/llama-memory-hybrid-idx.cpp:706)", position=_glm5_pools),
    GraphSwitch(("minimax-m3",), "MSA decode path (top-k gather)", "width",
                "src/models/minimax-m3.cpp:275 `msa_decode = n_tps == 1` (one token per stream), with flash "
                "attention on (:235 `msa_enabled = fa_on && streams_ok`)", threshold=1),
    GraphSwitch(("minimax-m3",), "MSA block top-k", "position",
                "src/models/minimax-m3.cpp:384 `K = topk_blocks < nblk ? topk_blocks : nblk`, nblk = "
                "pad(n_pos, blk)/blk (:273-274), n_pos padded to 256 (src/llama-kv-cache-msa.cpp:262)",
                position=_minimax_blocks),
    GraphSwitch(GATED_DELTA_NET, "gated delta net: recurrent or chunked", "width",
                "src/models/delta-net-base.cpp:435 `if (n_seq_tokens == 1)` autoregressive, else chunked in "
                "chunks of 64 tokens (16 for KDA, :61)", threshold=1),
    GraphSwitch((), "layer-output placement across devices", "width",
                "src/llama-context.cpp:2647 `if (ubatch.n_tokens < 32 || full_offload)` pins each layer's "
                "norm and l_last to the layer's device (runs split over devices, not fully offloaded)",
                threshold=31),
)


def for_architecture(arch: str) -> tuple[GraphSwitch, ...]:
    return tuple(s for s in GRAPH_SWITCHES if not s.archs or arch in s.archs)


def position_switches(arch: str, meta: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(what, position) of the architecture's position switches that metadata places; the sliding
    window and compressor boundaries are not among them (qualify.coverage has them from the model)."""
    out = []
    for s in for_architecture(arch):
        p = s.position(meta) if s.position is not None else None
        if p is not None:
            out.append((f"{s.what} ({arch})", p))
    return out


META_KEYS = ("indexer.top_k", "indexer.kpool", "indexer.kpool_select_tail", "indexer.block_size")


def read_meta(path: str | Path, arch: str) -> dict[str, Any]:
    """The metadata the position switches read, `<arch>.attention.<key>` of the GGUF (absent keys
    left out). The file was validated by gguf_meta.read before."""
    from gguf import GGUFReader

    reader = GGUFReader(Path(path))
    out: dict[str, Any] = {}
    for key in META_KEYS:
        f = reader.fields.get(f"{arch}.attention.{key}")
        if f is not None:
            out[key] = f.contents()
    return out


def host_fingerprint() -> str:
    """The CPU a library runs on: machine, model name and feature flags (16 hex). A built library's
    key already hashes the flags; a DFLASH_LLAMA_LIB_DIR folder's files say nothing about the host."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "CPU part")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{platform.machine()}|{model}|{' '.join(sorted(host_flags()))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
