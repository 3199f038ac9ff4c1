"""Make every random op of a post-AOTAutograd graph a functional compile_rng op.

Runs on the joint graph before partitioning (or on an inference graph). Walks the
nodes in program order, keeping a running ``base`` (sympy, in the graph's size
symbols), and for each random op:

* a stateful aten random op on a plain tensor (a replica on a one-rank mesh) is
  replaced through the shared rules of :mod:`compile_rng.semantics.random_ops`: element ``i``
  gets counter ``key.base + base + i``;
* a DTensor random op, already replaced at trace time by the tracker with a functional
  op on a ``pending_key(site)`` placeholder whose offset is the shard's start (a SymInt
  in the runtime mesh coordinate), gets the graph's key and ``base`` added to its offset.

Either way ``base`` then grows by the op's ``ceil4(numel(global))``. The offsets are
emitted as SymInt nodes, so nothing rank- or shape-specific is baked into the graph.
Any other random op raises an error naming it.

Example: ``F.dropout(x, 0.5) + torch.rand(3)`` on a plain ``x`` of 3 elements
(``arg1_1`` is the ``(seed, base)`` key input the backend adds to the graph)::

    # before
    native_dropout = torch.ops.aten.native_dropout.default(arg0_1, 0.5, True)
    getitem = native_dropout[0]
    rand = torch.ops.aten.rand.default([3], device=device(type='cpu'), pin_memory=False)
    add = torch.ops.aten.add.Tensor(getitem, rand)

    # after: counters [0, 4) draw the mask, [4, 8) the uniforms; the call advances 8
    dropout_default = torch.ops.compile_rng.dropout.default(arg1_1, 0, arg0_1, [1], 0.5)
    getitem = dropout_default[0]
    uniform_default = torch.ops.compile_rng.uniform.default(arg1_1, 4, [3], [1], 0.0, 1.0, torch.float32)
    add = torch.ops.aten.add.Tensor(getitem, uniform_default)

A DTensor op arrives as ``compile_rng.uniform(pending_key(7, cpu), 128*u0, ...)`` (the
shard's start in the runtime mesh coordinate ``u0``; the node's ``meta`` carries the
op's sharding) and leaves as ``compile_rng.uniform(arg1_1, base + 128*u0, ...)``.

A *batched* graph (:mod:`compile_rng.eager.batches`) has a 4-element key ``[seed, base,
row_start, rows_total]``: one dim of every op is the batch (dim 0 unless the step declares
``batch_dim``; :mod:`compile_rng.passes.batch_rows`), the op advances by
``ceil4(rows_total * row_numel)`` and starts ``row_start * row_numel`` into its range.
Those terms are runtime values, so they are added to the op's key in the graph (int64
tensor arithmetic on the key), while the rest of the offset stays a SymInt::

    # a batched graph's dropout on x: (4, 8), after
    key = slice(arg1_1, 0, 0, 2)     row_start = select(arg1_1, 0, 2)
    shift = add(slice(key, 0, 1, 2), mul(row_start, 8))
    dropout_default = torch.ops.compile_rng.dropout.default(cat([slice(key, 0, 0, 1), shift]), 0, arg0_1, [8, 1], 0.5)
    # the call advances ceil4(rows_total * 8)
"""

from __future__ import annotations

import operator
import time
from typing import Any

import sympy
import torch
from compile_rng._torch.core_internals import detect_fake_mode
from compile_rng._torch.dynamo_internals import dynamo_module_call, dynamo_module_source
from compile_rng.passes.batch_rows import BatchRows, declared_dim
from compile_rng.passes.dropout_backward import dropout_backward_from_stream
from compile_rng.passes.graph_nodes import ceil4_expr, expr, first_val, source_of
from compile_rng.passes.plan import ROW_START, ROWS_TOTAL, ModuleSite, RewrittenOp, RngPlan, Unsupported
from compile_rng.passes.sym_emit import SymEmitter, emit_binary
from compile_rng.semantics.pending_key import SITE
from compile_rng.semantics.random_ops import (
    DECOMPOSED_IN_GRAPHS,
    DRAWN_WHOLE,
    RULES,
    RandomCall,
    draws,
    draws_nothing,
    counter_shape,
    is_random,
    normalized_arguments,
    unsupported,
)
from compile_rng.semantics.rows import batch_counter_strides
from compile_rng.semantics.spmd import contiguous_strides
from torch import fx

