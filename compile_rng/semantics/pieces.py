"""The pieces of a shard: the counter layout of a local shard that is affine only
piecewise (an uneven ``_StridedShard``), which :mod:`compile_rng.semantics.spmd` computes
and the eager and compiled draws both take. Imports no DTensor: plain-tensor code
(:mod:`compile_rng.eager.dispatch_modes`) pays no DTensor import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pieces:
    """A local shard whose counters are affine only piecewise along ``dim`` (an uneven
    ``_StridedShard``, :mod:`compile_rng.semantics.spmd`): ``pieces`` are ``(start, length,
    offset, strides)``, in order, tiling ``dim``; element ``idx`` of the local slice
    ``[start, start + length)`` of ``dim`` has counter ``offset + sum(idx * strides)``."""

    dim: int
    pieces: tuple

    def shifted(self, delta: int) -> Pieces:
        """The same pieces ``delta`` counters further on."""
        return Pieces(self.dim, tuple((s, n, offset + delta, strides) for s, n, offset, strides in self.pieces))
