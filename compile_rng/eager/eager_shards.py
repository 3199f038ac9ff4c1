"""Eager ops on a tensor-parallel rank's plain local tensors: their layouts, and random
ops drawn at the DTensor op's counters.

Inside compile_rng's eager stream, :mod:`compile_rng.semantics.local_values` records the
``to_local()`` of sharded DTensors. Each eager aten op with a recorded operand comes
here (from :class:`compile_rng.eager.dispatch_modes.RandomOpMode`):

* a random op draws the tensor it fills - laid out like its recorded operand of that
  shape - inside the DTensor tracker's region for that layout: distinct per-shard
  counters in tracker layout, the single device's in invariant layout, the step's rows
  inside ``compile_rng.step``; on a :class:`Lost` operand it raises, naming the op and
  the fix;
* any other op runs as it is, and its results' layouts come from DTensor's own rules
  run on meta DTensors (:func:`compile_rng.semantics.shard_layouts.propagate`: no data, no copy).

Example (Llama's attention eagerly under ``ColwiseParallel()``, 2 ranks): ``q_proj``'s
``to_local()`` (2, 16, 16) is ``Shard(2)`` of (2, 16, 32); ``view`` and ``transpose``
make it ``Shard(1)`` of (2, 4, 16, 8); SDPA's math path (torch's decomposition) views
it as ``_StridedShard(0)`` of (8, 16, 8) for ``bmm`` and back (its local sizes read as
global ones where DTensor refuses them), and its dropout's ``bernoulli_`` fills
``Shard(1)`` of the (2, 4, 16, 16) attention matrix - the compiled graph's counters.

This costs a DTensor dispatch on meta tensors per op on a recorded tensor (the
tensor-parallel part of an eager model); nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from compile_rng._torch.core_internals import tree_leaves, tree_map
from compile_rng._torch.dtensor_internals import distribute_region, dtensor_spec
from compile_rng.eager import tracker
from compile_rng.eager.dispatch_modes import drawn_shape, register_local_piece_dispatch
from compile_rng.eager.user_code import user_line
from compile_rng.semantics.local_values import Layout, Lost, lookup, record
from compile_rng.semantics.random_ops import INPLACE
from compile_rng.semantics.shard_layouts import SizeArgument, is_sharded, propagate

aten = torch.ops.aten
_SIZE_OPS = {
    aten.view.default: "view", aten._unsafe_view.default: "view", aten.reshape.default: "view",
    aten.expand.default: "expand",
}


def _meta(tensor: torch.Tensor, layout: Layout | None) -> Any:
    """``tensor``'s metadata on the meta device: a DTensor with ``layout``, or a plain
    tensor (a replica) for None."""
    local = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if layout is None:
        return local
    with torch.no_grad():
        return DTensor.from_local(
            local, layout.mesh, layout.placements, run_check=False, shape=torch.Size(layout.shape), stride=layout.stride
        )


def _as_meta(value: Any) -> Any:
    return _meta(value, lookup(value)) if isinstance(value, torch.Tensor) else value


def _size_argument(func: Any, args: tuple, kwargs: dict) -> SizeArgument | None:
    kind = _SIZE_OPS.get(func)
    if kind is None or len(args) < 2:
        return None
    return SizeArgument(kind, tuple(args[1]), lambda sizes: ((args[0], list(sizes), *args[2:]), kwargs))


def _refusal(func: Any, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"compile_rng: {func} at {user_line()} draws on a plain tensor that is this rank's piece of a sharded DTensor, but "
        f"its place in the global tensor cannot be recovered: {why}. Drawing it as a replica would give "
        "every rank the same values for different pieces. Keep the tensor a DTensor up to the random op "
        "(use_local_output=False in the TP plan, or DTensor.from_local before it), or compile the code "
        "(compile_rng's graphs follow torch functions before they are decomposed)"
    )


def _draw(func: Any, args: tuple, kwargs: dict) -> Any:
    """A random op with a recorded operand, drawn in the tracker's region of its layout."""
    shape = tuple(drawn_shape(func, args, kwargs))
    target = args[0] if INPLACE.get(func, func) is not func else None
    candidates = [target] if target is not None else [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    values = [lookup(t) for t in candidates if tuple(t.shape) == shape]
    lost = [v for v in map(lookup, tree_leaves((args, kwargs))) if isinstance(v, Lost)]
    if lost:
        raise _refusal(func, lost[0].why)
    layout = next((v for v in values if v is not None), None)
    if layout is None:
        raise _refusal(func, f"no operand of the drawn shape {shape} has a known layout")
    drawn = _meta(torch.empty(shape, device="meta"), layout)
    with distribute_region(tracker.TRACKER, dtensor_spec(drawn)):
        out = func(*args, **kwargs)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and tuple(t.shape) == shape:
            record(t, layout)
    return out


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run eager aten op ``func``, which has an operand with a recorded layout."""
    if drawn_shape(func, args, kwargs) is not None:
        return _draw(func, args, kwargs)
    out = func(*args, **kwargs)
    leaves = tree_leaves(out)
    lost = [v for v in map(lookup, tree_leaves((args, kwargs))) if isinstance(v, Lost)]
    if lost:
        result = lost[0]
    else:
        operands = tree_map(_as_meta, (args, kwargs))
        result = propagate(func, *operands, leaves, f"{func} at {user_line()}", _size_argument(func, *operands))
    values = tree_leaves(result) if not isinstance(result, (Lost, type(None))) else [result] * len(leaves)
    for t, value in zip(leaves, values):
        record(t, Layout.of(value) if is_sharded(value) else (value if isinstance(value, Lost) else None))
    return out


register_local_piece_dispatch(dispatch)
