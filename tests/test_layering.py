"""dflash's folders are its layers, and imports run one way.

Each folder under dflash/ is a layer, and so is the group of faces (the package itself, Session,
Worker, dflash.serve). A module may import its own layer and the layers below, never one above, and
no chain of imports may come back to where it started. Every import counts: inside a function, and
under `if TYPE_CHECKING:` too (a type-only edge still ties the two modules' designs together).
A new folder or top-level module must be given a layer here. The public API stays what it was."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dflash

PKG = Path(__file__).resolve().parent.parent / "dflash"

LAYERS: list[set[str]] = [
    {"core"},      # the words every layer speaks: errors, settings, results, paths, files, stages
    {"model"},     # model files: GGUF metadata, the tiny model writer
    {"native"},    # llama.cpp and the machine: the ctypes module, build, devices, RPC, library identity
    {"run"},       # a loaded model at work: the band planner, engine, prefill, memory, supervisor
    {"proof"},     # exactness proven and recorded: records, evidence, provenance, qualify, bench, diff
    {"serving"},   # llama-server kept exact: configs, process, client, workloads, records, the check
    {"dflash", "session", "worker", "serve"},  # the faces
    {"compare"},   # many runs side by side, one library per process: sweep, matrix, the GPU check
    {"cli"},       # the command line
    {"__main__"},
]
PUBLIC = ["__version__", "Session", "Token", "Settings", "Worker", "PrefillResult", "BenchResult", "QualifyResult",
          "MemoryResult", "DflashError", "UsageError", "ModelError", "LlamaError", "LibraryNotBuilt", "NotExactError",
          "NoDeviceError"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "dflash"


def layer_of(name: str) -> int:
    """The layer of a module: that of its folder (its first name), or its own for a top-level one."""
    top = name.split(".")[0]
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"dflash/{name.replace('.', '/')} is in no layer of tests/test_layering.py")


def imports(path: Path, modules: set[str]) -> set[str]:
    """The dflash modules `path` imports, wherever the import stands."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "dflash":
        package = []
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def upward(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
            for m, deps in g.items() for d in sorted(deps) if layer_of(d) > layer_of(m)]


def test_every_folder_is_a_layer_and_every_module_has_one():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {n for layer in LAYERS for n in layer} - {"dflash", "session", "worker", "serve", "__main__"}
    for m in graph():
        layer_of(m)


def test_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()) or [])


def test_no_module_imports_a_higher_layer():
    bad = upward(graph())
    assert not bad, "; ".join(bad)


def test_folder_inits_are_docstrings_only():
    """Importing one module of a folder loads nothing else (the supervisor must not load llama.cpp);
    cli/ is the click group itself."""
    for init in PKG.glob("*/__init__.py"):
        if init.parent.name == "cli":
            continue
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), init


def test_the_checks_can_fail():
    """A planted cycle (type-only edges count), an upward import and a module without a layer are found."""
    g = graph()
    assert "run.engine" in g["session"] and "core.results" in g["dflash"]  # the walk sees real and type-only imports
    assert find_cycle({**g, "core.errors": g["core.errors"] | {"session"}}) is not None
    assert find_cycle({**g, "run.prefill": g["run.prefill"] | {"proof.records"},
                       "proof.records": g["proof.records"] | {"run.prefill"}}) is not None
    assert upward({**g, "run.bands": g["run.bands"] | {"proof.qualify"}}) == [
        "run.bands (layer 3) imports proof.qualify (layer 4)"]
    with pytest.raises(AssertionError):
        layer_of("no_such_folder.module")
    assert layer_of("session") > layer_of("serving.server") > layer_of("core.errors")


def test_the_public_api_is_unchanged():
    assert dflash.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(dflash, name) is not None, name
    from dflash import serve
    assert serve.__all__ == ["ServeTarget", "choose_config", "qualify", "target"]
    assert {dflash.Session.__module__, dflash.Worker.__module__} == {"dflash.session", "dflash.worker"}
    assert issubclass(dflash.NotExactError, dflash.DflashError) and issubclass(dflash.UsageError, dflash.DflashError)


def _loaded(imports: str, prefixes: tuple[str, ...]) -> list[str]:
    code = f"import sys, {imports}; print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return ast.literal_eval(r.stdout.strip())


def test_importing_dflash_and_the_supervisor_loads_no_llama_cpp():
    """The CLI's parent process (dflash, the supervisor) stays light; the CLI never loads the library
    itself until a command runs."""
    assert _loaded("dflash, dflash.run.supervisor", ("llama_cpp", "numpy", "dflash.native", "dflash.run.engine")) == []
    assert _loaded("dflash.cli", ("llama_cpp",)) == []
    assert _loaded("dflash.run.engine", ("dflash.native.llama",)) == ["dflash.native.llama"]  # the probe sees
