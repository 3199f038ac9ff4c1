"""The rows of a step's global batch that the code running here processes.

A leaf: the step (:mod:`compile_rng.eager.batches`) sets them; batched graphs
(:mod:`compile_rng.compiled.backend`), eager plain-tensor random ops
(:mod:`compile_rng.eager.dispatch_modes`) and eager DTensor random ops
(:mod:`compile_rng.eager.tracker`) read them, so all three draw the same counters.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compile_rng.stream import ceil4, contiguous_strides


@dataclass(frozen=True)
class Rows:
    """This call's rows of the step's global batch of ``total`` rows: local row ``i`` is
    global row ``start + i * stride`` (``stride`` 1: a contiguous block, rank-major; the data-
    parallel size: interleaved, as ``DistributedSampler`` and ``split_dataset_by_node`` deal them)."""

    start: int
    count: int
    total: int
    stride: int = 1

    def sub(self, first: int, count: int) -> Rows:
        """Local rows ``[first, first + count)`` of these (a microbatch)."""
        return Rows(self.start + first * self.stride, count, self.total, self.stride)


@dataclass(frozen=True)
class ScatteredRows:
    """A rank's rows of a step that are not evenly spaced in the global batch, as
    ``accelerate``'s loader deals them under gradient accumulation (microbatch ``m`` of rank
    ``r`` is block ``m * world + r``). Only a microbatch of them (:meth:`sub`) can draw:
    the counters of an op need evenly spaced rows, so ``start``/``stride`` refuse."""

    positions: tuple[int, ...]
    total: int

    @property
    def count(self) -> int:
        return len(self.positions)

    def sub(self, first: int, count: int) -> Rows | ScatteredRows:
        """Local rows ``[first, first + count)`` of these (a microbatch)."""
        return rows_at(self.positions[first:first + count], self.total)

    def _refuse(self) -> int:
        raise NotImplementedError(
            f"compile_rng: a random op draws at this rank's rows of the step, which sit at global positions "
            f"{list(self.positions[:8])}{'...' if self.count > 8 else ''} of {self.total}: not evenly spaced. "
            "Run the model in Step.microbatch, one microbatch per evenly spaced block of rows (a data "
            "loader's batch), so each draws at its own rows"
        )

    start = property(_refuse)
    stride = property(_refuse)


def rows_at(positions: Sequence[int], total: int) -> Rows | ScatteredRows:
    """The rows at global ``positions`` (in the order this rank holds them) of a batch of ``total``."""
    positions = tuple(int(p) for p in positions)
    stride = positions[1] - positions[0] if len(positions) > 1 else 1
    if stride > 0 and all(b - a == stride for a, b in zip(positions, positions[1:])):
        return Rows(positions[0] if positions else 0, len(positions), total, stride)
    return ScatteredRows(positions, total)


_rows: contextvars.ContextVar[Rows | ScatteredRows | None] = contextvars.ContextVar("compile_rng_rows", default=None)


def current_rows() -> Rows | ScatteredRows | None:
    """The rows the innermost step or microbatch assigns to the code here (None outside a step)."""
    return _rows.get()


def current_row_stride() -> int:
    """The spacing in the global batch of the rows the innermost step or microbatch assigns
    here: 1 outside a step, and where they are not evenly spaced (those cannot draw)."""
    rows = _rows.get()
    return rows.stride if isinstance(rows, Rows) else 1


#: set inside a microbatch that holds fewer rows than its step's local batch: its
#: backward runs the hooks that one call on the whole batch runs once
_split: contextvars.ContextVar[bool] = contextvars.ContextVar("compile_rng_split", default=False)


def set_rows(rows: Rows | ScatteredRows | None, split: bool = False) -> tuple[contextvars.Token, contextvars.Token]:
    """Make ``rows`` current, ``split``: a microbatch of fewer rows than its step's (undo
    with :func:`reset_rows`)."""
    return _rows.set(rows), _split.set(split)


def reset_rows(token: tuple[contextvars.Token, contextvars.Token]) -> None:
    _rows.reset(token[0])
    _split.reset(token[1])


def in_split_microbatch() -> bool:
    """Whether the code here runs in one of several microbatches of a step's local batch."""
    return _split.get()


_batch_dim: contextvars.ContextVar[int] = contextvars.ContextVar("compile_rng_batch_dim", default=0)


def step_batch_dim() -> int:
    """The dim of a random op's tensor the innermost step declares its batch (0 unless
    ``compile_rng.step(..., batch_dim=)`` says otherwise)."""
    return _batch_dim.get()


def set_step_batch_dim(dim: int) -> contextvars.Token:
    """Declare ``dim`` the batch dim of the step's random ops (undo with :func:`reset_step_batch_dim`)."""
    return _batch_dim.set(dim)


def reset_step_batch_dim(token: contextvars.Token) -> None:
    _batch_dim.reset(token)


