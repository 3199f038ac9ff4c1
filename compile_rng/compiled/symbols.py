"""Size expressions of a compiled graph evaluated per call: where each size symbol of a
Dynamo graph is read from the call's arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx

from compile_rng.compiled import plan_store
from compile_rng.passes.plan import BATCH_SYMBOLS


def input_symbols(placeholders: Sequence[fx.Node]) -> dict[sympy.Symbol, plan_store.Position]:
    """Where each size symbol of a Dynamo graph is read from its call arguments:
    ``(input index, dim)``, dim None for a SymInt input (the first input that has it)."""
    found: dict[sympy.Symbol, plan_store.Position] = {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("example_value")
        dims = [(None, val)] if isinstance(val, torch.SymInt) else (
            list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        )
        for dim, v in dims:
            if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
                found.setdefault(v.node.expr, (i, dim))
    return found


class SizeFn:
    """Evaluates a size expression of the graph (its total advance, its batch rows) for
    the actual call arguments; the batch symbols are given per call."""

    def __init__(self, expr: sympy.Expr, placeholders: Sequence[fx.Node]):
        self.expr = sympy.sympify(expr)
        self.constant = int(self.expr) if self.expr.is_Integer else None
        needed = self.expr.free_symbols - set(BATCH_SYMBOLS)
        positions = input_symbols(placeholders)
        self.bindings = [(sym, *positions[sym]) for sym in needed if sym in positions]
        needed = needed - set(positions)
        if needed:
            raise NotImplementedError(
                f"compile_rng: the random-op advance {self.expr} depends on {sorted(map(str, needed))}, "
                "which no graph input provides"
            )

    def __call__(self, args: Sequence[Any], batch: dict | None = None) -> int:
        if self.constant is not None:
            return self.constant
        env = {
            sym: int(args[i] if dim is None else args[i].shape[dim]) for sym, i, dim in self.bindings
        }
        return int(self.expr.xreplace({**env, **(batch or {})}))