pending_key = torch.ops.compile_rng.pending_key.default


class _GraphCall(RandomCall):
    """A plain-tensor random op node, replaced by nodes inserted before it."""

    def __init__(
        self, node: fx.Node, key: fx.Node, offset: Any, emitter: SymEmitter, batch_dim: int | None = None,
        row_stride: int = 1,
    ):
        """``batch_dim``: a batched graph's dim of this op's tensor that holds the batch;
        ``row_stride``: its global rows between two local ones."""
        self.node, self.op, self.key, self.offset, self.emitter = node, node.target, key, offset, emitter
        self.kw = normalized_arguments(node.target, node.args, node.kwargs)
        val = first_val(node)
        self.dtype, self.device = val.dtype, val.device
        self.shape = drawn_global_shape(node)
        self.batch_dim, self.row_stride = batch_dim, row_stride

    def size(self):
        return [self.emitter.emit(s) for s in self.shape]

    def strides(self):
        if self.batch_dim is None or not self.shape:
            strides = contiguous_strides(self.shape)
        else:
            strides = batch_counter_strides(self.shape, self.batch_dim, self.row_stride)
        return [self.emitter.emit(s) for s in strides]

    def emit(self, target, *args):
        return self.apply(target, self.key, self.offset, *args)

    def apply(self, target, *args, **kwargs):
        node = self.node.graph.call_function(target, args, kwargs)
        node.meta.update({k: v for k, v in self.node.meta.items() if k != "val"})
        fake_mode = detect_fake_mode([self.key.meta["val"]])
        with fake_mode:
            node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]), **kwargs)
        return node


def drawn_global_shape(node: fx.Node) -> list:
    """The shape a plain random op node draws counters over (its output's, but
    :func:`~compile_rng.semantics.random_ops.counter_shape`)."""
    kw = normalized_arguments(node.target, node.args, node.kwargs)
    shape = counter_shape(node.target, kw, first_val(node).shape, lambda n: first_val(n).shape)
    return [expr(s) for s in shape]


def _functional_node(node: fx.Node) -> fx.Node:
    """The compile_rng op behind a rule's result (derived distributions add arithmetic)."""
    todo = [node]
    while todo:
        n = todo.pop(0)
        if getattr(n.target, "namespace", None) == "compile_rng":
            return n
        todo.extend(a for a in n.all_input_nodes)
    raise AssertionError(f"no compile_rng op behind {node}")


def _user_inputs(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]


def find_key(graph: fx.Graph, sites: list[fx.Node], batched: bool = False) -> tuple[fx.Node, fx.Node | None]:
    """The key input (the last primal / user input) and, in a batched graph, the key
    table before it (:mod:`compile_rng.passes.batch_rows`); both added by the backend.
    Random ops ``sites`` in a graph without them are refused by name: Inductor runs the
    pass on a higher-order op's branches too (``torch.cond``, ``torch.while_loop``), which
    take only the operands the op passes them."""
    inputs = _user_inputs(graph)
    key = inputs[-1] if inputs else None
    table = inputs[-2] if batched and len(inputs) > 1 else None
    val = key.meta.get("val") if key is not None else None
    length = 4 if batched else 2
    table_val = table.meta.get("val") if table is not None else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.int64 and tuple(val.shape) == (length,)) or (
        batched and not (isinstance(table_val, torch.Tensor) and table_val.ndim == 2 and table_val.shape[1] == 2)
    ):
        _refuse_keyless(sites)
    return key, table


def _refuse_keyless(sites: list[fx.Node]) -> None:
    ops = ", ".join(f"{n.target} at {source_of(n)}" for n in sites)
    raise NotImplementedError(
        f"compile_rng: {ops} in a graph without compile_rng's key input: a branch or body of a higher-order "
        "op (torch.cond, torch.while_loop, ...), whose random ops compile_rng does not rewrite, or a graph "
        "not compiled through compile_rng.backend(). Draw the random values before the higher-order op and "
        "pass them in as an operand, or run it eagerly in the step"
    )


def _branch_sites(graph: fx.Graph) -> list[fx.Node]:
    """The random ops in the subgraphs of ``graph``'s module (a higher-order op's branches
    and bodies): a compiler other than Inductor runs no pass on them, and their ops would
    draw from whatever stream is there when they run."""
    root = graph.owning_module
    if root is None:
        return []
    return [n for _, sub in root.named_modules() if sub is not root and isinstance(sub, fx.GraphModule)
            for n in sub.graph.nodes if _draws(n)]


