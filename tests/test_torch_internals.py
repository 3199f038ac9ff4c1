"""The private-torch boundary, enforced on the syntax tree of every module.

:mod:`compile_rng._torch`'s homes (``core_internals``, ``dynamo_internals``,
``inductor_internals``, ``dtensor_internals``, ``distributed_internals``: one per torch
subsystem) are the one home of every private read (torch's, and the one private stdlib
function compile_rng calls); :mod:`compile_rng.installation` is the one module that
changes torch. Every module of ``compile_rng/`` and ``passes/`` is parsed
(:mod:`ast`), and the scan fails, naming ``file:line``, on:

1. **a private attribute** - ``x._foo`` (one leading underscore, not a dunder) - unless
   ``_foo`` is compile_rng's own private name and ``x`` is not a torch name (below), or ``x``
   is an op namespace (``torch.ops.aten`` or a module-level name bound to it: ``aten._to_copy``
   is an op of aten's op set, not a Python attribute). compile_rng's own private names are the
   ones its modules bind, collected first over the package (the two homes excluded): ``def``
   and ``class`` names, assigned names, arguments, import aliases, ``self._x`` stored in a
   method of a class that does not derive from torch, and ``f._x`` stored on a function or
   class the module defines;
2. **a private import** - ``import a._b``, ``from a._b import c``, ``from a import _b`` (the
   homes' own package, ``compile_rng._torch``, excepted) - or a string naming a private torch module
   (``"torch._dynamo"``: ``importlib.import_module``, loggers);
3. **Dynamo's undocumented fields**: a string holding a Dynamo source (``L['x']``), and the
   names in ``dynamo_internals.UNDOCUMENTED_FIELDS`` as attributes or strings;
4. **a private name in torch's namespace**: in a class deriving from a torch class, a private
   method or ``self._x`` field is torch's (it overrides one, or may collide with one in a later
   torch) unless listed, with its reason, in ``PRIVATE_OVERRIDES``;
5. **a change to torch** outside ``installation.py``: an assignment, augmented assignment or
   ``del`` of an attribute or item of a torch object, ``setattr``/``delattr`` on one, or a
   mutating method (``pop``, ``update``, ``__setitem__``, ...) called on one (not on a name
   imported from torch: ``ops.add`` of Inductor's op handler is a function). A torch object
   is a name imported from torch or from a home, an attribute or item of one,
   the result of calling a home's accessor (calling a torch API makes a new
   object: a tensor compile_rng fills is not torch), and a local name assigned one of those.
   Inside a home changes are allowed only in its functions of ``TEMPORARY_PATCHES``
   (lasting for one call or block: the backend's own compile, a DTensor dispatch; each
   named in its home's docstring) and ``INSTALLER_ONLY`` (setters only ``installation.py``
   may call).

The homes are exempt from 1-4; ``triton_internals.py``, the home of Triton's private API,
is exempt from 1 and 4 only. The allow-lists live in :mod:`compile_rng._torch` (Dynamo's
fields in ``dynamo_internals``), not here.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import compile_rng._torch as boundary
from compile_rng._torch import (
    core_internals,
    distributed_internals,
    dtensor_internals,
    dynamo_internals,
    inductor_internals,
)

ROOT = Path(__file__).parent.parent
#: module name -> the home (a module of compile_rng._torch)
HOME_MODULES = {m.__name__.rsplit(".", 1)[1]: m for m in (
    core_internals, dynamo_internals, inductor_internals, dtensor_internals, distributed_internals,
)}
HOMES = {f"compile_rng/_torch/{name}.py" for name in HOME_MODULES}
HOME_DOTTED = {f"compile_rng._torch.{name}" for name in HOME_MODULES}
TRITON_HOME = "compile_rng/_torch/triton_internals.py"
INSTALLER = "compile_rng/installation.py"
MUTATORS = frozenset({
    "pop", "popitem", "clear", "update", "setdefault", "__setitem__", "__delitem__", "__setattr__",
    "__delattr__", "append", "extend", "insert", "remove", "add", "discard",
})
PRIVATE_TORCH_MODULE = re.compile(r"torch(\.\w+)*\._\w*(\.\w+)*")
#: a Dynamo source (``L['x']``), also as a regular expression (``L\['``)
DYNAMO_SOURCE = re.compile(r"\bL\\?\[\\?['\"]")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> ast.AST:
    """The innermost value of an attribute/item/call chain: ``a`` of ``a.b[c].d()``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements."""
    return {
        id(n.value) for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    }


@dataclass
class Module:
    path: str  # relative to the repository root
    tree: ast.Module
    torch_names: set[str] = field(default_factory=set)  # names imported from torch
    home_names: set[str] = field(default_factory=set)  # names imported from a home (or the home)
    op_namespaces: set[str] = field(default_factory=set)  # module-level names bound to torch.ops.X

    @classmethod
    def parse(cls, path: str, source: str) -> Module:
        module = cls(path, ast.parse(source, path))
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    bound = alias.asname or top
                    if top == "torch":
                        module.torch_names.add(bound)
                    elif alias.name in HOME_DOTTED:
                        module.home_names.add(bound)
            elif isinstance(node, ast.ImportFrom):
                names = {a.asname or a.name for a in node.names}
                if node.level == 0 and (node.module or "").split(".")[0] == "torch":
                    module.torch_names |= names
                elif node.module in HOME_DOTTED or (node.level and node.module in HOME_MODULES):
                    module.home_names |= names
                elif node.module == "compile_rng._torch":
                    module.home_names |= names & set(HOME_MODULES)
        if path in HOMES:  # its own functions are the accessors of torch's state
            module.home_names |= {n.name for n in module.tree.body if isinstance(n, ast.FunctionDef)}
        for node in module.tree.body:
            if isinstance(node, ast.Assign) and module.is_op_namespace(node.value):
                module.op_namespaces |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        return module

    def is_op_namespace(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.op_namespaces
        return (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ops" and isinstance(node.value.value, ast.Name)
            and node.value.value.id in self.torch_names
        )

    def is_namespace(self, node: ast.AST) -> bool:
        """A module, class or op namespace imported from torch or a home: its
        ``add`` or ``update`` is a function (``ops.add`` of Inductor's ops), not a mutation."""
        imported = isinstance(node, ast.Name) and (node.id in self.torch_names or node.id in self.home_names)
        return imported or self.is_op_namespace(node)

    def torch_rooted(self, node: ast.AST, tainted: set[str]) -> bool:
        """Whether ``node`` is a torch object (rule 5 of the module docstring)."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            if isinstance(node, ast.Call):
                # a call hands back torch's state only when it is a home's accessor
                root = _root(node.func)
                return isinstance(root, ast.Name) and root.id in self.home_names
            node = node.value
        return isinstance(node, ast.Name) and (
            node.id in self.torch_names or node.id in self.home_names or node.id in tainted
        )

    def torch_derived_classes(self, known: set[str]) -> dict[str, ast.ClassDef]:
        """Classes with a base from torch (or a home), or from a class in ``known``."""
        found = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    root = _root(base)
                    end = base.attr if isinstance(base, ast.Attribute) else getattr(root, "id", None)
                    if self.torch_rooted(base, set()) or (
                        isinstance(root, ast.Name) and root.id in self.home_names
                    ) or end in known:
                        found[node.name] = node
        return found


def _modules() -> list[Module]:
    paths = sorted([*(ROOT / "compile_rng").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])
    return [Module.parse(p.relative_to(ROOT).as_posix(), p.read_text()) for p in paths]


def _torch_derived(modules: list[Module]) -> dict[str, dict[str, ast.ClassDef]]:
    """Per module, its classes deriving from torch, directly or through compile_rng's."""
    known: set[str] = set()
    while True:
        derived = {m.path: m.torch_derived_classes(known) for m in modules}
        names = {name for classes in derived.values() for name in classes}
        if names <= known:
            return derived
        known |= names


def _methods(cls: ast.ClassDef):
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _self_stores(cls: ast.ClassDef):
    """``(node, name)`` of each ``self.<name> = ...`` in ``cls``'s methods."""
    for method in _methods(cls):
        if not method.args.args:
            continue
        me = method.args.args[0].arg
        for node in ast.walk(method):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == me):
                yield node, node.attr


