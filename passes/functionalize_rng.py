"""Make every random op of a post-AOTAutograd graph a functional compile_rng op.

Runs on the joint graph before partitioning (or on an inference graph). Walks the
nodes in program order, keeping a running ``base`` (sympy, in the graph's size
symbols), and for each random op:

* a stateful aten random op on a plain tensor (a replica on a one-rank mesh) is
  replaced through the shared rules of :mod:`compile_rng.random_ops`: element ``i``
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

A *batched* graph (:mod:`compile_rng.batches`) has a 4-element key ``[seed, base,
row_start, rows_total]``: dim 0 of every op is the batch, the op advances by
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
import re
import time
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from compile_rng import tracker
from compile_rng.random_ops import RULES, RandomCall, draws, is_random, unsupported
from compile_rng.spmd import Sharding, contiguous_strides
from compile_rng.torch_internals import FloorDiv, detect_fake_mode, tree_leaves

from .sym_emit import SymEmitter, emit_binary

pending_key = torch.ops.compile_rng.pending_key.default


@dataclass
class RewrittenOp:
    """One random op the pass made functional (for tests, dumps and explain)."""

    original: str
    replacement: str
    node: str  # name of the functional op's node in the rewritten graph
    source: str  # "file:line" of the user code, if known
    local_shape: tuple
    dtype: torch.dtype
    offset: sympy.Expr  # base of the op's counter range, relative to the call's key
    advance: sympy.Expr
    mode: str = "tracker"
    sharding: Sharding | None = None  # None for plain tensors
    start: sympy.Expr = sympy.Integer(0)  # the rank's first counter within the range
    coords: tuple = ()  # the symbols of the mesh coordinate in ``start``, by mesh dim
    mesh: Any = None  # the DeviceMesh of a DTensor op


@dataclass
class Unsupported:
    """A random op the pass could not rewrite (collected instead of raised on request)."""

    op: str
    source: str
    reason: str


#: A batched graph's runtime rows (:mod:`compile_rng.batches`), in offset expressions.
ROW_START = sympy.Symbol("row_start", integer=True, nonnegative=True)
ROWS_TOTAL = sympy.Symbol("rows_total", integer=True, nonnegative=True)
BATCH_SYMBOLS = (ROW_START, ROWS_TOTAL)


@dataclass
class RngPlan:
    """What the pass did to one compiled graph; filled in as the pass runs."""

    name: str = "graph"  # which compiled function (set by the backend)
    #: the backend's counter layout; a plain tensor (a one-rank replica) has the same
    #: layout in both, and its ops are reported under this mode
    mode: str = "tracker"
    ops: list[RewrittenOp] = field(default_factory=list)
    total_advance: sympy.Expr = sympy.Integer(0)
    #: Python code of each graph before and after the pass rewrote it.
    graphs_before: list[str] = field(default_factory=list)
    graphs: list[str] = field(default_factory=list)
    #: explain() sets this: unsupported ops are recorded and left in place.
    collect_unsupported: bool = False
    unsupported: list[Unsupported] = field(default_factory=list)
    #: how often the pass ran on this plan's graphs (0: the compiled graph came from
    #: AOTAutograd's cache, untraced, and the backend loaded this plan as it was filed)
    pass_runs: int = 0
    #: wall time spent in this pass, and in the whole backend compile (set by the backend)
    pass_seconds: float = 0.0
    compile_seconds: float = 0.0
    #: a batched graph: dim 0 of every random op is the batch (compile_rng.batches);
    #: ``local_rows`` is that dim's size, the same for every op (None until one is seen)
    batched: bool = False
    local_rows: sympy.Expr | None = None
    #: positions among the traced graph's inputs (the key not counted) that a plain-tensor
    #: random op's tensor is computed from, and how many inputs that graph has: the
    #: backend refuses a tensor-parallel rank's local piece there (compile_rng.local_values)
    draw_inputs: tuple[int, ...] = ()
    traced_inputs: int = 0

    @property
    def cached(self) -> bool:
        """The compiled graph came from AOTAutograd's cache and this plan was loaded."""
        return self.pass_runs == 0


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
        path = re.sub(r"^L\['[^']*'\]\.?", "", path)  # Dynamo's name of the compiled root module
        path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path).lstrip(".")
        name = getattr(cls, "__name__", str(cls))
        return f"{path} ({name})" if path else name
    return "?"


def _expr(v: Any) -> sympy.Expr:
    return v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(int(v))


def ceil4_expr(n: sympy.Expr) -> sympy.Expr:
    return FloorDiv(n + 3, 4) * 4


def _first_val(node: fx.Node) -> Any:
    val = node.meta["val"]
    return val[0] if isinstance(val, (tuple, list)) else val


