"""Rewrite stateful aten random ops into compile_rng's functional ops.

Runs on post-AOTAutograd graphs (the joint graph before partitioning, or an inference
graph). Each random node becomes a ``torch.ops.compile_rng.*`` call reading the graph's
``key`` input (``[seed, base]``) at ``offset = sum of ceil4(numel)`` of the random ops
before it in program order. A plain tensor is a replicated tensor on a one-rank mesh:
its element ``i`` gets counter ``base + offset + i``. Offsets and the graph's total
advance are sympy expressions in the graph's size symbols, emitted as SymInt nodes.

Any random op left afterwards (no counter-based form) raises an error naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx
from torch.utils._sympy.functions import FloorDiv

import compile_rng.ops  # noqa: F401  (registers torch.ops.compile_rng)

from .sym_emit import SymEmitter

aten = torch.ops.aten
cr = torch.ops.compile_rng


@dataclass
class RewrittenOp:
    """One random op the pass replaced (for tests, dumps and explain)."""

    original: str
    replacement: str
    shape: tuple
    dtype: torch.dtype
    offset: sympy.Expr
    advance: sympy.Expr


@dataclass
class RngPlan:
    """What the pass did to one compiled graph; filled in as the pass runs."""

    ops: list[RewrittenOp] = field(default_factory=list)
    total_advance: sympy.Expr = sympy.Integer(0)
    #: Python code of each graph after the pass rewrote it.
    graphs: list[str] = field(default_factory=list)


def _expr(v) -> sympy.Expr:
    return v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(int(v))


def ceil4_expr(n: sympy.Expr) -> sympy.Expr:
    return FloorDiv(n + 3, 4) * 4


class _Site:
    """One random node being rewritten: its output metadata and emission helpers."""

    def __init__(self, node: fx.Node, key: fx.Node, offset, emitter: SymEmitter):
        self.node, self.key, self.offset, self.emitter = node, key, offset, emitter
        val = node.meta["val"]
        self.val = val[0] if isinstance(val, (tuple, list)) else val
        self.shape = [_expr(s) for s in self.val.shape]

    def size(self) -> list:
        return [self.emitter.emit(s) for s in self.shape]

    def strides(self) -> list:
        out, acc = [], sympy.Integer(1)
        for s in reversed(self.shape):
            out.append(acc)
            acc = acc * s
        return [self.emitter.emit(s) for s in reversed(out)]

    def arg(self, i: int | None, name: str, default=None):
        """Argument ``i`` (or keyword ``name``); ``i=None`` means the op has no such argument."""
        if i is None:
            return default
        if len(self.node.args) > i:
            return self.node.args[i]
        return self.node.kwargs.get(name, default)

    def call(self, target, *args) -> fx.Node:
        return self.node.graph.call_function(target, (self.key, self.offset, *args))


# Rewrite rules: aten overload -> builder of the functional call at a site.
def _uniform(lo_i, hi_i):
    def build(s: _Site) -> fx.Node:
        low, high = float(s.arg(lo_i, "from", 0.0)), float(s.arg(hi_i, "to", 1.0))
        return s.call(cr.uniform.default, s.size(), s.strides(), low, high, s.val.dtype)
    return build


def _normal(mean_i, std_i):
    def build(s: _Site) -> fx.Node:
        mean, std = float(s.arg(mean_i, "mean", 0.0)), float(s.arg(std_i, "std", 1.0))
        if std < 0:
            raise ValueError(f"compile_rng: {s.node.target} needs std >= 0, got {std}")
        return s.call(cr.normal.default, s.size(), s.strides(), mean, std, s.val.dtype)
    return build


def _standard(target, *params):
    return lambda s: s.call(target, s.size(), s.strides(), *params, s.val.dtype)


def _exponential(s: _Site) -> fx.Node:
    lambd = float(s.arg(1, "lambd", 1.0))
    if not lambd > 0:
        raise ValueError(f"compile_rng: exponential needs lambd > 0, got {lambd}")
    return s.call(cr.exponential.default, s.size(), s.strides(), lambd, s.val.dtype)


def _probability(s: _Site, p) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"compile_rng: {s.node.target} needs a probability in [0, 1], got {p}")
    return p


def _bernoulli_p(s: _Site) -> fx.Node:
    p = _probability(s, s.arg(1, "p", 0.5))
    return s.call(cr.bernoulli.default, s.size(), s.strides(), p, s.val.dtype)


def _bernoulli_tensor(s: _Site) -> fx.Node:
    return s.call(cr.bernoulli_tensor.default, s.node.args[0], s.strides(), s.val.dtype)


def _dropout(s: _Site) -> fx.Node:
    if s.arg(2, "train", True) is False:
        raise NotImplementedError("compile_rng: native_dropout with train=False has no randomness to rewrite")
    p = _probability(s, s.arg(1, "p"))
    return s.call(cr.dropout.default, s.node.args[0], s.strides(), p)


def _randint(lo_i, hi_i):
    def build(s: _Site) -> fx.Node:
        low = int(s.node.args[lo_i]) if lo_i is not None else 0
        high = int(s.node.args[hi_i])
        if high <= low:
            raise ValueError(f"compile_rng: {s.node.target} needs low < high, got [{low}, {high})")
        return s.call(cr.randint.default, s.size(), s.strides(), low, high, s.val.dtype)
    return build


RULES: dict[torch._ops.OpOverload, Callable[[_Site], fx.Node]] = {
    aten.rand.default: _uniform(None, None),
    aten.rand_like.default: _uniform(None, None),
    aten.uniform.default: _uniform(1, 2),
    aten.randn.default: _normal(None, None),
    aten.randn_like.default: _normal(None, None),
    aten.normal_functional.default: _normal(1, 2),
    aten.normal.float_float: _normal(0, 1),
    aten.exponential.default: _exponential,
    aten.bernoulli.p: _bernoulli_p,
    aten.bernoulli.default: _bernoulli_tensor,
    aten.native_dropout.default: _dropout,
    aten.randint.default: _randint(None, 0),
    aten.randint.low: _randint(0, 1),
}

#: aten overloads the rewrite handles; Inductor must not decompose these first.
HANDLED_OPS = frozenset(RULES)


def is_random(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
    )


def find_key(graph: fx.Graph) -> fx.Node:
    """The key input: the last primal / user input, added by the backend."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    key = inputs[-1] if inputs else None
    val = key.meta.get("val") if key is not None else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.int64 and tuple(val.shape) == (2,)):
        raise RuntimeError(
            "compile_rng internal error: the graph's last input is not the rng key; "
            "was this graph compiled through compile_rng.backend()?"
        )
    return key