def own_private_names(modules: list[Module], derived: dict[str, dict[str, ast.ClassDef]]) -> set[str]:
    """The private names compile_rng binds (rule 1 of the module docstring)."""
    own: set[str] = set()
    for m in modules:
        if m.path in HOMES or m.path == TRITON_HOME:
            continue
        torch_methods = {id(f) for c in derived[m.path].values() for f in _methods(c)}
        defined = {n.name for n in ast.walk(m.tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and id(node) not in torch_methods:
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in defined):
                own.add(node.attr)  # an attribute set on a function or class defined here
            if isinstance(node, ast.ClassDef) and node.name not in derived[m.path]:
                own |= {name for _, name in _self_stores(node)}
    return {name for name in own if _private(name)}


def _scopes(tree: ast.Module):
    """The module body and every function, each with the statements of its own scope."""
    yield tree
    yield from (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _tainted(m: Module, scope: ast.AST) -> set[str]:
    """Names assigned a torch object in ``scope`` (flow-insensitive, to a fixpoint)."""
    tainted: set[str] = set()
    while True:
        grown = set(tainted)
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and m.torch_rooted(node.value, tainted):
                grown |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                if m.torch_rooted(node.context_expr, tainted):
                    grown.add(node.optional_vars.id)
        if grown == tainted:
            return tainted
        tainted = grown


def _changes(m: Module) -> list[tuple[int, str]]:
    """Rule 5: ``(line, what)`` of each change to a torch object."""
    found = set()
    for scope in _scopes(m.tree):
        tainted = _tainted(m, scope)
        for node in ast.walk(scope):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for part in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(part, (ast.Attribute, ast.Subscript)) and m.torch_rooted(part.value, tainted):
                        verb = "del" if isinstance(node, ast.Delete) else "assigns"
                        found.add((node.lineno, f"{verb} {ast.unparse(part)}"))
            if isinstance(node, ast.Call):
                func = node.func
                if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args
                        and m.torch_rooted(node.args[0], tainted)):
                    found.add((node.lineno, f"{func.id}({ast.unparse(node.args[0])}, ...)"))
                elif (isinstance(func, ast.Attribute) and func.attr in MUTATORS
                        and m.torch_rooted(func.value, tainted) and not m.is_namespace(func.value)):
                    found.add((node.lineno, f"{ast.unparse(func)}(...)"))
    return sorted(found)


def _enclosing_functions(tree: ast.Module) -> dict[int, str]:
    """line -> name of the top-level function it is in."""
    where = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                where[line] = node.name
    return where


def boundary_violations(modules: list[Module]) -> list[str]:
    """Every ``file:line: rule: what`` the module docstring's rules find."""
    derived = _torch_derived(modules)
    own = own_private_names(modules, derived)
    overrides = {(path, cls, name) for path, cls, name, _reason in boundary.PRIVATE_OVERRIDES}
    undocumented = set(dynamo_internals.UNDOCUMENTED_FIELDS)
    out = []
    for m in modules:
        report = lambda node, rule, what, m=m: out.append(f"{m.path}:{node.lineno}: {rule}: {what}")  # noqa: E731
        docstrings = _docstrings(m.tree)
        if m.path not in HOMES:
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Attribute) and _private(node.attr) and m.path != TRITON_HOME:
                    if m.is_op_namespace(node.value):
                        continue
                    if node.attr not in own or m.torch_rooted(node.value, set()):
                        report(node, "private attribute", ast.unparse(node))
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if any(_private(p) for p in alias.name.split(".")):
                            report(node, "private import", f"import {alias.name}")
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    parts = (node.module or "").split(".")
                    if parts[:2] == ["compile_rng", "_torch"]:
                        parts = parts[2:]  # compile_rng's private package: the home itself
                    private = [a.name for a in node.names if _private(a.name)]
                    if any(_private(p) for p in parts) or private:
                        report(node, "private import", f"from {node.module} import {', '.join(a.name for a in node.names)}")
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    if PRIVATE_TORCH_MODULE.fullmatch(node.value):
                        report(node, "private torch module named", repr(node.value))
                    elif DYNAMO_SOURCE.search(node.value):
                        report(node, "Dynamo source string", repr(node.value))
                    elif node.value in undocumented:
                        report(node, "undocumented Dynamo field", repr(node.value))
                if isinstance(node, ast.Attribute) and node.attr in undocumented:
                    report(node, "undocumented Dynamo field", ast.unparse(node))
                if isinstance(node, ast.Name) and node.id in boundary.INSTALLER_ONLY and m.path != INSTALLER:
                    report(node, "installer-only setter used", node.id)
                if (isinstance(node, ast.Attribute) and node.attr in boundary.INSTALLER_ONLY
                        and m.path != INSTALLER and m.torch_rooted(node.value, set())):
                    report(node, "installer-only setter used", ast.unparse(node))
        if m.path not in HOMES and m.path != TRITON_HOME:
            for cls in derived[m.path].values():
                names = [(f, f.name) for f in _methods(cls)] + list(_self_stores(cls))
                for node, name in names:
                    if _private(name) and (m.path, cls.name, name) not in overrides:
                        report(node, "private name in a torch class", f"{cls.name}.{name}")
        if m.path != INSTALLER:
            patches = {name for home, name in boundary.TEMPORARY_PATCHES if m.path == f"compile_rng/_torch/{home}.py"}
            allowed = patches | set(boundary.INSTALLER_ONLY)
            where = _enclosing_functions(m.tree) if m.path in HOMES else {}
            for line, what in _changes(m):
                if where.get(line) not in allowed:
                    out.append(f"{m.path}:{line}: change to torch outside installation.py: {what}")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_no_module_crosses_the_boundary():
    violations = boundary_violations(_modules())
    assert not violations, "private torch use outside compile_rng/_torch/, or a change to torch " \
        "outside compile_rng/installation.py:\n" + "\n".join(violations)


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_the_homes_document_their_temporary_patches():
    for home, name in boundary.TEMPORARY_PATCHES:
        doc = " ".join(HOME_MODULES[home].__doc__.split())
        assert f":func:`{name}`" in doc, f"{name} is not named in {home}'s docstring"
        assert callable(getattr(HOME_MODULES[home], name)), name
    for home in ("dynamo_internals", "inductor_internals"):  # their patches' extent
        assert "backend's own compile" in " ".join(HOME_MODULES[home].__doc__.split()), home
    for name in boundary.INSTALLER_ONLY:
        assert any(callable(getattr(home, name, None)) for home in HOME_MODULES.values()), name
    for path, cls, name, reason in boundary.PRIVATE_OVERRIDES:
        assert (ROOT / path).exists() and _private(name) and "2.13.0" in reason and "2.15.0" in reason, (path, cls, name)


