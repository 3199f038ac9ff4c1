"""Emit sympy integer expressions as FX nodes, so offsets stay symbolic in the graph.

Symbols are resolved to nodes the graph already has: a SymInt placeholder, or an
``aten.sym_size.int`` of a tensor placeholder whose size is that symbol.
"""

from __future__ import annotations

import operator

import sympy
import torch
from compile_rng._torch.core_internals import CeilDiv, FloorDiv, Mod, PythonMod
from torch import fx


class SymEmitter:
    """Turns sympy expressions into ints (when constant) or FX nodes of ``graph``."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self._sources: dict[sympy.Symbol, tuple[fx.Node, int | None]] = {}
        self._emitted: dict[sympy.Symbol, fx.Node] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for node in placeholders:
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
                self._sources.setdefault(val.node.expr, (node, None))
            elif isinstance(val, torch.Tensor):
                for dim, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                        self._sources.setdefault(size.node.expr, (node, dim))
        self._after_placeholders = placeholders[-1] if placeholders else None

    def _symbol(self, sym: sympy.Symbol) -> fx.Node:
        if sym not in self._emitted:
            if sym not in self._sources:
                raise NotImplementedError(
                    f"compile_rng: cannot find the graph value of size symbol {sym}; "
                    "mark the dimension static (torch._dynamo.mark_static) or compile with dynamic=False"
                )
            node, dim = self._sources[sym]
            if dim is None:
                self._emitted[sym] = node
            else:
                with self.graph.inserting_after(self._after_placeholders):
                    out = self.graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
                out.meta["val"] = node.meta["val"].shape[dim]
                self._emitted[sym] = out
        return self._emitted[sym]

    def emit(self, expr: sympy.Expr | int) -> int | fx.Node:
        """``expr`` as an int, or as a node computing it (inserted at the current point)."""
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            return self._symbol(expr)
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            fn = operator.add if isinstance(expr, sympy.Add) else operator.mul
            args = [self.emit(a) for a in expr.args]
            out = args[0]
            for a in args[1:]:
                out = self._binary(fn, out, a)
            return out
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
            base = self.emit(expr.base)
            out = base
            for _ in range(int(expr.exp) - 1):
                out = self._binary(operator.mul, out, base)
            return out
        if isinstance(expr, FloorDiv):
            return self._binary(operator.floordiv, self.emit(expr.args[0]), self.emit(expr.args[1]))
        if isinstance(expr, CeilDiv):
            a, b = expr.args
            return self.emit(FloorDiv(a + b - 1, b))
        if isinstance(expr, (Mod, PythonMod)):
            return self._binary(operator.mod, self.emit(expr.args[0]), self.emit(expr.args[1]))
        raise NotImplementedError(f"compile_rng: cannot emit symbolic expression {expr}")

    def _binary(self, fn, a, b):
        return emit_binary(self.graph, fn, a, b)


def emit_binary(graph: fx.Graph, fn, a: int | fx.Node, b: int | fx.Node) -> int | fx.Node:
    """``fn(a, b)`` on ints or SymInt nodes; folds constants, else inserts a node."""
    if isinstance(a, int) and isinstance(b, int):
        return fn(a, b)
    node = graph.call_function(fn, (a, b))
    vals = [x.meta["val"] if isinstance(x, fx.Node) else x for x in (a, b)]
    node.meta["val"] = fn(*vals)
    return node