class _GraphCall(RandomCall):
    """A plain-tensor random op node, replaced by nodes inserted before it."""

    def __init__(self, node: fx.Node, key: fx.Node, offset: Any, emitter: SymEmitter):
        self.node, self.op, self.key, self.offset, self.emitter = node, node.target, key, offset, emitter
        self.kw = _normalized(node)
        val = _first_val(node)
        self.dtype = val.dtype
        self.shape = [_expr(s) for s in val.shape]

    def arg(self, name, default=None):
        value = self.kw.get(name)
        return default if value is None else value

    def size(self):
        return [self.emitter.emit(s) for s in self.shape]

    def strides(self):
        return [self.emitter.emit(s) for s in contiguous_strides(self.shape)]

    def emit(self, target, *args):
        return self.apply(target, self.key, self.offset, *args)

    def apply(self, target, *args, **kwargs):
        node = self.node.graph.call_function(target, args, kwargs)
        node.meta.update({k: v for k, v in self.node.meta.items() if k != "val"})
        fake_mode = detect_fake_mode([self.key.meta["val"]])
        with fake_mode:
            node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]), **kwargs)
        return node


def _functional_node(node: fx.Node) -> fx.Node:
    """The compile_rng op behind a rule's result (derived distributions add arithmetic)."""
    todo = [node]
    while todo:
        n = todo.pop(0)
        if getattr(n.target, "namespace", None) == "compile_rng":
            return n
        todo.extend(a for a in n.all_input_nodes)
    raise AssertionError(f"no compile_rng op behind {node}")


def find_key(graph: fx.Graph, batched: bool = False) -> fx.Node:
    """The key input: the last primal / user input, added by the backend."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    key = inputs[-1] if inputs else None
    val = key.meta.get("val") if key is not None else None
    length = 4 if batched else 2
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.int64 and tuple(val.shape) == (length,)):
        raise RuntimeError(
            "compile_rng internal error: the graph's last input is not the rng key; "
            "was this graph compiled through compile_rng.backend()?"
        )
    return key


def _normalized(node: fx.Node) -> dict:
    from torch.fx.operator_schemas import normalize_function

    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs) if normalized is not None else dict(node.kwargs)


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` is a random op that draws for its arguments (SDPA at
    ``dropout_p=0`` carries the random tag but does not)."""
    return is_random(node.target) and (node.target in RULES or draws(node.target, _normalized(node)))


def _check_plain(node: fx.Node, key: fx.Node) -> None:
    if node.target not in RULES:
        raise unsupported(node.target)
    if node.kwargs.get("generator") is not None:
        raise NotImplementedError(
            f"compile_rng: {node.target} got an explicit generator=; compiled random ops draw "
            "from compile_rng's stream (seed it with compile_rng.manual_seed) - drop the argument"
        )
    device = _first_val(node).device
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


def _dropout_backward_from_stream(graph: fx.Graph) -> None:
    """Dropout's backward regenerates its mask from the stream instead of saving it.

    ``native_dropout_backward(grad, mask, scale)`` becomes ``grad * keep * s`` where
    ``keep`` is drawn again at the forward dropout's counters (same key, offset and
    strides: a bernoulli with ``p = 1 - p_drop`` is exactly dropout's keep test), so the
    forward's mask output is dead and nothing but the 2-element key is saved for
    backward. ``s`` is the forward's scale, rounded like the forward (``1 / (1 - p)``
    from double can differ by an ulp), so the gradient is the derivative of what the
    forward computed. Runs after the rewrite, when the masks come from
    ``compile_rng.dropout`` nodes.
    """
    from compile_rng.stream import keep_scale

    emitter = SymEmitter(graph)
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout_backward.default):
        grad, mask, scale = node.args
        dtype = node.meta["val"].dtype
        s = keep_scale(1.0 / scale, dtype) if scale else 0.0
        source = mask.args[0] if mask.target is operator.getitem else None
        with graph.inserting_before(node):
            if source is not None and source.target is torch.ops.compile_rng.dropout.default:
                key, offset, x, strides, p = source.args
                size = [emitter.emit(_expr(d)) for d in node.meta["val"].shape]  # SymInt nodes, not raw SymInts
                keep = _call(graph, torch.ops.compile_rng.bernoulli.default, key, offset, size, strides, 1.0 - p, dtype)
            else:
                keep = mask
            kept = _call(graph, torch.ops.aten.mul.Tensor, grad, keep)
            new = _call(graph, torch.ops.aten.mul.Tensor, kept, s)
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _call(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A call node with its fake value computed from its arguments' values."""
    node = graph.call_function(target, args, kwargs)
    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    tensors = [v for v in tree_leaves(vals) if isinstance(v, torch.Tensor)]
    with detect_fake_mode(tensors):
        node.meta["val"] = target(*vals, **kwargs)
    return node


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


class _BatchRows:
    """A batched graph's rows: the key input ``[seed, base, row_start, rows_total]`` split
    into the ops' key and the runtime row values, and the per-op offset terms in them."""

    def __init__(self, graph: fx.Graph, key: fx.Node, emitter: SymEmitter, plan: RngPlan, first: fx.Node):
        self.graph, self.emitter, self.plan = graph, emitter, plan
        with graph.inserting_before(first):  # dominates every random op
            self.key = _call(graph, torch.ops.aten.slice.Tensor, key, 0, 0, 2)
            start = _call(graph, torch.ops.aten.select.int, key, 0, 2)
            total = _call(graph, torch.ops.aten.select.int, key, 0, 3)
        self.values = {ROW_START: start, ROWS_TOTAL: total}

    def row_numel(self, node: fx.Node, global_shape: tuple) -> sympy.Expr:
        """Elements per batch row of an op whose (DTensor-global) shape is ``global_shape``;
        checks that dim 0 is the graph's local batch."""
        if not global_shape:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} draws a 0-d tensor in a batched graph, "
                "whose random ops must all be on batch-major activations (dim 0 = the batch)"
            )
        rows = global_shape[0]
        if self.plan.local_rows is None:
            self.plan.local_rows = rows
        elif sympy.simplify(rows - self.plan.local_rows) != 0:
            raise NotImplementedError(
                f"compile_rng: {node.target} at {source_of(node)} has dim 0 of size {rows}, but this "
                f"batched graph's batch has {self.plan.local_rows} rows: in a batched backend every random "
                "op must be on a batch-major activation (dim 0 = the batch); draw other randomness "
                "outside the batched region"
            )
        return sympy.Mul(*global_shape[1:]) if len(global_shape) > 1 else sympy.Integer(1)

    def key_and_offset(self, offset: sympy.Expr) -> tuple[fx.Node, Any]:
        """The op's key node and its SymInt offset: the row terms of ``offset`` are added to
        the key's base in the graph (they are runtime values), the rest is a SymInt."""
        static, rows = sympy.expand(offset).as_independent(*BATCH_SYMBOLS, as_Add=True)
        offset_value = self.emitter.emit(static)
        if rows == 0:
            return self.key, offset_value
        g = self.graph
        shift = self._tensor(rows)
        head = _call(g, torch.ops.aten.slice.Tensor, self.key, 0, 0, 1)
        base = _call(g, torch.ops.aten.add.Tensor, _call(g, torch.ops.aten.slice.Tensor, self.key, 0, 1, 2), shift)
        return _call(g, torch.ops.aten.cat.default, [head, base]), offset_value

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
                out = _call(g, op, out, t)
            neutral = 0 if isinstance(expr, sympy.Add) else 1
            return out if fixed == neutral else _call(g, op, out, self._tensor(fixed))
        if isinstance(expr, FloorDiv):
            return _call(g, torch.ops.aten.div.Tensor_mode, self._tensor(expr.args[0]), self._tensor(expr.args[1]), rounding_mode="floor")
        raise NotImplementedError(f"compile_rng: cannot emit the batch offset term {expr}")