def _scan(files: dict[str, str]) -> list[str]:
    """The scan of the package with ``files`` (path -> source) added or replacing modules."""
    modules = {m.path: m for m in _modules()}
    for path, source in files.items():
        modules[path] = Module.parse(path, source)
    return boundary_violations(list(modules.values()))


PLANTED = '''\
import contextlib
import importlib
import torch
import torch._dynamo.config
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from compile_rng._torch import dtensor_internals
from compile_rng._torch.dtensor_internals import OffsetBasedRNGTracker, dtensor_op_handlers

aten = torch.ops.aten


class Tracker(OffsetBasedRNGTracker):
    def __init__(self):
        self._device = torch.device("cpu")

    def _compute_rng_offsets(self, spec):
        return None


class Own:
    def __init__(self):
        self._mine = 1


def leaks(x, gm):
    verbose = torch._dynamo.config.verbose
    mode = torch.utils._python_dispatch._get_current_dispatch_mode()
    importlib.import_module("torch._inductor.config")
    source = "L['x']"; pattern = r"^L\\['x'\\]"
    reason = gm.compile_subgraph_reason
    spec = x._spec
    mine = Own()._mine
    view = aten._unsafe_view.default
    setattr(DTensor, "to_local", None)
    torch.manual_seed = None
    handlers = dtensor_op_handlers()
    handlers.pop(aten.exponential_.default)
    dtensor_op_handlers()[aten.exponential_.default] = None
    dtensor_internals.dtensor_random().is_rng_supported_mesh = None
    dtensor_internals.set_rng_tracker(None)
    out = torch.empty(3)
    out[0] = 1.0
    x.meta["val"] = out
    del torch.random.fork_rng
'''


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_the_scan_finds_what_it_should():
    """A module with one leak of each kind (and, unflagged: compile_rng's own private
    ``_mine``, aten's ``_unsafe_view`` op, a tensor and a node's meta it fills)."""
    found = [v for v in _scan({"compile_rng/planted.py": PLANTED}) if v.startswith("compile_rng/planted.py:")]
    assert [v.removeprefix("compile_rng/planted.py:") for v in found] == [
        "4: private import: import torch._dynamo.config",
        "6: private import: from torch.utils._pytree import tree_map",
        "15: private name in a torch class: Tracker._device",
        "17: private name in a torch class: Tracker._compute_rng_offsets",
        "27: private attribute: torch._dynamo",
        "28: private attribute: torch.utils._python_dispatch",
        "28: private attribute: torch.utils._python_dispatch._get_current_dispatch_mode",
        "29: private torch module named: 'torch._inductor.config'",
        "30: Dynamo source string: \"L['x']\"",
        "30: Dynamo source string: \"^L\\\\['x'\\\\]\"",
        "31: undocumented Dynamo field: gm.compile_subgraph_reason",
        "32: private attribute: x._spec",
        "35: change to torch outside installation.py: setattr(DTensor, ...)",
        "36: change to torch outside installation.py: assigns torch.manual_seed",
        "37: installer-only setter used: dtensor_op_handlers",
        "38: change to torch outside installation.py: handlers.pop(...)",
        "39: change to torch outside installation.py: assigns dtensor_op_handlers()[aten.exponential_.default]",
        "39: installer-only setter used: dtensor_op_handlers",
        "40: change to torch outside installation.py: assigns dtensor_internals.dtensor_random().is_rng_supported_mesh",
        "41: installer-only setter used: dtensor_internals.set_rng_tracker",
        "45: change to torch outside installation.py: del torch.random.fork_rng",
    ], "\n".join(found)


@pytest.mark.torch_independent  # a scan of compile_rng's source
def test_the_home_itself_may_patch_only_what_it_lists():
    home = "compile_rng/_torch/dynamo_internals.py"
    source = (ROOT / home).read_text()
    source += "\n\ndef leak():\n    torch._dynamo.config.verbose = True\n"
    found = [v for v in _scan({home: source}) if v.startswith(home)]
    assert found == [f"{home}:{source.count(chr(10))}: change to torch outside installation.py: "
                     "assigns torch._dynamo.config.verbose"], found


@pytest.mark.parametrize("home, name", sorted(
    (home, name) for home, module in HOME_MODULES.items() for name in getattr(module, "_LAZY", ())
))
def test_every_lazy_name_resolves(home, name):
    assert getattr(HOME_MODULES[home], name) is not None


def test_every_function_and_name_exists():
    for module in HOME_MODULES.values():
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
    assert dtensor_internals.rng_tracker() is dtensor_internals.dtensor_random()._rng_tracker
    assert isinstance(dtensor_internals.dtensor_op_handlers(), dict)
    assert isinstance(dynamo_internals.compile_failures(), tuple)
    assert core_internals.op_name(torch.ops.aten.rand.default) == "rand"
