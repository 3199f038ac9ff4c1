"""Where an eager draw's counters lie: the rows it takes, the batch dim, its window, its position.

A random op in an eager stream draws at counters that depend only on where it runs: the
step's rows of the global batch (:func:`draw_rows`), the batch dim torch's module or the
step says (:func:`read_stack`: one walk of the Python stack, which also refuses draws
under torch's generator replays), the window those rows take of the global tensor
(:func:`window`) and the stream's position (reserved, or the op's name's). Both the general
path (:mod:`compile_rng.eager.dispatch_modes`, the tracker) and the short path of the
common draws (:mod:`compile_rng.eager.short_draws`) take their counters here, so the two
cannot disagree. :func:`recorded_counters` logs every eager draw's counters
(``trunc_normal_``'s redraws read them).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_rng import ops as cr_ops
from compile_rng._torch.core_internals import OpOverload, checkpoint_recompute_codes, in_backward, rng_state_replay_codes
from compile_rng.eager import batch_dims, recomputation
from compile_rng.eager.user_code import stack_frames
from compile_rng.semantics.random_ops import DRAWN_WHOLE
from compile_rng.semantics.named_draws import draw_position
from compile_rng.semantics.rows import (
    BATCH_MAJOR,
    BatchDim,
    Rows,
    ScatteredRows,
    batch_window,
    current_rows,
    in_split_microbatch,
    step_batch_dim,
)
from compile_rng.stream import ceil4, contiguous_stream, contiguous_strides

aten = torch.ops.aten


@dataclass(frozen=True)
class Counters:
    """The counters an eager random op drew: element ``idx`` of its ``size``-shaped local
    result has counter ``key base + offset + sum(idx * strides)`` under ``key``'s seed."""

    key: torch.Tensor
    offset: int
    strides: tuple[int, ...]
    size: tuple[int, ...]


_counter_log: contextvars.ContextVar[list[Counters] | None] = contextvars.ContextVar("compile_rng_counter_log", default=None)


@contextlib.contextmanager
def recorded_counters() -> Iterator[list[Counters]]:
    """Collects the :class:`Counters` of every eager random op run inside the block."""
    log: list[Counters] = []
    token = _counter_log.set(log)
    try:
        yield log
    finally:
        _counter_log.reset(token)


def recording() -> bool:
    """Whether a :func:`recorded_counters` block is collecting here."""
    return _counter_log.get() is not None


def record(counters: Counters) -> None:
    """Add an eager draw's counters to the :func:`recorded_counters` block's log, if any."""
    log = _counter_log.get()
    if log is not None:
        log.append(counters)


def replay_error(op: Any) -> NotImplementedError:
    return NotImplementedError(
        f"compile_rng: {op} draws inside run_with_rng_state: a graph compiled by another backend "
        "(stock Inductor) checkpoints a random op and replays torch's generator for it. Compile the "
        "region with compile_rng.backend(...), whose graphs draw from the stream in both passes"
    )


def window(
    op: object, global_shape: Sequence[Any], advance: int, rows: Rows | ScatteredRows | None,
    batch_split_by: object = None, batch: BatchDim = BATCH_MAJOR,
) -> tuple[int, int, list[int] | None]:
    """``(advance, offset, counter strides)`` of an eager random op whose tensor has global
    shape ``global_shape``: outside a step (``rows`` None) it draws ``advance`` counters
    from offset 0 (strides None: the layout's own); inside one, at its ``rows`` of the
    batch along ``batch`` (:func:`~compile_rng.semantics.rows.batch_window`). Reserves
    nothing."""
    if rows is None:
        return advance, 0, None
    offset, advance, strides = batch_window(op, global_shape, rows, batch_split_by, batch)
    return advance, offset, strides


def eager_key(
    op: object, global_shape: Sequence[Any], advance: int, device: torch.device,
    rows: Rows | ScatteredRows | None, batch_split_by: object = None, batch: BatchDim = BATCH_MAJOR,
) -> tuple[torch.Tensor, int, list[int] | None]:
    """``(key, offset, counter strides)`` of the :func:`window`; the key's position comes
    from the op's name in a step with names, else is reserved from the device's state."""
    advance, offset, strides = window(op, global_shape, advance, rows, batch_split_by, batch)
    seed, base = draw_position(op, advance, device)
    return cr_ops.make_key(seed, base, device), offset, strides


def draw_rows() -> Rows | ScatteredRows | None:
    """The rows of the step's global batch a draw here takes: the step's (or microbatch's),
    but none in a backward pass that is not a recomputation of a forward. A gradient is
    not a batch of rows: a gradient hook's noise, a communication hook's projections are
    drawn as replicas, at the stream's position, the same on every rank."""
    rows = current_rows()
    if rows is not None and in_backward() and not recomputation.recomputing():
        _refuse_a_recomputation_without_state()
        if in_split_microbatch():
            raise NotImplementedError(
                "compile_rng: a random op drawn in backward (a gradient hook's noise, a backward hook, a custom "
                "autograd.Function's backward; not a checkpoint's recomputation) inside one of several "
                "microbatches of a compile_rng.step: every microbatch's backward draws it, where one call on the "
                "step's whole batch draws it once, so the step would give other values and end elsewhere than "
                "the one process's. Draw it once per step, after the microbatches (gradient noise in the "
                "optimizer step), or run the step's batch as one microbatch"
            )
        return None
    return rows


