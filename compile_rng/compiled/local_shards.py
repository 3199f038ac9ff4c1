"""Plain tensors that are shards: a random op on a TP rank's local tensor, in a Dynamo graph.

A plain tensor-parallel plan (``ColwiseParallel()`` with its default local outputs, as
torch's TP tutorial and transformers use it) hands the attention and the MLP this
rank's *local* tensor: ``to_local()`` of a ``Shard`` DTensor, then plain ``view`` /
``transpose`` / matmul / softmax on this rank's heads. A random op there is not a DTensor
op; drawn as a plain tensor it would be drawn as a replica, and every TP rank would get
the same dropout mask for different heads. The Dynamo graph still knows where the
tensor came from, so this analysis recovers each element's place in the global tensor:

1. ``x.to_local()`` of a DTensor with a ``Shard`` / ``_StridedShard`` / ``Partial``
   placement makes ``x`` a *shard value*: it is that DTensor's local tensor;
2. every later node with a shard operand runs on fake DTensors (shard operands as their
   DTensors, plain operands as replicas) under DTensor's own sharding rules. Its result's
   placements describe the local result exactly when DTensor runs the op without moving an
   operand (same placements in, the local op on the local tensors): otherwise, or when the
   rules fail or the local shapes disagree, the node's result is *lost* (no known layout);
3. every node with a shard or lost operand is rewritten to run inside compile_rng's
   region for the tensor it draws (its result; SDPA: the attention matrix of ``q``'s
   heads), so its random ops draw the DTensor op's counters - or, for a lost one, raise
   an error that names the op, its line and the fix. ``from_local`` ends a shard value
   (its result is a DTensor again).

Example (Llama's attention, TP=2, ``q_proj`` a plain ``ColwiseParallel()``)::

    # before                                         # shard value
    hook_result = linear.to_local()                  # Shard(2) of (2, 16, 32)
    view = hook_result.view((2, 16, -1, 8))          # Shard(2) of (2, 16, 4, 8)
    query_states = view.transpose(1, 2)              # Shard(1) of (2, 4, 16, 8)
    attn = scaled_dot_product_attention(query_states, ..., dropout_p=0.1)

    # after: the same nodes, each a ShardedCall; SDPA's dropout draws the attention
    # matrix (2, 4, 16, 16) at its Shard(1) counters (tracker or invariant layout)
    attn = ShardedCall(scaled_dot_product_attention, Shard(1) of (2, 4, 16, 16))(query_states, ...)

A checkpointed region inside the graph is a higher-order op
(``tag_activation_checkpoint``) with a subgraph: the analysis runs in the subgraph too,
whose own ``to_local()`` calls start shard values there (activation checkpointing applied
before the compile, torchtitan's order) and whose inputs are the shard values the region
is given (``checkpoint(self.core, q, k)`` on local pieces, Megatron's order); what the
region returns keeps its shard values outside it.

Not covered: a shard that leaves the graph (a graph break between ``to_local`` and the
random op) arrives in the next graph as a plain input and is drawn as a replica; keep
such code in one graph, or keep the tensor a DTensor (``use_local_output=False``). A
graph with symbolic sizes (dynamic shapes: what Dynamo compiles after an input's shape
changed) refuses a random op on a local piece, with the fix (``dynamic=False``): DTensor's
sharding rules do not take SymInt arguments.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from compile_rng._torch.core_internals import TorchDispatchMode, detect_fake_mode, higher_order_op_name, tree_leaves
from compile_rng._torch.dtensor_internals import distribute_region, dtensor_spec, local_tensor
from compile_rng._torch.dynamo_internals import is_from_local, is_to_local
from compile_rng.eager import tracker
from compile_rng.eager.dispatch_modes import RandomOpMode, drawn_shape
from compile_rng.semantics.local_values import Layout, Lost
from compile_rng.semantics.shard_layouts import SizeArgument, is_sharded, propagate


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else node


def _where(node: fx.Node) -> str:
    """``file:line`` of the user code that created ``node``."""
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip().startswith("File ")]
    if not frames:
        return "?"
    parts = frames[-1].split(",")
    return f"{parts[0][6:-1]}:{parts[1].split()[-1]}" if len(parts) > 1 else frames[-1]


def _describe(node: fx.Node) -> str:
    return f"{node.target if node.op == 'call_method' else getattr(node.target, '__name__', node.target)} at {_where(node)}"


def _run(node: fx.Node) -> Any:
    """``node``'s callable, taking the node's arguments."""
    if node.op == "call_method":
        return lambda self, *args, **kwargs: getattr(self, node.target)(*args, **kwargs)
    return node.target


_SIZE_KINDS = {"view": "view", "reshape": "view", "expand": "expand"}


def _size_argument(node: fx.Node, args: tuple, kwargs: dict) -> SizeArgument | None:
    """The sizes of a ``view`` / ``reshape`` / ``expand`` node (``x.view(a, b)``,
    ``x.view((a, b))``, ``torch.reshape(x, (a, b))``)."""
    name = node.target if node.op == "call_method" else ("reshape" if node.target is torch.reshape else None)
    if name not in _SIZE_KINDS or kwargs or len(args) < 2:
        return None
    packed = len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size))
    sizes = tuple(args[1]) if packed else tuple(args[1:])
    if not all(isinstance(s, (int, torch.SymInt)) for s in sizes):
        return None

    def with_sizes(new: list) -> tuple:
        return ((args[0], tuple(new)) if packed else (args[0], *new)), kwargs

    return SizeArgument(_SIZE_KINDS[name], sizes, with_sizes)


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention


class _Analysis:
    """The shard values of one Dynamo graph, in program order."""

    def __init__(self, fake_mode: Any = None):
        self.values: dict[fx.Node, Any] = {}  # node -> its DTensor (shard value) or Lost
        self.fake_mode: Any = fake_mode  # the mode of the graph's example values (of the first shard)

    def start(self, node: fx.Node) -> bool:
        """Whether ``node`` is a ``to_local()`` of a sharded DTensor (recorded then)."""
        if is_to_local(node) and is_sharded(_example(node.args[0])):
            shard = _example(node.args[0])
            if not all(isinstance(s, int) for s in shard.shape):
                # DTensor's sharding rules hash their arguments, which a SymInt refuses
                self.values[node] = Lost(
                    f"this graph's sizes are symbolic ({_describe(node)} of a DTensor of shape {tuple(shard.shape)}; "
                    "Dynamo compiles such a graph once an input's shape has changed), and the layout of a "
                    "TP rank's local piece is recovered for static sizes only: compile with dynamic=False "
                    "(torch.compile(..., dynamic=False), or module.compile(dynamic=False))"
                )
                return True
            self.values[node] = shard
            self.fake_mode = self.fake_mode or detect_fake_mode([local_tensor(shard)])
            return True
        return False

    def operands(self, node: fx.Node) -> list[fx.Node]:
        return [n for n in node.all_input_nodes if n in self.values]

    def propagate(self, node: fx.Node) -> Any:
        """``node``'s result as a shard value (a DTensor), None for a replica, or Lost."""
        lost = [self.values[n] for n in self.operands(node) if isinstance(self.values[n], Lost)]
        if lost:
            return lost[0]
        if _is_attention(node):
            return self._attention(node, output=True)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.values.get(n, _example(n)))
        if node.target is torch.cat and args and isinstance(args[0], (list, tuple)):
            # torch.cat skips 1-D empty operands (a KV cache's first step); DTensor's rule does not
            args = ([t for t in args[0] if not (isinstance(t, torch.Tensor) and tuple(t.shape) == (0,))], *args[1:])
        # fake operands run on their own mode (DTensor's rules bring their own)
        return propagate(
            _run(node), args, kwargs, tree_leaves(_example(node)), _describe(node), _size_argument(node, args, kwargs)
        )

    def _attention(self, node: fx.Node, output: bool) -> Any:
        """SDPA: its output (``output``) or its attention matrix, laid out like ``q``'s heads."""
        from torch.fx.operator_schemas import normalize_function

        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        kw = normalized.kwargs if normalized is not None else dict(node.kwargs)
        q, k = self.values.get(kw["query"]), self.values.get(kw["key"])
        lost = [v for v in (q, k, self.values.get(kw["value"])) if isinstance(v, Lost)]
        if lost:
            return lost[0]
        if not isinstance(q, DTensor):
            return Lost(f"{_describe(node)}: the query is not a shard of a known layout")
        if any(getattr(p, "dim", None) in (q.ndim - 1, -1) for p in q.placements):
            return Lost(f"{_describe(node)}: the query is sharded on the head dimension")
        keys = _example(kw["key"]) if k is None else k
        last = (_example(kw["value"]) if self.values.get(kw["value"]) is None else self.values[kw["value"]]).shape[-1]
        global_shape = (*q.shape[:-1], last if output else keys.shape[-2])
        local = q.to_local()
        local_shape = (*local.shape[:-1], last if output else _local(keys).shape[-2])
        with self.fake_mode or contextlib.nullcontext():
            piece = torch.empty(local_shape, dtype=local.dtype, device=local.device)
            return DTensor.from_local(
                piece, q.device_mesh, q.placements, run_check=False, shape=global_shape,
                stride=torch.empty(global_shape, device="meta").stride(),
            )

    def drawn(self, node: fx.Node) -> Any:
        """The shard value of the tensor ``node``'s random ops would draw, or Lost."""
        if _is_attention(node):
            return self._attention(node, output=False)
        value = self.values.get(node)
        if isinstance(value, (DTensor, Lost)):
            return value
        return Lost(f"the result of {_describe(node)} is not one shard of a known layout")


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class ShardedCall:
    """A Dynamo graph node's callable, run inside compile_rng's region for the tensor it
    draws (a ``DTensorSpec``), or - for a lost layout - under a guard that refuses its
    random ops. Called while AOTAutograd traces the graph."""

    def __init__(self, node: fx.Node, drawn: Any):
        self.method = node.target if node.op == "call_method" else None
        self.target = None if self.method else node.target
        self.__name__ = f"sharded_{self.method or getattr(node.target, '__name__', 'call')}"
        self.where = _describe(node)
        self.spec = dtensor_spec(drawn) if isinstance(drawn, DTensor) else None
        self.local_shape = tuple(drawn.to_local().shape) if isinstance(drawn, DTensor) else None
        self.lost = drawn if isinstance(drawn, Lost) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(args[0], self.method) if self.method else self.target
        if self.method:
            args = args[1:]
        if self.spec is not None:
            with distribute_region(tracker.TRACKER, self.spec), _DrawsShape(self):
                return fn(*args, **kwargs)
        with RandomOpMode(self._refuse):
            return fn(*args, **kwargs)

    def _refuse(self, func: Any, size: Any, device: Any) -> Any:
        raise NotImplementedError(
            f"compile_rng: {func} in {self.where} draws on a plain tensor that is this rank's piece of a "
            f"sharded DTensor, but its place in the global tensor cannot be recovered: {self.lost.why}. "
            "Drawing it as a replica would give every rank the same values for different pieces. Keep the "
            "tensor a DTensor up to the random op (use_local_output=False in the TP plan, or "
            "DTensor.from_local before it), or draw it before to_local()"
        )

    def __repr__(self) -> str:
        return self.__name__


