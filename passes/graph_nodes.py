"""FX node helpers the passes share: a node's user source line, its value, size
expressions, and new call nodes with their fake values."""

from __future__ import annotations

from typing import Any, NamedTuple

import sympy
import torch
from compile_rng._torch.core_internals import FloorDiv, detect_fake_mode, tree_leaves
from compile_rng._torch.dynamo_internals import dynamo_module_call, dynamo_module_path, dynamo_module_source
from torch import fx


def source_of(node: fx.Node) -> str:
    """``file:line`` of the innermost user frame that created ``node``; for an op inside
    torch's own modules (``nn.Dropout`` in an ``nn.Sequential``: Dynamo records no user
    frame) the innermost module, as ``path.in.model (Class)``; else ``?``."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    if frames:
        parts = frames[-1].split(",")
        return f"{parts[0][6:-1]}:{parts[1].split()[-1]}" if len(parts) > 1 else frames[-1]
    modules = list((node.meta.get("nn_module_stack") or {}).values())
    if modules:
        path, cls = modules[-1][0], modules[-1][1]
        path = dynamo_module_path(path)
        name = getattr(cls, "__name__", str(cls))
        return f"{path} ({name})" if path else name
    return "?"


#: torch's modules whose random ops draw on sequence-major activations (always, or unless
#: ``batch_first``), and the one inside them whose draws are batch-major
#: (:mod:`compile_rng.eager.batch_dims` reads the same from the Python stack, eagerly).
SEQUENCE_MAJOR_MODULES = ("RNN", "LSTM", "GRU", "TransformerEncoderLayer", "TransformerDecoderLayer")
BATCH_MAJOR_MODULES = ("MultiheadAttention",)
_LAYOUT_MODULES = (*BATCH_MAJOR_MODULES, *SEQUENCE_MAJOR_MODULES)


class ModuleLayout(NamedTuple):
    """One of torch's modules that says the layout of its random ops' activations."""

    name: str  # its class name
    batch_major: bool  # True: batch-major (:data:`BATCH_MAJOR_MODULES`); False: maybe sequence-major
    key: str  # its entry in Dynamo's ``nn_module_stack`` (the same in every graph traced from it)


def torch_module_layout(node: fx.Node) -> ModuleLayout | None:
    """The innermost of torch's modules (or a subclass of one) around ``node`` that says the
    layout of its random ops' activations (Dynamo's ``nn_module_stack``), None where there is
    none."""
    for key, (_path, cls) in reversed(list((node.meta.get("nn_module_stack") or {}).items())):
        name = _layout_class(cls)
        if name is not None:
            return ModuleLayout(name, name in BATCH_MAJOR_MODULES, key)
    return None


def _layout_class(cls: Any) -> str | None:
    """Which of torch's layout modules ``cls`` is or derives from (a class, or the qualified
    name Dynamo may record instead)."""
    if isinstance(cls, type):
        return next((n for n in _LAYOUT_MODULES if issubclass(cls, getattr(torch.nn, n))), None)
    text = str(cls)
    name = text.rsplit(".", 1)[-1].strip("'>")
    return name if "torch.nn." in text and name in _LAYOUT_MODULES else None


def torch_modules(gm: fx.GraphModule, scopes: tuple[dict, dict] | None) -> dict[str, Any]:
    """``nn_module_stack`` key -> the module, for each of torch's layout modules in Dynamo's
    graph ``gm`` (and the graphs it holds), found from ``scopes`` (the compiled frame's
    locals and globals: :func:`~compile_rng._torch.dynamo_internals.compiling_scopes`). A
    path that does not lead to the module Dynamo keyed (a first call's key is its ``id``) is
    left out."""
    found: dict[str, Any] = {}
    if scopes is None:
        return found
    for graph in gm.modules():
        if not isinstance(graph, fx.GraphModule):
            continue
        for node in graph.graph.nodes:
            for key, (path, cls) in (node.meta.get("nn_module_stack") or {}).items():
                if key in found or _layout_class(cls) is None:
                    continue
                module = _resolve(path, scopes)
                if module is not None and str(id(module)) == key.partition("@")[0]:
                    found[key] = module
    return found


def _resolve(path: str, scopes: tuple[dict, dict]) -> Any:
    source = dynamo_module_source(path)
    if source is None:
        return None
    scope, root, dotted = source
    base = (scopes[1] if scope == "G" else scopes[0]).get(root)
    try:
        return base.get_submodule(dotted) if isinstance(base, torch.nn.Module) else None
    except AttributeError:
        return None


def expr(v: Any) -> sympy.Expr:
    return v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(int(v))


def ceil4_expr(n: sympy.Expr) -> sympy.Expr:
    return FloorDiv(n + 3, 4) * 4


def first_val(node: fx.Node) -> Any:
    val = node.meta["val"]
    return val[0] if isinstance(val, (tuple, list)) else val


def call(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A call node with its fake value computed from its arguments' values."""
    node = graph.call_function(target, args, kwargs)
    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    tensors = [v for v in tree_leaves(vals) if isinstance(v, torch.Tensor)]
    with detect_fake_mode(tensors):
        node.meta["val"] = target(*vals, **kwargs)
    return node


def module_calls(gm: fx.GraphModule) -> dict[tuple[str, str, str], int]:
    """How many times each module runs in Dynamo's graph ``gm`` (and the graphs it holds:
    checkpointed regions): ``(scope, root, path) -> calls``, the module reached from the
    compiled frame's local or global ``root`` by ``path`` (the frame's own modules, at
    path ``""``, are left out: their calls are the frame's)."""
    calls: dict[tuple[str, str, str], int] = {}
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
                source = dynamo_module_source(path)
                if source is not None and source[2]:
                    calls[source] = max(calls.get(source, 0), dynamo_module_call(key) + 1)
    return calls