def _refuse_a_recomputation_without_state() -> None:
    """A checkpoint recomputing a forward with ``preserve_rng_state=False`` has no saved
    state to replay the forward's draws from: drawn as a backward's replica, its masks
    would differ from the forward's, be the same for every microbatch and rank, and differ
    from a compiled graph's (which replays the forward's); refused."""
    global _recompute_codes
    if _recompute_codes is None:
        _recompute_codes = frozenset(map(id, checkpoint_recompute_codes()))
    for frame in stack_frames():
        if id(frame.f_code) in _recompute_codes:
            raise NotImplementedError(
                "compile_rng: a random op in a step recomputed by torch.utils.checkpoint with "
                "preserve_rng_state=False: with no saved state the recomputation cannot draw what the forward "
                "drew (compiled, it does). Checkpoint with preserve_rng_state=True (the default) around random "
                "ops in a step, or move the random op out of the checkpointed region"
            )


#: ``id`` of the code objects of torch's checkpoint recomputation (read once, on the first
#: backward draw in a step)
_recompute_codes: frozenset[int] | None = None


def plain_window(func: OpOverload, size: Sequence[int]) -> tuple[int, int, Sequence[int]]:
    """``(advance, offset, counter strides)`` of a draw of ``func`` on a plain tensor of
    ``size`` here: a replica on a one-rank mesh; inside a step, rows of the batch, along
    the dim torch's module or the step says. Reserves nothing."""
    rows = None if func in DRAWN_WHOLE else draw_rows()
    return _plain_window(func, size, rows, read_stack(func, size, rows is not None))


def contiguous_window(
    func: OpOverload, size: Sequence[int], walked: bool = False,
) -> tuple[int, int, Sequence[int]] | None:
    """:func:`plain_window` where element ``i`` (row-major) takes counter ``offset + i``,
    else None. ``walked``: the caller found none of the
    :func:`watched_codes` on the stack (the window then depends only on the rows, the
    step's batch dim and the size: remembered). Reserves nothing."""
    if not walked:
        window = plain_window(func, size)
        return window if contiguous_stream(size, window[2]) else None
    rows = None if func in DRAWN_WHOLE else draw_rows()
    key = (tuple(size), id(rows), step_batch_dim() if rows is not None else 0)
    known = _walked_windows.get(key)
    if known is not None:
        return known[1]
    if len(_walked_windows) >= 256:
        _walked_windows.clear()
    advance, offset, strides = _plain_window(func, size, rows, _declared(rows is not None))
    found = (advance, offset, tuple(strides)) if contiguous_stream(size, strides) else None
    _walked_windows[key] = (rows, found)
    return found


#: ``(size, id(rows), batch dim)`` -> ``(rows, contiguous window or None)`` of walked
#: draws: the entry keeps the rows alive, so no other rows can take their id while it lives
_walked_windows: dict[tuple, tuple] = {}


def _plain_window(
    func: OpOverload, size: Sequence[int], rows: Rows | ScatteredRows | None, batch: BatchDim,
) -> tuple[int, int, list[int]]:
    advance, offset, strides = window(func, size, ceil4(math.prod(size)), rows, batch=batch)
    return advance, offset, strides if strides is not None else contiguous_strides(size)


def plain_counters(func: OpOverload, size: Sequence[int], device: torch.device) -> tuple[torch.Tensor, int, list[int]]:
    """``(key, offset, counter strides)`` of a draw of ``func`` on a plain tensor of
    ``size`` (:func:`plain_window`), its counters reserved."""
    advance, offset, strides = plain_window(func, size)
    seed, base = draw_position(func, advance, device)
    return cr_ops.make_key(seed, base, device), offset, strides


_replay_codes: frozenset | None = None


def read_stack(func: OpOverload, shape: Sequence[int], in_a_step: bool) -> BatchDim:
    """One walk of the Python stack for a stream's draw of ``func`` on a tensor of
    ``shape``: refuses it under torch's ``run_with_rng_state`` (or its forward twin) - a
    graph compiled by another backend that would replay torch's generator for it in the
    backward; a dispatch mode met the operator itself, the kernels of
    :mod:`~compile_rng.eager.random_kernels` meet only the op inside - and, in a step,
    returns the batch dim the innermost of torch's modules says
    (:mod:`~compile_rng.eager.batch_dims`, checked against ``shape``), else the step's.
    The frames are never kept: a list of them held in a frame on the stack is a cycle
    that keeps every caller's locals alive."""
    if _replay_codes is None:
        watched_codes()
    rules, found = batch_dims.RULES_BY_CODE, None
    for frame in stack_frames():
        code = id(frame.f_code)
        if code in _replay_codes:
            raise replay_error(func)
        if in_a_step and found is None and code in rules:  # a set lookup per frame: the walk is per draw
            found = batch_dims.said_by(frame, shape)
    return found if found is not None else _declared(in_a_step)


def _declared(in_a_step: bool) -> BatchDim:
    """The batch dim where no module on the stack says it: the step's."""
    dim = step_batch_dim() if in_a_step else 0
    return BatchDim(dim) if dim else BATCH_MAJOR  # a frozen dataclass costs ~0.5 us to make


def watched_codes() -> frozenset[int]:
    """``id`` of every code object :func:`read_stack` looks for: torch's generator replays
    and the modules whose batch dim :mod:`~compile_rng.eager.batch_dims` reads. A caller that
    walks the stack itself (the C++ lane) and finds none of them passes ``walked``."""
    global _replay_codes
    if _replay_codes is None:
        _replay_codes = frozenset(map(id, rng_state_replay_codes()))
    return _replay_codes | frozenset(batch_dims.RULES_BY_CODE)
