"""Counter layouts of DTensor shards (DESIGN.md section 3).

A random op on a DTensor of global shape ``G`` placed on a mesh reserves
``ceil4(numel(G))`` counters on every rank. Which of them a rank's local shard uses is
its *layout*: an offset into the op's range plus per-dim counter strides.

``mode="tracker"`` reproduces ``OffsetBasedRNGTracker``: the shard's elements are a
contiguous run starting at ``ceil4(shard_linear_idx * numel(first_shard))``.

The formulas use only ``+ * //`` (and the placement's own first-shard size), so one
definition evaluates on ints (eager), on SymInts (tracing: coordinates are runtime
values, so one graph serves every rank) and on sympy symbols (reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

from .stream import ceil4

# Placements that split a tensor dim across a mesh dim (_StridedShard is not a Shard).
SHARDS = (Shard, _StridedShard)


@dataclass(frozen=True)
class Sharding:
    """What a random op's layout depends on: global shape, placements, mesh shape."""

    global_shape: tuple
    placements: tuple
    mesh_shape: tuple
    mesh_dim_names: tuple | None = None

    @classmethod
    def from_spec(cls, spec: Any) -> "Sharding":
        mesh = spec.mesh
        return cls(tuple(spec.shape), tuple(spec.placements), tuple(mesh.shape), mesh.mesh_dim_names)

    def check(self, op: object) -> None:
        for p in self.placements:
            if isinstance(p, Partial):
                raise ValueError(
                    f"compile_rng: {op} on a Partial DTensor ({self.placements}) has no defined "
                    "random values (the partial sums are not materialized); redistribute to "
                    "Replicate or Shard first"
                )

    def numel(self) -> Any:
        n = 1
        for s in self.global_shape:
            n = n * s
        return n

    def advance(self) -> Any:
        """Counters the op reserves on every rank."""
        return ceil4(self.numel())

    def _mesh_dims_by_tensor_dim(self) -> list[list[int]]:
        dims: list[list[int]] = [[] for _ in self.global_shape]
        for mesh_dim, p in enumerate(self.placements):
            if isinstance(p, SHARDS):
                dims[p.dim].append(mesh_dim)
        return dims

    def first_shard_shape(self) -> list:
        """Shape of the shard at coordinate 0, as the tracker sizes it: each sharding
        placement chunks the *global* dim (so two mesh dims on one tensor dim keep the
        last placement's chunk, exactly like ``OffsetBasedRNGTracker``)."""
        shape = list(self.global_shape)
        for mesh_dim, p in enumerate(self.placements):
            if isinstance(p, SHARDS):
                shape[p.dim] = _first_chunk(p, self.global_shape[p.dim], self.mesh_shape[mesh_dim])
        return shape

    def shard_linear_index(self, coords: Sequence[Any]) -> Any:
        """Row-major index of this rank's shard among all shards (replicas share it)."""
        linear, stride = 0, 1
        for mesh_dims in reversed(self._mesh_dims_by_tensor_dim()):
            idx, count = 0, 1
            for md in mesh_dims:
                idx = idx * self.mesh_shape[md] + coords[md]
                count = count * self.mesh_shape[md]
            linear = linear + idx * stride
            stride = stride * count
        return linear

    def tracker_start(self, coords: Sequence[Any]) -> Any:
        """Offset of this rank's first element in tracker mode."""
        first = 1
        for s in self.first_shard_shape():
            first = first * s
        return ceil4(self.shard_linear_index(coords) * first)


def _min(a: Any, b: Any) -> Any:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return torch.sym_min(a, b)
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Min(a, b)
    return min(a, b)


def _first_chunk(p: Any, size: Any, n: int) -> Any:
    """Size of coordinate 0's piece of a dim of ``size`` split ``n`` ways by ``p``.

    ``Shard`` chunks like ``torch.chunk``; ``_StridedShard(sf)`` first splits the dim
    into ``sf`` pieces and gives each rank its chunk of every piece (the FSDP2 + TP
    layout), so rank 0 holds the first chunk of each piece.
    """
    if isinstance(p, Shard):
        return _min((size + n - 1) // n, size)
    sf = p.split_factor
    piece = (size + sf - 1) // sf
    total = 0
    for k in range(sf):
        length = _min(piece * (k + 1), size) - _min(piece * k, size)
        total = total + _min((length + n - 1) // n, length)
    return total


def contiguous_strides(shape: Sequence[Any]) -> list:
    strides, acc = [], 1
    for s in reversed(list(shape)):
        strides.append(acc)
        acc = acc * s
    return strides[::-1]
