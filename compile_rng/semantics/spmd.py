"""Counter layouts of DTensor shards (docs/contract.md §3.2-§3.3).

A random op on a DTensor of global shape ``G`` placed on a mesh reserves
``ceil4(numel(G))`` counters on every rank. Which of them a rank's local shard uses is
its *layout*: an offset into the op's range plus per-dim counter strides.

``layout="tracker"`` reproduces ``OffsetBasedRNGTracker``: the shard's elements are a
contiguous run starting at ``ceil4(shard_linear_idx * numel(first_shard))``.

``layout="invariant"``: every element's counter is its row-major index in the *global*
tensor, so the assembled tensor is the same for every mesh, placement and world size
(a plain tensor is the world-size-1 case). The local shard is then an affine window of
the global index space: ``offset + sum(idx[d] * strides[d])`` - or, for an uneven
``_StridedShard`` (FSDP2 x TP on a dim the mesh does not divide), a concatenation along
one dim of such windows (:class:`~compile_rng.semantics.pieces.Pieces`).

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
from torch.distributed.tensor.placement_types import Partial, Shard

from compile_rng._torch.dtensor_internals import StridedShard, split_factor
from compile_rng.semantics.pieces import Pieces
from compile_rng.stream import ceil4, contiguous_strides

# Placements that split a tensor dim across a mesh dim (_StridedShard is not a Shard).
SHARDS = (Shard, StridedShard)


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

    def shards_dim(self, dim: int) -> bool:
        """Whether some mesh dim shards tensor dim ``dim``."""
        return bool(self._mesh_dims_by_tensor_dim()[dim])

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

    def unsupported(self, why: str) -> NotImplementedError:
        """The error for an invariant layout these placements leave undefined here."""
        return NotImplementedError(
            f"compile_rng layout='invariant': placements {self.placements} on global shape "
            f"{self.global_shape} leave {why}; use the tracker layout for this tensor or a shape "
            "that the mesh divides evenly"
        )

    def layout(self, layout_name: str, coords: Sequence[Any], local_shape: Sequence[Any]) -> tuple[Any, list] | Pieces:
        """``(offset, strides)`` of the local shard's counters within the op's range
        (:class:`Pieces` where the invariant layout is affine only piecewise)."""
        if layout_name == "tracker":
            return self.tracker_start(coords), contiguous_strides(local_shape)
        return self.invariant_window(coords)

    def invariant_window(self, coords: Sequence[Any]) -> tuple[Any, list] | Pieces:
        """The local shard's global row-major indices as ``(offset, strides)``, or as
        :class:`Pieces` along the one tensor dim whose local indices are not one run.

        Applies the placements left to right like DTensor does: each tensor dim keeps
        its local indices as an affine view ``off + sum(m_t * s_t)`` over factors
        ``(n_t, s_t)``; ``Shard`` takes a ``torch.chunk`` piece of it, ``_StridedShard``
        splits it into ``split_factor`` pieces and takes this rank's chunk of each.
        Splits that leave no such view (uneven ``_StridedShard`` pieces) continue on the
        dim's list of runs (:class:`_Runs`).
        """
        views: list[_DimView | _Runs] = [_DimView(0, [(size, 1)]) for size in self.global_shape]
        for mesh_dim, p in enumerate(self.placements):
            if isinstance(p, SHARDS):
                views[p.dim] = views[p.dim].split(p, self.mesh_shape[mesh_dim], coords[mesh_dim], self)
        global_strides = contiguous_strides(self.global_shape)
        offset, strides, runs_dim = 0, [], None
        for dim, (view, gs) in enumerate(zip(views, global_strides)):
            window = view.window()
            if window is None:
                if runs_dim is not None:
                    raise self.unsupported("local indices that are not one run in two tensor dims")
                runs_dim, window = dim, (0, 1)  # the runs carry this dim's offsets and strides
            offset = offset + window[0] * gs
            strides.append(window[1] * gs)
        if runs_dim is None:
            return offset, strides
        gs = global_strides[runs_dim]
        pieces, start = [], 0
        for off, length, stride in views[runs_dim].to_runs(self).runs:
            piece_strides = list(strides)
            piece_strides[runs_dim] = stride * gs
            pieces.append((start, length, offset + off * gs, piece_strides))
            start = start + length
        return Pieces(runs_dim, tuple(pieces))

    def tracker_start(self, coords: Sequence[Any]) -> Any:
        """Offset of this rank's first element in the tracker layout."""
        first = 1
        for s in self.first_shard_shape():
            first = first * s
        return ceil4(self.shard_linear_index(coords) * first)


