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

from torch.distributed.tensor.placement_types import Partial, Shard

from .stream import ceil4


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
            if isinstance(p, Shard):  # _StridedShard is a Shard subclass
                dims[p.dim].append(mesh_dim)
        return dims

    def first_shard_shape(self) -> list:
        shape = list(self.global_shape)
        for mesh_dim, p in enumerate(self.placements):
            if isinstance(p, Shard):
                shape[p.dim], _ = p._local_shard_size_and_offset(
                    self.global_shape[p.dim], self.mesh_shape[mesh_dim], 0
                )
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


def contiguous_strides(shape: Sequence[Any]) -> list:
    strides, acc = [], 1
    for s in reversed(list(shape)):
        strides.append(acc)
        acc = acc * s
    return strides[::-1]