def batch_counter_strides(shape: Sequence[Any], dim: int, row_stride: Any = 1) -> list:
    """Counter strides of a step's random op on a tensor of ``shape`` whose batch is dim
    ``dim`` (ints or sympy/SymInt sizes): the batch outermost - a batch row's elements take
    consecutive counters, the other dims row-major in their own order - so a sample draws
    the same counters whichever dim of the tensor holds the batch (a sequence-major
    ``(seq, batch, d)`` activation draws what its batch-first ``(batch, seq, d)``
    transpose would). ``row_stride``: global rows between two local ones."""
    others = [*shape[:dim], *shape[dim + 1:]]
    inner = contiguous_strides(others)
    inner.insert(dim, math.prod(others) * row_stride)
    return inner


@dataclass(frozen=True)
class BatchDim:
    """Which dim of a step's random op's tensor holds the batch: ``dim``; ``heads`` entries
    along it per batch row (``nn.MultiheadAttention`` merges ``(batch, heads)`` into one dim,
    batch-major); ``why``: the module whose checked layout says so, for messages - empty
    where the step declares it (``compile_rng.step(batch_dim=)``, default 0)."""

    dim: int = 0
    why: str = ""
    heads: int = 1


#: the default: dim 0, as the step declares unless told otherwise
BATCH_MAJOR = BatchDim()


def batch_window(
    op: object, global_shape: Sequence[Any], rows: Rows, batch_split_by: object = None, batch: BatchDim = BATCH_MAJOR,
) -> tuple[int, int, list[int]]:
    """``(offset, advance, counter strides)`` of an eager random op inside a step whose
    tensor (its DTensor-global shape ``global_shape``) holds the batch along ``batch.dim``:
    its rows are ``rows`` of the global batch, so element ``idx`` draws the counter of the
    element at ``idx[dim] -> rows.start + idx[dim] * rows.stride`` of the global tensor
    (``global_shape`` with ``rows.total`` along ``dim``; ``batch.heads`` entries a row),
    the batch outermost (:func:`batch_counter_strides`), from a range of ``ceil4`` of its
    numel - what a batched graph's op draws (:mod:`compile_rng.passes.functionalize_rng`).
    ``batch_split_by``: the placements of a DTensor whose batch dim is split over ranks
    (interleaved rows are refused: a rank's part of them is not evenly spaced in the
    global batch). A dim the step declares (not a module's checked layout) other than 0
    is refused on a tensor of 4 dims or more whose dim 0 has the batch's size too: that is
    the layout of ``scaled_dot_product_attention``'s dropout, ``(batch, heads, L, S)`` in any
    model, which the step's declaration cannot tell from ``(seq, batch, ...)``."""
    dim, heads = batch.dim, batch.heads
    if len(global_shape) <= dim or int(global_shape[dim]) != rows.count * heads:
        said = batch.why or ("the step's batch_dim" if dim else "the step's default")
        per_row = f" ({heads} entries a row: {batch.why})" if heads != 1 else ""
        raise NotImplementedError(
            f"compile_rng: {op} on a tensor of shape {tuple(global_shape)} inside compile_rng.step (or under a "
            f"torch RNG state taken in one and set back, which replays its draws), whose "
            f"batch here has {rows.count} rows{per_row}: every random op in a step draws at its rows of the "
            f"global batch, so dim {dim} must be the batch ({said}). Draw other randomness (data sampling, "
            "noise of another shape) outside the step block, transpose the tensor so the batch is that dim, "
            "or declare the step's batch dim: compile_rng.step(..., batch_dim=1) for sequence-major code"
        )
    if not batch.why and dim != 0 and len(global_shape) >= 4 and int(global_shape[0]) == rows.count:
        raise NotImplementedError(
            f"compile_rng: {op} on a tensor of shape {tuple(global_shape)} inside compile_rng.step(batch_dim={dim}), "
            f"whose batch here has {rows.count} rows: dims 0 and {dim} both have the batch's size, so "
            "compile_rng cannot tell whether this op is sequence-major as the step declares or batch-major "
            "(scaled_dot_product_attention's dropout runs on (batch, heads, L, S) in any model). Run the "
            "attention through nn.MultiheadAttention (whose layout compile_rng reads), or the model batch-first "
            "(batch_dim=0)"
        )
    full = list(map(int, global_shape))
    full[dim] = rows.total * heads
    strides = batch_counter_strides(full, dim)
    offset = rows.start * heads * strides[dim]
    if rows.stride != 1:
        if heads != 1:
            raise NotImplementedError(
                f"compile_rng: {op} on a tensor of shape {tuple(global_shape)} ({batch.why}) in a step whose "
                "rows are interleaved: a batch row's heads are not evenly spaced in the global tensor. Pass "
                "need_weights=False to nn.MultiheadAttention (its dropout then runs on (batch, heads, L, S)), "
                "or give the step contiguous rows"
            )
        strides[dim] *= rows.stride
    if batch_split_by is not None and rows.stride != 1:
        raise NotImplementedError(
            f"compile_rng: {op} on a DTensor sharded on its batch dim ({batch_split_by}) in a "
            "step whose rows are interleaved: its rows are not evenly spaced in the global batch. "
            "Give this step contiguous rows (rows='contiguous'), or keep dim 0 of the activation unsharded"
        )
    return offset, ceil4(math.prod(full)), strides