def _note_draw_inputs(graph: fx.Graph, plain_sites: list[fx.Node], plan: RngPlan) -> None:
    """Record which graph inputs the plain-tensor random ops' tensors are computed from."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    position = {n: i for i, n in enumerate(inputs[:-1])}  # the key is the last input
    found, seen, todo = set(plan.draw_inputs), set(), list(plain_sites)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            if node in position:
                found.add(position[node])
            todo.extend(node.all_input_nodes)
    plan.draw_inputs, plan.traced_inputs = tuple(sorted(found)), len(inputs) - 1


def _functionalize(graph: fx.Graph, plan: RngPlan) -> None:
    sites = [n for n in graph.nodes if _draws(n) or n.target is pending_key]
    if not sites:
        _dropout_backward_from_stream(graph)
        return
    plan.graphs_before.append(graph.python_code("self").src)
    key = find_key(graph, plan.batched)
    _note_draw_inputs(graph, [n for n in sites if n.target is not pending_key], plan)
    emitter = SymEmitter(graph)
    batch = _BatchRows(graph, key, emitter, plan, sites[0]) if plan.batched else None
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
        info = node.meta[tracker.SITE] if pending else None
        global_shape = (
            tuple(_expr(s) for s in info.sharding.global_shape) if pending
            else tuple(_expr(s) for s in _first_val(node).shape)
        )
        numel = sympy.Mul(*global_shape) if global_shape else sympy.Integer(1)
        with graph.inserting_before(node):
            if batch is None:
                op_key, base_value = key, emitter.emit(base)
                advance = ceil4_expr(numel)
            else:
                row_numel = batch.row_numel(node, global_shape)
                op_key, base_value = batch.key_and_offset(base + ROW_START * row_numel)
                advance = ceil4_expr(ROWS_TOTAL * row_numel)
            if pending:
                new = _resolve_pending(node, op_key, base_value)
                val = _first_val(new)
                record = RewrittenOp(
                    info.op, str(new.target), new.name, source_of(new), tuple(_expr(s) for s in val.shape),
                    val.dtype, base, advance, info.mode, info.sharding, _expr(info.start),
                    tuple(_expr(c) for c in info.coords), info.mesh,
                )
            else:
                call = _GraphCall(node, op_key, base_value, emitter)
                new = RULES[node.target](call)
                functional = _functional_node(new)
                record = RewrittenOp(
                    str(node.target), str(functional.target), functional.name, source_of(node),
                    tuple(call.shape), call.dtype, base, advance, plan.mode,
                )
                node.replace_all_uses_with(new)
                graph.erase_node(node)
        plan.ops.append(record)
        plan.total_advance = plan.total_advance + advance
    _dropout_backward_from_stream(graph)
    graph.lint()
    plan.graphs.append(graph.python_code("self").src)
