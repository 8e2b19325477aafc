"""dflash/native/graph_switches.py against the pinned llama.cpp source: every cited line says what the table
says, every `getenv` of the CPU backend, the CUDA backend, ggml's core, src/ and dflash's patches is
listed, and the architecture names are llama.cpp's. Without the extracted source (`dflash build`
extracts it) the source checks skip; the pure ones always run."""
import re
from pathlib import Path

import pytest

from dflash.core.paths import REPO_ROOT, cache_root
from dflash.native import graph_switches
from dflash.native.build import LLAMA_CPP_PYTHON_VERSION
from dflash.proof import qualify
from dflash.run import bands

SRC = cache_root() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
needs_source = pytest.mark.skipif(not (SRC / "src" / "llama-arch.cpp").is_file(),
                                  reason="the pinned llama.cpp source is not extracted (dflash build)")
GETENV = re.compile(r"(?:getenv|ggml_cuda_ar_env_u64)\(\s*\"([A-Z0-9_]+)\"")  # the reader and CUDA's wrapper
CITE = re.compile(r"((?:ggml|src)/[\w./-]+\.(?:c|cpp|cu|cuh|h)):(\d+)")


def lines_near(rel: str, line: int, radius: int = 3) -> str:
    base = REPO_ROOT if (REPO_ROOT / rel.split("/", 1)[0]).is_dir() else SRC  # a patch of this repository
    text = (base / rel).read_text(errors="replace").splitlines()
    assert 0 < line <= len(text), f"{rel}:{line} is past the end"
    return "\n".join(text[max(0, line - 1 - radius):line + radius])


@needs_source
def test_every_env_switch_is_read_where_the_table_says():
    for s in graph_switches.ENV_SWITCHES:
        rel, line = s.source.rsplit(":", 1)
        near = lines_near(rel, int(line))
        assert s.name in GETENV.findall(near), f"{s.name}: not read at {s.source}"


@needs_source
def test_every_getenv_of_the_pinned_source_and_the_patches_is_listed():
    dirs = [SRC / "ggml/src/ggml-cpu", SRC / "ggml/src/ggml-cuda", SRC / "ggml/src/ggml-vulkan", SRC / "src"]
    files = [p for d in dirs for p in d.rglob("*") if p.suffix in (".c", ".cpp", ".cu", ".cuh", ".h")]
    files += [p for p in (SRC / "ggml/src").glob("*") if p.suffix in (".c", ".cpp")]
    for d in ("cpu_kernels/patches", "hip_kernels/patches", "hip_kernels/ggml", "rpc/patches",
              "vulkan_kernels/patches"):
        files += [p for p in (REPO_ROOT / d).rglob("*") if p.is_file()]
    names = {n for p in files for n in GETENV.findall(p.read_text(errors="replace"))}
    known = ({s.name for s in graph_switches.ENV_SWITCHES} | set(graph_switches.ENV_BY_SETTINGS)
             | graph_switches.ENV_IGNORED)
    assert {"GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE", "GGML_CPU_DISABLE_FUSION", "GGML_KLEIDIAI_SME",
            "DFLASH_DS4_INDEXER_SHORTCUT"} <= names  # the grep sees the source
    assert not names - known, f"getenv of switches no list names: {sorted(names - known)}"


@needs_source
def test_graph_switch_citations_hold_their_condition():
    """The first `file:line` of each entry holds every identifier of the condition quoted after it;
    every other line it cites exists."""
    for s in graph_switches.GRAPH_SWITCHES:
        cites = CITE.findall(s.source)
        assert cites, s.what
        rel, line = cites[0]
        code = re.search(r"`([^`]+)`", s.source[s.source.index(f"{rel}:{line}"):])
        assert code, s.what
        near = lines_near(rel, int(line))
        for name in re.findall(r"[A-Za-z_]\w*", code.group(1)):
            assert name in near, f"{s.what}: {name} not at {rel}:{line}"
        for rel, line in cites[1:]:
            lines_near(rel, int(line), 0)


