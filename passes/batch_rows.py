"""A batched graph's rows in the rewritten graph (:mod:`compile_rng.eager.batches`).

The key input is ``[seed, base, row_start, rows_total]``; one dim of every random op is
the batch (the step's ``batch_dim``, 0 inside torch's batch-major modules), whose rows
take the outermost counters (:func:`~compile_rng.semantics.rows.batch_counter_strides`):
the op advances by ``ceil4(rows_total * row_numel)`` and starts ``row_start * row_numel``
into its range. Those terms are runtime values, so they are added to the
op's key in the graph (int64 tensor arithmetic on the key), while the rest of the offset
stays a SymInt (example in :mod:`compile_rng.passes.functionalize_rng`).

A batched graph has a second extra input, the key table (``[rows, 2]`` int64): random op
``j`` draws with ``key[:2] ^ table[j]``. Called in the step's sequence the table is zeros
(the key is the graph's); in a step with ``names=`` the runtime fills row ``j`` with op
``j``'s named stream (:mod:`compile_rng.compiled.named_keys`), so one compiled graph
serves both rules.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from compile_rng._torch.core_internals import FloorDiv
from compile_rng.passes.graph_nodes import call, source_of, torch_module_layout
from compile_rng.passes.plan import BATCH_SYMBOLS, ROW_START, ROWS_TOTAL, RngPlan
from compile_rng.passes.sym_emit import SymEmitter
from torch import fx


def declared_dim(node: fx.Node, plan: RngPlan) -> int | None:
    """The batch dim a torch module around ``node`` says its draw has, as eager code in a step
    reads it (:mod:`compile_rng.eager.batch_dims`), None where no module says it (the step's
    ``batch_dim`` then). A module the backend could not read from the compiled frame counts as
    its kind's default: batch-major attention 0, sequence-major layers 1 (``batch_first=False``)."""
    module = torch_module_layout(node)
    if module is None:
        return None
    layout = plan.module_layouts.get(module.key)
    if layout is not None:
        return layout[0]
    return 0 if module.batch_major else 1