def _module_site(node: fx.Node, ordinals: dict) -> ModuleSite | None:
    """Where ``node`` sits among the compiled code's modules (Dynamo's ``nn_module_stack``;
    a DTensor op's functional node was traced inside the op's dispatch and carries it too)."""
    stack = node.meta.get("nn_module_stack")
    if stack is None:  # a pending key's functional op: the stack is on the op that used it
        stack = next((u.meta.get("nn_module_stack") for u in node.users if u.meta.get("nn_module_stack")), None)
    if stack:
        key, (path, _cls) = list(stack.items())[-1]
        source = dynamo_module_source(path)
        if source is None:
            return None
        scope, root, dotted = source
        where = (scope, root, dotted, dynamo_module_call(key))
    else:
        where = ("L", "", "", 0)  # the compiled frame's own module (its first argument)
    ordinal = ordinals.get(where, 0)
    ordinals[where] = ordinal + 1
    scope, root, dotted, call = where
    return ModuleSite(root, dotted, call, ordinal, scope)


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` is a random op that draws for its arguments (SDPA at
    ``dropout_p=0`` carries the random tag but does not)."""
    return is_random(node.target) and (
        _graph_rule(node.target) or draws(node.target, normalized_arguments(node.target, node.args, node.kwargs))
    )


def _graph_rule(target: object) -> bool:
    # rrelu's ops are decomposed before the pass (their rules are eager code's): one met
    # here is refused, as before they had rules
    return target in RULES and target not in DECOMPOSED_IN_GRAPHS


def _check_plain(node: fx.Node, key: fx.Node) -> None:
    if not _graph_rule(node.target):
        raise unsupported(node.target)
    if first_val(node).dtype.is_complex:
        raise NotImplementedError(
            f"compile_rng: {node.target} draws a complex tensor: compiled graphs draw real dtypes only (eager "
            "code draws complex ones as torch does, over the real view). Draw the real view, "
            "torch.view_as_complex(torch.randn(*size, 2) / 2**0.5), or run the op eagerly (torch.compiler.disable)"
        )
    if node.kwargs.get("generator") is not None:
        raise NotImplementedError(
            f"compile_rng: {node.target} got an explicit generator=; compiled random ops draw "
            "from compile_rng's stream (seed it with compile_rng.manual_seed) - drop the argument"
        )
    device = first_val(node).device
    if device != key.meta["val"].device:
        raise NotImplementedError(
            f"compile_rng: {node.target} runs on {device}, but this version keeps streams "
            f"for {key.meta['val'].device} only"
        )


def _resolve_pending(node: fx.Node, key: fx.Node, base: Any) -> fx.Node:
    """Point the functional ops that use ``pending_key`` ``node`` at the real key (one op,
    or one per piece of a shard drawn piecewise); returns the first."""
    users = list(node.users)
    for user in users:
        offset = user.args[1]
        if base != 0:
            with node.graph.inserting_before(user):
                offset = emit_binary(node.graph, operator.add, base, offset)
        user.args = (key, offset, *user.args[2:])
    node.graph.erase_node(node)
    return users[0]


def functionalize_rng(graph: fx.Graph, plan: RngPlan) -> None:
    """Rewrite every random op of ``graph`` in place; append what was done to ``plan``.

    Idempotent: a graph with no stateful random op and no pending key is left
    unchanged, so the pass can run on the joint graph and again on its partitions.
    """
    start = time.perf_counter()
    plan.pass_runs += 1
    try:
        _functionalize(graph, plan)
    finally:
        plan.pass_seconds += time.perf_counter() - start


def _note_draw_inputs(graph: fx.Graph, plain_sites: list[fx.Node], plan: RngPlan) -> None:
    """Record which graph inputs the plain-tensor random ops' tensors are computed from."""
    added = 2 if plan.batched else 1  # the key (and a batched graph's key table) come last
    inputs = _user_inputs(graph)
    position = {n: i for i, n in enumerate(inputs[:-added])}
    found, seen, todo = set(plan.draw_inputs), set(), list(plain_sites)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            if node in position:
                found.add(position[node])
            todo.extend(node.all_input_nodes)
    plan.draw_inputs, plan.traced_inputs = tuple(sorted(found)), len(inputs) - added


def _values_from_arguments(node: fx.Node, key: fx.Node, emitter: SymEmitter) -> None:
    """Replace random op ``node``, whose rule computes its values from its arguments
    (:func:`~compile_rng.semantics.random_ops.draws_nothing`: dropout at p = 0 or 1), by
    them; it reserves no counters, as eager code's."""
    with node.graph.inserting_before(node):
        new = RULES[node.target](_GraphCall(node, key, 0, emitter))
    for user in list(node.users):  # the tuple's getitems
        user.replace_all_uses_with(new[user.args[1]])
        node.graph.erase_node(user)
    node.graph.erase_node(node)


def _functionalize(graph: fx.Graph, plan: RngPlan) -> None:
    branch_sites = _branch_sites(graph)
    if branch_sites:
        _refuse_keyless(branch_sites)
    sites = [n for n in graph.nodes if _draws(n) or n.target is pending_key]
    if not sites:
        dropout_backward_from_stream(graph)
        return
    plan.graphs_before.append(graph.python_code("self").src)
    key, table = find_key(graph, sites, plan.batched)
    _note_draw_inputs(graph, [n for n in sites if n.target is not pending_key], plan)
    emitter = SymEmitter(graph)
    batch = BatchRows(graph, key, table, emitter, plan, sites[0]) if plan.batched else None
    ordinals: dict = {}
    for node in sites:
        base = plan.total_advance
        pending = node.target is pending_key
        if not pending:
            try:
                _check_plain(node, key)
            except NotImplementedError as e:
                if not plan.collect_unsupported:
                    raise
                plan.unsupported.append(Unsupported(str(node.target), source_of(node), str(e)))
                continue
            if draws_nothing(node.target, normalized_arguments(node.target, node.args, node.kwargs)):
                _values_from_arguments(node, key, emitter)
                continue
        info = node.meta[SITE] if pending else None
        global_shape = (
            tuple(expr(s) for s in info.sharding.global_shape) if pending else tuple(drawn_global_shape(node))
        )
        numel = sympy.Mul(*global_shape) if global_shape else sympy.Integer(1)
        module = None
        # a batched graph's permutation is a replica too, as eager code draws it: no rows
        drawn_whole = not pending and node.target in DRAWN_WHOLE
        whole = batch is None or drawn_whole
        with graph.inserting_before(node):
            if whole:
                op_key, base_value = (
                    (key, emitter.emit(base)) if batch is None else batch.key_and_offset(base, len(plan.ops))
                )
                advance = ceil4_expr(numel)
            else:
                batch_dim = batch.batch_dim(node, global_shape, pending)
                row_numel = batch.row_numel(node, global_shape, batch_dim)
                if pending and plan.row_stride != 1:
                    raise NotImplementedError(
                        f"compile_rng: {info.op} at {source_of(node)} draws on a DTensor in a batched graph "
                        f"compiled in a step whose rows are interleaved (every {plan.row_stride}th row of the "
                        "global batch): compiled DTensor draws take contiguous rows only. Give the step "
                        "contiguous rows (rows='contiguous'), or run this model eagerly in the step"
                    )
                op_key, base_value = batch.key_and_offset(base + ROW_START * row_numel, len(plan.ops))
                advance = ceil4_expr(ROWS_TOTAL * row_numel)
                module = _module_site(node, ordinals)
            if pending:
                new = _resolve_pending(node, op_key, base_value)
                val = first_val(new)
                record = RewrittenOp(
                    info.op, str(new.target), new.name, source_of(new), tuple(expr(s) for s in val.shape),
                    val.dtype, base, advance, info.layout, info.sharding, expr(info.start),
                    tuple(expr(c) for c in info.coords), info.mesh, module,
                )
            else:
                call = (
                    _GraphCall(node, op_key, base_value, emitter) if whole
                    else _GraphCall(node, op_key, base_value, emitter, batch_dim, plan.row_stride)
                )
                new = RULES[node.target](call)
                functional = _functional_node(new)
                record = RewrittenOp(
                    str(node.target), str(functional.target), functional.name, source_of(node),
                    tuple(call.shape), call.dtype, base, advance, plan.layout, module=module, whole=drawn_whole,
                    batch_dim=declared_dim(node, plan),
                )
                node.replace_all_uses_with(new)
                graph.erase_node(node)
        plan.ops.append(record)
        plan.total_advance = plan.total_advance + advance
    dropout_backward_from_stream(graph)
    graph.lint()
    plan.graphs.append(graph.python_code("self").src)