class _DrawsShape(TorchDispatchMode):
    """Inside a :class:`ShardedCall`'s region: a random op must draw the tensor the region
    lays out (``dropout2d``'s per-channel noise, say, is another tensor: refused)."""

    def __init__(self, call: ShardedCall):
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shape = drawn_shape(func, args, kwargs)
        if shape is not None and tuple(shape) != self.call.local_shape:
            raise NotImplementedError(
                f"compile_rng: {func} in {self.call.where} draws a tensor of local shape {tuple(shape)} on "
                f"this rank's piece of a sharded DTensor, whose layout is known for the shape "
                f"{self.call.local_shape} only. Keep the tensor a DTensor up to the random op "
                "(use_local_output=False in the TP plan, or DTensor.from_local before it)"
            )
        return func(*args, **kwargs)


def rewrite(gm: fx.GraphModule) -> list[Layout | Lost | None]:
    """Make every node of ``gm`` (a Dynamo graph) that computes on shard values a
    :class:`ShardedCall`; returns the layout of each of the graph's outputs (None for a
    replica), for the eager code that receives them. A graph without ``to_local()`` of
    a sharded DTensor is left as it is."""
    return [_output_layout(value) for value in _rewrite(gm, _Analysis())]


def _rewrite(gm: fx.GraphModule, analysis: _Analysis) -> list[Any]:
    """:func:`rewrite` with ``analysis`` holding the shard values ``gm`` starts with (its
    placeholders' in a checkpointed region); returns its outputs' shard values."""
    count = 0
    for node in gm.graph.nodes:
        if _bodies(gm, node):
            count += _region(gm, node, analysis)
            continue
        if node.op not in ("call_function", "call_method") or analysis.start(node):
            continue
        if not analysis.operands(node) or is_from_local(node):
            continue
        value = analysis.values.get(node.args[0]) if node.args else None
        if node.op == "call_function" and node.target is operator.getitem and isinstance(value, (tuple, list, Lost)):
            result = value if isinstance(value, Lost) else value[node.args[1]]
            if isinstance(result, Lost) or is_sharded(result):
                analysis.values[node] = result
            continue
        result = analysis.propagate(node)
        if result is not None:
            analysis.values[node] = result
        drawn = analysis.drawn(node)
        node.target = ShardedCall(node, drawn)
        node.op = "call_function"
        count += 1
    if count:
        gm.recompile()
    return [analysis.values.get(n) for n in tree_leaves(gm.graph.output_node().args)]