class BatchRows:
    """A batched graph's rows: the key input ``[seed, base, row_start, rows_total]`` split
    into the ops' key and the runtime row values, and the per-op offset terms in them."""

    def __init__(
        self, graph: fx.Graph, key: fx.Node, table: fx.Node, emitter: SymEmitter, plan: RngPlan, first: fx.Node
    ):
        self.graph, self.emitter, self.plan, self.table = graph, emitter, plan, table
        with graph.inserting_before(first):  # dominates every random op
            self.key = call(graph, torch.ops.aten.slice.Tensor, key, 0, 0, 2)
            start = call(graph, torch.ops.aten.select.int, key, 0, 2)
            total = call(graph, torch.ops.aten.select.int, key, 0, 3)
        self.values = {ROW_START: start, ROWS_TOTAL: total}

    def batch_dim(self, node: fx.Node, global_shape: tuple, dtensor: bool) -> int:
        """The dim of an op's (DTensor-global) shape ``global_shape`` that holds the batch:
        the one a torch module around it says (:func:`declared_dim`), else the one the step
        declared when the graph compiled (``plan.batch_dim``). Refuses what the graph cannot tell apart, as an eager
        step does (:func:`~compile_rng.semantics.rows.batch_window`): a sequence-major
        module's draw whose first two dims have one size, a declared dim on a 4-D draw whose
        dim 0 has the batch's size too (``scaled_dot_product_attention``'s dropout)."""
        module = torch_module_layout(node)
        declared = declared_dim(node, self.plan)
        dim = self.plan.batch_dim if declared is None else declared
        if len(global_shape) <= dim:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} draws a tensor of shape {tuple(global_shape)} in a "
                f"batched graph, whose random ops must all have the batch at dim {dim} (the step's batch_dim)"
            )
        read = module is not None and module.key in self.plan.module_layouts
        if module is not None and not module.batch_major and len(global_shape) != 3:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} in torch's {module.name} draws on a tensor of shape "
                f"{tuple(global_shape)} in a batched graph: {module.name}'s activations are (seq, batch, ...) or "
                "(batch, seq, ...), so its rows of the step's batch are unknown. Give the module a batched input"
            )
        if module is not None and not module.batch_major and not read:
            self._assume(
                global_shape[0] - global_shape[1], False,
                f"{node.target} at {source_of(node)} in torch's {module.name} draws on a tensor of shape "
                f"{tuple(global_shape)} in a batched graph: {module.name} runs sequence-major activations "
                "(seq, batch, ...) unless batch-first, and with the sequence as long as the batch the graph "
                "cannot tell which dim is the batch. Run this module eagerly in the step (compile_rng reads "
                "its layout there), or give it a sequence of another length",
            )
        if module is None and dim != 0 and len(global_shape) >= 4:
            self._assume(
                global_shape[0] - global_shape[dim], False,
                f"{node.target} at {source_of(node)} draws on a tensor of shape {tuple(global_shape)} in a batched "
                f"graph compiled in a step with batch_dim={dim}: dims 0 and {dim} have one size, so the graph "
                "cannot tell whether this op is sequence-major as the step declares or batch-major "
                "(scaled_dot_product_attention's dropout runs on (batch, heads, L, S) in any model). Run the "
                "attention through nn.MultiheadAttention, or the model batch-first (batch_dim=0)",
            )
        if dtensor and dim != 0:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} draws on a DTensor in a batched graph compiled in "
                f"a step with batch_dim={dim}: DTensor draws in a step are batch-major. Keep the model's DTensor "
                "activations batch-first (batch_dim=0), or run this model eagerly in the step"
            )
        return dim

    def _assume(self, difference: sympy.Expr, equal: bool, why: str) -> None:
        """Take sizes whose ``difference`` is 0 (``equal``) or is not: refuse ``why`` where the
        trace's sizes say otherwise; where they are symbols, which Dynamo's automatic
        dynamic shapes gives each input's dim apart, the runtime refuses a call whose sizes
        say otherwise (:class:`~compile_rng.compiled.runtime.BatchKey`)."""
        difference = sympy.simplify(difference)
        if difference.free_symbols:
            self.plan.size_guards.append((difference, equal, why))
        elif (difference == 0) != equal:
            raise NotImplementedError(f"compile_rng: {why}")

    def row_numel(self, node: fx.Node, global_shape: tuple, dim: int) -> sympy.Expr:
        """Elements per batch row of an op whose (DTensor-global) shape ``global_shape`` has
        the batch at ``dim``; checks that dim is the graph's local batch."""
        heads = self._heads(node, global_shape)
        rows = sympy.simplify(global_shape[dim] / heads)
        if not rows.is_integer:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} draws on a tensor of shape {tuple(global_shape)} "
                f"in torch's MultiheadAttention, whose dim 0 should hold the batch times its {heads} heads"
            )
        if self.plan.local_rows is None:
            self.plan.local_rows = rows
        else:
            self._assume(
                rows - self.plan.local_rows, True,
                f"{node.target} at {source_of(node)} has dim {dim} of size {rows}, but this batched graph's "
                f"batch has {self.plan.local_rows} rows: in a batched backend every random op must have the "
                f"batch at dim {dim} (the step's batch_dim, or torch's module's layout); draw other randomness "
                "outside the batched region",
            )
        return heads * sympy.Mul(*(s for i, s in enumerate(global_shape) if i != dim))

    def _heads(self, node: fx.Node, global_shape: tuple) -> int:
        """Entries per batch row along the batch dim: 1, but ``nn.MultiheadAttention`` with
        ``need_weights=True`` drops on ``(batch * heads, L, S)``, a batch row's heads
        consecutive - the layout eager code draws (:mod:`compile_rng.eager.batch_dims`)."""
        module = torch_module_layout(node)
        if module is None or module.name != "MultiheadAttention" or len(global_shape) != 3:
            return 1
        layout = self.plan.module_layouts.get(module.key)
        heads = layout[1] if layout is not None else None
        if heads is None:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} in torch's MultiheadAttention draws on a tensor of "
                f"shape {tuple(global_shape)} ((batch * heads, L, S): need_weights=True) in a batched graph, and "
                "its module could not be read from the compiled frame. Pass need_weights=False (its dropout then runs "
                "on (batch, heads, L, S)), or run the module eagerly in the step"
            )
        if heads != 1 and self.plan.row_stride != 1:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} draws on a tensor of shape {tuple(global_shape)} "
                "(MultiheadAttention(need_weights=True) drops on (batch * heads, L, S)) in a batched graph compiled "
                "in a step whose rows are interleaved: a batch row's heads are not evenly spaced in the global "
                "tensor. Pass need_weights=False to nn.MultiheadAttention (its dropout then runs on (batch, heads, "
                "L, S)), or give the step contiguous rows"
            )
        return heads

    def key_and_offset(self, offset: sympy.Expr, site: int) -> tuple[fx.Node, Any]:
        """Random op ``site``'s key node and its SymInt offset: the key is ``key[:2] ^
        table[site]``; the row terms of ``offset`` are added to its base in the graph (they
        are runtime values), the rest is a SymInt."""
        rows_in_table = self.table.meta["val"].shape[0]
        if site >= rows_in_table:
            raise RuntimeError(
                f"compile_rng internal error: random op {site} of a batched graph, but its key table has "
                f"{rows_in_table} rows (sized from Dynamo's graph); please report it"
            )
        g = self.graph
        key = call(g, torch.ops.aten.bitwise_xor.Tensor, self.key, call(g, torch.ops.aten.select.int, self.table, 0, site))
        static, rows = sympy.expand(offset).as_independent(*BATCH_SYMBOLS, as_Add=True)
        offset_value = self.emitter.emit(static)
        if rows == 0:
            return key, offset_value
        shift = self._tensor(rows)
        head = call(g, torch.ops.aten.slice.Tensor, key, 0, 0, 1)
        base = call(g, torch.ops.aten.add.Tensor, call(g, torch.ops.aten.slice.Tensor, key, 0, 1, 2), shift)
        return call(g, torch.ops.aten.cat.default, [head, base]), offset_value

    def _tensor(self, expr: sympy.Expr) -> Any:
        """``expr`` as a 0-d int64 tensor node (or an int / SymInt node where it has no row term)."""
        if not expr.free_symbols & set(BATCH_SYMBOLS):
            return self.emitter.emit(expr)
        if expr in self.values:
            return self.values[expr]
        g = self.graph
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            # keep the row-free factors together: one SymInt node, then one tensor op
            fixed, varying = expr.as_independent(*BATCH_SYMBOLS, as_Add=isinstance(expr, sympy.Add))
            op = torch.ops.aten.add.Tensor if isinstance(expr, sympy.Add) else torch.ops.aten.mul.Tensor
            terms = [self._tensor(a) for a in (varying.args if isinstance(varying, type(expr)) else [varying])]
            out = terms[0]
            for t in terms[1:]:
                out = call(g, op, out, t)
            neutral = 0 if isinstance(expr, sympy.Add) else 1
            return out if fixed == neutral else call(g, op, out, self._tensor(fixed))
        if isinstance(expr, FloorDiv):
            return call(g, torch.ops.aten.div.Tensor_mode, self._tensor(expr.args[0]), self._tensor(expr.args[1]), rounding_mode="floor")
        raise NotImplementedError(f"compile_rng: cannot emit the batch offset term {expr}")
