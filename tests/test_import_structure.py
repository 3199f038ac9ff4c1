"""compile_rng's imports run one way: no cycle among its modules' top-level imports, and
every module can be the first one a program imports (DTensor's import hook, which
imports the tracker, must not find a module half-initialized)."""

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


def _imports(name: str, path: Path, known: set[str], inside_functions: bool = False) -> set[str]:
    """compile_rng modules ``name`` imports when it is executed (not inside functions),
    or, with ``inside_functions``, anywhere in it."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree) if inside_functions else tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            module = node.module if not node.level else ".".join(filter(None, [base, node.module]))
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}  # `from . import ops`
    return {m for m in found if m in known and m != name}


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
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert _cycles(graph) == []


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