def _region(gm: fx.GraphModule, node: fx.Node, analysis: _Analysis) -> bool:
    """Analyse the subgraphs of the higher-order op ``node`` in place, recording what a
    checkpointed region returns as ``node``'s shard value. ``tag_activation_checkpoint(body,
    *operands)`` passes its operands to the body's placeholders in order (Dynamo lifts the
    region's free tensors into them too). Another higher-order op given a shard value is
    made a :class:`ShardedCall` that refuses its random ops; returns whether ``node`` was."""
    checkpointed = higher_order_op_name(node.target) == "tag_activation_checkpoint"
    given = [analysis.values.get(a) if isinstance(a, fx.Node) else None for a in node.args[1:]]
    returned: list[Any] = []
    for body in _bodies(gm, node):
        inner = _Analysis(analysis.fake_mode)
        if checkpointed:
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            inner.values.update((p, v) for p, v in zip(placeholders, given) if v is not None)
        returned = _rewrite(body, inner)
        analysis.fake_mode = analysis.fake_mode or inner.fake_mode
    if not checkpointed and analysis.operands(node):
        lost = Lost(f"{_describe(node)} is given a TP rank's local piece; compile_rng follows pieces into "
                    "checkpointed regions only")
        analysis.values[node] = lost
        node.target, node.op = ShardedCall(node, lost), "call_function"
        return True
    if any(v is not None for v in returned):
        analysis.values[node] = tuple(returned)
    return False


def _bodies(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The subgraphs a higher-order op node runs (``tag_activation_checkpoint``'s body)."""
    if node.op != "call_function" or higher_order_op_name(node.target) is None:
        return []
    return [
        getattr(gm, arg.target) for arg in node.args
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and isinstance(getattr(gm, arg.target, None), fx.GraphModule)
    ]


def _output_layout(value: Any) -> Layout | Lost | None:
    """What eager code learns of a graph output that is ``value`` here."""
    if not isinstance(value, DTensor):
        return value if isinstance(value, Lost) else None
    if not all(isinstance(s, int) for s in (*value.shape, *value.stride())):
        return Lost("a compiled graph returned it with a dynamic global shape")
    return Layout.of(value)
