"""Imports inside dflash/ run one way: no cycle, and no module imports a higher layer.

Every import counts, also one inside a function; only `if TYPE_CHECKING:` imports (types alone)
do not. A new module must be given a layer here."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dflash"

LAYERS: list[set[str]] = [
    # 0, the ground floor: pure logic and leaves every layer may use (the package's __init__
    # imports nothing at run time: its public names load on first use)
    {"dflash", "errors", "stage", "paths", "cpu_isa", "fileio", "stats", "trace", "narrow", "bands", "settings", "rpc",
     "devices", "gguf_meta", "graph_switches", "spirv"},
    # 1, what talks to llama.cpp, the build, files on disk, and typed results
    {"llama", "build", "cuda_libs", "evidence", "tiny_model", "kernel_selftest", "results", "prefill", "supervisor",
     "serving", "server"},
    # 2, runs on a loaded model: engine, records, the checks
    {"engine", "proofs", "provenance", "memory", "diff", "bench", "qualify", "choice", "serve_workload",
     "serve_record", "serve_check"},
    # 3, the library facades
    {"session", "serve"},
    # 4, sessions in other processes
    {"worker", "matrix", "sweep", "gpu_check"},
    # 5, the command line
    {"cli", "__main__", "cli.*"},
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "dflash"


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer or (name.startswith("cli.") and "cli.*" in layer):
            return i
    raise AssertionError(f"dflash/{name.replace('.', '/')}.py has no layer in tests/test_layering.py")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for n in ast.walk(node)}
    return out


def imports(path: Path, modules: set[str]) -> set[str]:
    """The dflash modules `path` imports (at run time)."""
    name = module_name(path)
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "dflash":
        package = []
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "dflash":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = ".".join([*base, alias.name])
                out.add(sub if sub in modules else (".".join(base) or "dflash"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dflash":
                    out.add(".".join(alias.name.split(".")[1:]) or "dflash")
    out.discard(name)
    return {m for m in out if m in modules}


def graph() -> dict[str, set[str]]:
    paths = sorted(PKG.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_every_module_has_a_layer():
    for m in graph():
        layer_of(m)


def test_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()) or [])


def upward(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
            for m, deps in g.items() for d in sorted(deps) if layer_of(d) > layer_of(m)]


def test_no_module_imports_a_higher_layer():
    bad = upward(graph())
    assert not bad, "; ".join(bad)


def test_the_checks_can_fail():
    """A planted cycle and a planted upward import are found (the checks are not vacuous)."""
    g = graph()
    assert g["session"] and "engine" in g["session"]  # the walk sees real imports
    planted = {**g, "errors": g["errors"] | {"session"}}
    assert find_cycle(planted) is not None
    assert upward({**g, "bands": g["bands"] | {"engine"}}) == ["bands (layer 0) imports engine (layer 2)"]
    with pytest.raises(AssertionError):
        layer_of("no_such_module")
    assert layer_of("session") > layer_of("errors")