def _check_supported(node: fx.Node, key: fx.Node) -> None:
    if node.target not in RULES:
        raise NotImplementedError(
            f"compile_rng: random op {node.target} has no counter-based form yet; "
            "move it out of the compiled region (torch.compiler.disable) or open an issue"
        )
    if node.kwargs.get("generator") is not None:
        raise NotImplementedError(
            f"compile_rng: {node.target} got an explicit generator=; compiled random ops draw "
            "from compile_rng's stream (seed it with compile_rng.manual_seed) - drop the argument"
        )
    val = node.meta["val"]
    val = val[0] if isinstance(val, (tuple, list)) else val
    if val.device != key.meta["val"].device:
        raise NotImplementedError(
            f"compile_rng: {node.target} runs on {val.device}, but this version keeps streams "
            f"for {key.meta['val'].device} only"
        )


def functionalize_rng(graph: fx.Graph, plan: RngPlan) -> None:
    """Rewrite every random op of ``graph`` in place; append what was done to ``plan``.

    Idempotent: a graph with no stateful random ops is left unchanged, so the pass can
    run both on the joint graph and again on its partitions.
    """
    randoms = [n for n in graph.nodes if is_random(n)]
    if not randoms:
        return
    key = find_key(graph)
    emitter = SymEmitter(graph)
    fake_mode = torch._guards.detect_fake_mode([key.meta["val"]])
    for node in randoms:
        _check_supported(node, key)
        offset_expr = plan.total_advance
        with graph.inserting_before(node):
            site = _Site(node, key, emitter.emit(offset_expr), emitter)
            new = RULES[node.target](site)
        numel = sympy.Mul(*site.shape) if site.shape else sympy.Integer(1)
        advance = ceil4_expr(numel)
        plan.ops.append(
            RewrittenOp(str(node.target), str(new.target), tuple(site.shape), site.val.dtype, offset_expr, advance)
        )
        plan.total_advance = plan.total_advance + advance
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        with fake_mode:
            new.meta["val"] = new.target(*fx.node.map_arg(new.args, lambda n: n.meta["val"]))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    plan.graphs.append(graph.python_code("self").src)

