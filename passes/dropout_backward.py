"""Dropout's backward from the stream: the mask is drawn again instead of saved."""

from __future__ import annotations

import operator

import torch
from compile_rng.passes.graph_nodes import call, expr
from compile_rng.passes.sym_emit import SymEmitter
from compile_rng.stream import keep_scale
from torch import fx


def dropout_backward_from_stream(graph: fx.Graph) -> None:
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
    emitter = SymEmitter(graph)
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout_backward.default):
        grad, mask, scale = node.args
        dtype = node.meta["val"].dtype
        s = keep_scale(1.0 / scale, dtype) if scale else 0.0
        source = mask.args[0] if mask.target is operator.getitem else None
        with graph.inserting_before(node):
            if source is not None and source.target is torch.ops.compile_rng.dropout.default:
                key, offset, x, strides, p = source.args
                size = [emitter.emit(expr(d)) for d in node.meta["val"].shape]  # SymInt nodes, not raw SymInts
                keep = call(graph, torch.ops.compile_rng.bernoulli.default, key, offset, size, strides, 1.0 - p, dtype)
            else:
                keep = mask
            kept = call(graph, torch.ops.aten.mul.Tensor, grad, keep)
            new = call(graph, torch.ops.aten.mul.Tensor, kept, s)
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
