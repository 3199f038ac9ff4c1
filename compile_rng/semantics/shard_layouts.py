"""Where a plain program's tensors sit in global tensors: DTensor's sharding rules run
over the program's ops.

A tensor-parallel rank's *local* tensor (``to_local()`` of a ``Shard`` DTensor) is a
piece of a global tensor; the plain ops that follow compute pieces of global tensors
too, as long as each does what the DTensor op would do on this rank without moving
data. :func:`propagate` decides that for one op: it runs the op on DTensors (fake or
meta: no data) standing for its shard operands - plain operands as replicas - and
accepts the result's placements when DTensor ran the local op on the operands as they
are and the local shapes are the program's. Otherwise the result is :class:`Lost`: a
rank-dependent piece with no known layout, on which a random op must not draw.

Programs often size views from *local* shapes (``hidden.shape`` read on the rank's
piece, or torch's own decompositions of ``matmul``): where DTensor refuses those literal
sizes, the sizes are read as local and the global sizes that give them are tried
(:func:`_global_sizes`).

Used on Dynamo graphs (:mod:`compile_rng.compiled.local_shards`) and on eager ops
(:mod:`compile_rng.eager.eager_shards`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from compile_rng._torch.core_internals import quiet_fake_tensor_failures, tree_leaves
from compile_rng._torch.dtensor_internals import StridedShard, dtensor_operands_kept
from compile_rng.semantics.local_values import Lost


@dataclass(frozen=True)
class SizeArgument:
    """An op whose sizes the program may have read off local shapes: ``kind`` is
    ``"expand"`` or ``"view"`` (view, reshape), ``sizes`` what the program passed, and
    ``with_sizes(sizes)`` the op's arguments with other sizes."""

    kind: str
    sizes: tuple
    with_sizes: Callable[[list], tuple]


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor with a non-``Replicate`` placement."""
    return isinstance(value, DTensor) and any(not isinstance(p, Replicate) for p in value.placements)


class _Moved(Exception):
    """DTensor would move an operand to run this op: the local op computes something else."""


def _implicit_replication() -> Any:
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def _attempt(run: Callable[..., Any], args: tuple, kwargs: dict, expected: Sequence[Any], what: str) -> Any:
    """The result of ``run(*args, **kwargs)`` on DTensor operands as a layout, or Lost."""
    try:
        with _implicit_replication(), dtensor_operands_kept(_Moved), quiet_fake_tensor_failures():
            result = run(*args, **kwargs)
    except _Moved as e:
        return Lost(f"{what} mixes placements that DTensor would move data for ({e})")
    except Exception as e:  # DTensor's rules refuse the local program: no layout to recover
        first = str(e).splitlines()[0] if str(e) else ""
        return Lost(f"DTensor's sharding rules do not describe {what} ({type(e).__name__}: {first})")
    got = tree_leaves(result)
    if len(got) != len(expected):
        return Lost(f"{what} returns another structure on DTensors")
    for g, e in zip(got, expected):
        if isinstance(g, DTensor) and isinstance(e, torch.Tensor) and tuple(g.to_local().shape) != tuple(e.shape):
            return Lost(
                f"{what}: the local result has shape {tuple(e.shape)}, the DTensor rules give a local shape "
                f"{tuple(g.to_local().shape)}"
            )
    return result


def propagate(
    run: Callable[..., Any], args: tuple, kwargs: dict, expected: Sequence[Any], what: str,
    sizes: SizeArgument | None = None,
) -> Any:
    """The layout of ``run``'s result on this rank: ``args``/``kwargs`` hold a DTensor
    (fake or meta) for each shard operand and the program's values elsewhere;
    ``expected`` are the leaves of the program's own (local) result.

    Returns the DTensor result (a tuple of results for ops that return several), None
    when no result is sharded (a replica), or :class:`Lost` naming ``what`` went wrong.
    """
    result = _attempt(run, args, kwargs, expected, what)
    if isinstance(result, Lost) and sizes is not None:
        tried = [_attempt(run, *sizes.with_sizes(s), expected, what) for s in _global_sizes(sizes, args)]
        found = [r for r in tried if not isinstance(r, Lost)]
        # a view can describe one piece in several ways (a merged (B*H) dim as
        # _StridedShard, or B x H with H sharded): prefer plain Shard placements, which
        # keep the batch in dim 0
        found.sort(key=lambda r: any(isinstance(p, StridedShard) for g in tree_leaves(r) if isinstance(g, DTensor) for p in g.placements))
        result = found[0] if found else result
    if isinstance(result, Lost):
        return result
    return result if any(is_sharded(g) for g in tree_leaves(result)) else None


def _global_sizes(sizes: SizeArgument, args: tuple) -> list[list]:
    """Global sizes that make the op give the local sizes the program passed, where those
    were read off local shapes. ``expand``: the sizes of the operand's sharded dims are
    its local sizes, so they become its global ones. ``view``: one dim of the result
    holds the shard; each dim in turn gets the operand's shard factor."""
    operand = next(a for a in tree_leaves(args) if isinstance(a, DTensor))
    local = tuple(operand.to_local().shape)
    requested = list(sizes.sizes)
    if sizes.kind == "expand":
        lead = len(requested) - operand.ndim
        for dim, (g, loc) in enumerate(zip(operand.shape, local)):
            if g != loc:
                if requested[lead + dim] not in (-1, loc):
                    return []
                requested[lead + dim] = g
        return [requested]
    factor, rest = divmod(math.prod(operand.shape), max(math.prod(local), 1))
    if rest or factor == 1:
        return []
    out = []
    for dim, s in enumerate(requested):
        if s != -1:
            out.append([*requested[:dim], s * factor, *requested[dim + 1 :]])
    return out
