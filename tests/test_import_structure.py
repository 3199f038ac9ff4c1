"""compile_rng's imports run one way: no cycle among its modules, imports inside functions
counted; every module imports only from its own layer or the layers below it
(:data:`LAYERS`); and every module can be the first one a program imports (DTensor's
import hook, which imports the tracker, must not find a module half-initialized).
Imports inside functions are for lightness only (``import compile_rng`` imports no
DTensor, Dynamo or Inductor): they go downward too."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = {"compile_rng": ROOT / "compile_rng", "compile_rng.passes": ROOT / "passes"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of compile_rng (subpackages included)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


#: compile_rng's layers, bottom to top, each by the names of its modules or packages. A
#: module imports from its own layer and the ones below, never from one above: what
#: several layers need sits in the lowest of them, and a lower layer that must call up
#: at run time offers a registration the upper one fills (``stream.register_implementation``).
LAYERS: list[tuple[str, ...]] = [
    ("compile_rng._torch",),  # the readers of torch's and Triton's private APIs
    ("compile_rng.stream",),  # the canonical stream: a contract (a leaf) and its implementations
    ("compile_rng.ops",),  # the functional ops torch.ops.compile_rng.* and their lowerings
    ("compile_rng.semantics",),  # what random ops mean on shards and batches
    ("compile_rng.passes",),  # the graph passes
    ("compile_rng.debug",),  # dumps and reports of what the pass did
    ("compile_rng.eager",),  # eager code on the stream, DTensor's tracker
    ("compile_rng.compiled",),  # torch.compile's backend, on top of the eager tracker
    ("compile_rng.integrations",),  # the training loops people already use
    ("compile_rng.installation", "compile_rng.import_hooks"),  # what importing changes in torch
    ("compile_rng", "compile_rng.launch", "compile_rng.demo", "compile_rng.__main__"),  # entry points
]


def _imports(name: str, path: Path, known: set[str], inside_functions: bool = False) -> set[str]:
    """compile_rng modules ``name`` imports when it is executed (not inside functions),
    or, with ``inside_functions``, anywhere in it."""
    return _imported(name, path.stem == "__init__", ast.parse(path.read_text()), known, inside_functions)


def _imported(name: str, is_package: bool, tree: ast.Module, known: set[str], inside_functions: bool) -> set[str]:
    """:func:`_imports` of a parsed module (``is_package``: an ``__init__``)."""
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree) if inside_functions else tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            module = node.module if not node.level else ".".join(filter(None, [base, node.module]))
            submodules = {f"{module}.{a.name}" for a in node.names} & known  # `from . import ops`
            found |= submodules
            if len(submodules) < len(node.names):  # a name the package itself defines
                found.add(module)
    return {m for m in found if m in known and m != name}


def _layer(module: str) -> int:
    """The index in :data:`LAYERS` of the layer ``module`` belongs to (its longest prefix)."""
    prefixes = [(len(p), i) for i, names in enumerate(LAYERS) for p in names
                if module == p or module.startswith(p + ".") and p != "compile_rng"]
    assert prefixes, f"{module} is in no layer of LAYERS"
    return max(prefixes)[1]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a module ``b`` from a layer above ``a``'s."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if _layer(b) > _layer(a)]


def _graph(inside_functions: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules), inside_functions) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_no_import_cycle():
    modules = _modules()
    assert "compile_rng.stream.state" in modules and "compile_rng.passes.functionalize_rng" in modules
    assert _cycles(_graph(inside_functions=False)) == []
    assert _cycles(_graph(inside_functions=True)) == []


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_every_import_goes_down_the_layers():
    """Imports inside functions included: a lazy import is for lightness, not for a way up."""
    assert _upward(_graph()) == []


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_the_layer_check_finds_a_planted_upward_import():
    """The stream's state imports the tracker inside a function: the check names that
    import, and the tracker's own import of the state closes a cycle."""
    planted = ast.parse("def current():\n    from compile_rng.eager import tracker\n    return tracker\n")
    graph = _graph()
    known = set(graph)
    graph["compile_rng.stream.state"] |= _imported("compile_rng.stream.state", False, planted, known, True)
    assert _upward(graph) == ["compile_rng.stream.state -> compile_rng.eager.tracker"]
    assert any({"compile_rng.stream.state", "compile_rng.eager.tracker"} <= set(c) for c in _cycles(graph))
    # the scan of module-level imports alone misses it; a name of the root package is the root
    assert _imported("compile_rng.stream.state", False, planted, known, False) == set()
    assert _imported("compile_rng.stream.state", False, ast.parse("from compile_rng import get_state"), known, False) \
        == {"compile_rng"}
    assert _imported("compile_rng.stream.state", False, ast.parse("from compile_rng import ops"), known, False) \
        == {"compile_rng.ops"}


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_every_module_is_in_a_layer():
    for module in _modules():
        _layer(module)


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_the_stream_contract_is_a_leaf():
    """The contract imports no compile_rng module, not even inside a function: its
    implementations register themselves (``stream.register_implementation``)."""
    modules = _modules()
    assert _imports("compile_rng.stream", modules["compile_rng.stream"], set(modules), inside_functions=True) == set()


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


_IMPORT_EACH_FIRST = """
import os, sys, traceback
import torch  # shared by the forks; DTensor is not imported yet, so its hook runs in each
failed = []
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(module)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        failed.append(module)
print("FAILED", *failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_every_module_imports_first():
    """Each module imported first in a fresh process (a fork of one that imported only torch)."""
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST, *sorted(_modules())],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-500:] + done.stderr[-3000:]