@dataclass
class _DimView:
    """Global indices of one tensor dim's local elements: ``off + sum(m_t * s_t)``,
    ``m`` running row-major over ``factors = [(n_t, s_t), ...]``."""

    off: Any
    factors: list

    def split(self, p: Any, n: int, r: Any, sharding: "Sharding") -> "_DimView | _Runs":
        """This rank's part under placement ``p`` over ``n`` ranks (coordinate ``r``)."""
        if isinstance(p, StridedShard):
            if len(self.factors) == 1:
                (size, stride), sf = self.factors[0], split_factor(p)
                if _static(size) and size % sf == 0 and (size // sf) % n == 0:
                    piece, chunk = size // sf, size // sf // n
                    return _DimView(self.off + r * chunk * stride, [(sf, piece * stride), (chunk, stride)])
            return self.to_runs(sharding).split(p, n, r, sharding)
        if len(self.factors) == 1:  # torch.chunk of a contiguous run: still contiguous
            (size, stride), = self.factors
            start, length = _chunk(size, n, r)
            return _DimView(self.off + start * stride, [(length, stride)])
        (outer, s_outer), (inner, s_inner) = self.factors
        total = outer * inner
        if not (_static(total) and total % n == 0):
            return self.to_runs(sharding).split(p, n, r, sharding)
        length = total // n
        start = r * length
        if length % inner == 0:  # whole inner runs
            return _DimView(self.off + start // inner * s_outer, [(length // inner, s_outer), (inner, s_inner)])
        if inner % length == 0:  # a piece of one inner run
            return _DimView(self.off + start // inner * s_outer + start % inner * s_inner, [(length, s_inner)])
        return self.to_runs(sharding).split(p, n, r, sharding)

    def window(self) -> tuple[Any, Any] | None:
        """``(off, stride)`` of a local index step if the view is one run, else None."""
        runs = [(n, s) for n, s in self.factors if not (_static(n) and n == 1)]
        if len(runs) > 1:
            return None
        return self.off, runs[0][1] if runs else 1

    def to_runs(self, sharding: "Sharding") -> "_Runs":
        """The same indices as runs: one per index of the outer factor."""
        if len(self.factors) == 1:
            (size, stride), = self.factors
            return _Runs([(self.off, size, stride)])
        (outer, s_outer), (inner, s_inner) = self.factors
        if not _static(outer):
            raise sharding.unsupported("a strided dim with a symbolic number of runs")
        return _Runs([(self.off + m * s_outer, inner, s_inner) for m in range(outer)])


@dataclass
class _Runs:
    """Global indices of one tensor dim's local elements as consecutive runs
    ``(off, length, stride)`` (elements ``off + j * stride``, ``j < length``); the local
    order is the runs' concatenation. Runs of static length 0 are dropped, so eager
    (int) coordinates keep only the runs a rank holds."""

    runs: list

    def split(self, p: Any, n: int, r: Any, sharding: "Sharding") -> "_Runs":
        """This rank's part under placement ``p`` over ``n`` ranks (coordinate ``r``):
        DTensor's ``torch.chunk`` of the local positions; ``_StridedShard`` first chunks
        them into ``split_factor`` pieces and takes this rank's chunk of each."""
        total = 0
        for _, length, _ in self.runs:
            total = total + length
        if not isinstance(p, StridedShard):
            return _Runs(self._select(*_chunk(total, n, r)))
        runs = []
        for k in range(split_factor(p)):
            start, length = _chunk(total, split_factor(p), k)
            sub_start, sub_length = _chunk(length, n, r)
            runs.extend(self._select(start + sub_start, sub_length))
        return _Runs(runs)

    def _select(self, lo: Any, length: Any) -> list:
        """The runs' parts at local positions ``[lo, lo + length)``."""
        parts, pos = [], 0
        for off, size, stride in self.runs:
            a = _min(_max(lo - pos, 0), size)
            b = _min(_max(lo + length - pos, 0), size)
            part = _max(b - a, 0)
            if not (_static(part) and part == 0):
                parts.append((off + a * stride, part, stride))
            pos = pos + size
        return parts

    def window(self) -> tuple[Any, Any] | None:
        """``(off, stride)`` if at most one run is left (an empty dim's is arbitrary)."""
        if not self.runs:
            return 0, 1
        if len(self.runs) == 1:
            off, _, stride = self.runs[0]
            return off, stride
        return None

    def to_runs(self, sharding: "Sharding") -> "_Runs":
        return self


def _static(v: Any) -> bool:
    return isinstance(v, int)


def _extremum(a: Any, b: Any, symint_fn: Any, sympy_fn: Any, int_fn: Any) -> Any:
    """min/max for ints, SymInts (traced without guards) and sympy expressions."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return symint_fn(a, b)
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy_fn(a, b)
    return int_fn(a, b)


def _min(a: Any, b: Any) -> Any:
    return _extremum(a, b, torch.sym_min, sympy.Min, min)


def _max(a: Any, b: Any) -> Any:
    return _extremum(a, b, torch.sym_max, sympy.Max, max)


def _chunk(size: Any, n: int, k: Any) -> tuple[Any, Any]:
    """``(start, length)`` of piece ``k`` of ``torch.chunk`` of ``size`` elements into
    ``n`` (pieces past the end are empty, as DTensor fills them)."""
    chunk = (size + n - 1) // n
    start = _min(k * chunk, size)
    return start, _max(_min(chunk, size - start), 0)


def _first_chunk(p: Any, size: Any, n: int) -> Any:
    """Size of coordinate 0's piece of a dim of ``size`` split ``n`` ways by ``p``.

    ``Shard`` chunks like ``torch.chunk``; ``_StridedShard(sf)`` first splits the dim
    into ``sf`` pieces and gives each rank its chunk of every piece (the FSDP2 + TP
    layout), so rank 0 holds the first chunk of each piece.
    """
    if isinstance(p, Shard):
        return _min((size + n - 1) // n, size)
    sf = split_factor(p)
    piece = (size + sf - 1) // sf
    total = 0
    for k in range(sf):
        length = _min(piece * (k + 1), size) - _min(piece * k, size)
        total = total + _min((length + n - 1) // n, length)
    return total