@needs_source
def test_architecture_names_are_llama_cpps():
    arch = (SRC / "src/llama-arch.cpp").read_text()
    names = set(re.findall(r"\{ LLM_ARCH_\w+,\s+\"([\w.-]+)\"\s*\}", arch))
    for s in graph_switches.GRAPH_SWITCHES:
        assert set(s.archs) <= names, (s.what, set(s.archs) - names)
    models = {p.stem for p in (SRC / "src/models").glob("*.cpp")}
    for a in graph_switches.GATED_DELTA_NET:  # each builds its graph on llm_build_delta_net_base
        cpp = (SRC / "src/models" / f"{a}.cpp")
        assert a in models and re.search(r"build_(recurrent_attn|delta_net)\(", cpp.read_text()), a


def test_kernel_switches_reads_only_the_table():
    env = {"GGML_CPU_TILED_MM": "0", "GGML_CUDA_MMQ_PREC": "1", "GGML_SCHED_DEBUG": "1", "PATH": "/bin",
           "GGML_CPU_DISABLE_FUSION": ""}
    assert graph_switches.kernel_switches(env) == (("GGML_CPU_TILED_MM", "0"), ("GGML_CPU_DISABLE_FUSION", ""))
    assert graph_switches.kernel_switches(env, gpu=True) == (
        ("GGML_CPU_TILED_MM", "0"), ("GGML_CPU_DISABLE_FUSION", ""), ("GGML_CUDA_MMQ_PREC", "1"))
    assert graph_switches.kernel_switches({}) == ()


@pytest.mark.parametrize("top_k,position", [(16, 0), (255, 0), (256, 1024), (300, 1024), (512, 2048)])
def test_ds4_indexer_top_k_position(top_k, position):
    """The first position whose band runs the real top-k (README: top-k 512 keeps the shortcut for
    2,048 tokens; tests/test_ds4_long_context.py sees top-k 256 flip at 1,024)."""
    assert graph_switches.position_switches("deepseek4", {"indexer.top_k": top_k}) == [
        ("indexer top-k (deepseek4)", position)]


def test_position_switches_by_architecture():
    assert graph_switches.position_switches("deepseek4", {}) == []  # no metadata: nothing placed
    glm = dict(graph_switches.position_switches("glm5-next", {"indexer.top_k": 2048, "indexer.kpool": 4}))
    assert glm == {"gathered attention of small ubatches (glm5-next)": 2051, "indexer pool top-k (glm5-next)": 2048}
    mm = graph_switches.position_switches("minimax-m3", {"indexer.top_k": 16, "indexer.block_size": 128})
    assert mm == [("MSA block top-k (minimax-m3)", 2048)]
    assert graph_switches.position_switches("llama", {"indexer.top_k": 16}) == []
    widths = {s.what: s.threshold for s in graph_switches.for_architecture("qwen35") if s.kind == "width"}
    assert widths == {"gated delta net: recurrent or chunked": 1, "layer-output placement across devices": 31}


DS4 = (0, 4, 128, 4, 128)


def test_coverage_lists_a_position_switch_without_requiring_it():
    plans = {w: bands.plan(125, 0, DS4, w) + bands.plan(248, 125, DS4, w) for w in (1, 4)}
    c = qualify.coverage(373, DS4, 64, 125, plans, switches=[("indexer top-k (deepseek4)", 2048)])
    assert c["missing"] == []
    assert c["crossings"][-1] == {"what": "indexer top-k (deepseek4)", "position": 2048, "crossed": False}
    c = qualify.coverage(373, DS4, 64, 125, plans, switches=[("indexer top-k (deepseek4)", 0)])
    assert c["crossings"][-1]["crossed"] and c["missing"] == []
    # the compress ratios and the sliding window stay required
    c = qualify.coverage(100, DS4, 64, 34, plans, switches=[("indexer top-k (deepseek4)", 2048)])
    assert [m for m in c["missing"] if "does not cross" in m] == ["the prompt (100 tokens) does not cross the "
                                                                   "compress ratio 128"]


def test_host_fingerprint_is_stable_hex():
    a = graph_switches.host_fingerprint()
    assert a == graph_switches.host_fingerprint() and re.fullmatch(r"[0-9a-f]{16}", a)


def test_read_meta(tiny_models):
    meta = graph_switches.read_meta(tiny_models["f32"], "deepseek4")
    assert meta == {"indexer.top_k": 16}
    assert graph_switches.read_meta(Path(tiny_models["f32"]), "llama") == {}
