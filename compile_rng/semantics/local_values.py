"""Eager plain tensors known to be pieces of DTensors (a leaf: no DTensor import).

A plain tensor-parallel plan hands eager code ``to_local()`` of a sharded DTensor. Inside
compile_rng's eager stream (:func:`recording`: a ``compile_rng.step``, a
``compile_rng.compile``d call, ``eager_stream``) such results are recorded here with
their :class:`Layout`, and :mod:`compile_rng.eager.eager_shards` follows them through the
eager ops that come after, so a random op on one draws the DTensor op's counters -
never a replica's. Compiled graphs record the pieces they return the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from compile_rng._torch.core_internals import tree_leaves


@dataclass(frozen=True)
class Layout:
    """Where a local tensor sits: this rank's piece of a global tensor of ``shape`` and
    ``stride`` placed on ``mesh`` by ``placements`` (a DTensor's spec, without its data)."""

    mesh: Any
    placements: tuple
    shape: tuple
    stride: tuple

    @classmethod
    def of(cls, dtensor: Any) -> "Layout":
        return cls(dtensor.device_mesh, tuple(dtensor.placements), tuple(dtensor.shape), tuple(dtensor.stride()))


@dataclass(frozen=True)
class Lost:
    """A tensor that is some rank-dependent piece of a global tensor, with no known layout."""

    why: str


_values: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_recording: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "compile_rng_recording_local_values", default=None
)


@contextlib.contextmanager
def recording(on_piece: Callable[[], None]) -> Iterator[None]:
    """Record ``to_local()`` results of sharded DTensors inside the block, calling
    ``on_piece()`` at each recorded piece (the stream then follows the ops on it)."""
    token = _recording.set(on_piece)
    try:
        yield
    finally:
        _recording.reset(token)


def is_recording() -> bool:
    return _recording.get() is not None


def _real(tensor: Any) -> bool:
    # not a fake, functional or proxy value of a trace: those never reach eager ops
    return isinstance(tensor, torch.Tensor) and (type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter))


def record(tensor: Any, value: Layout | Lost | None) -> None:
    """Note ``tensor``'s layout (None: a replica, forgotten)."""
    if not _real(tensor):
        return
    if value is None:
        _values.pop(tensor, None)
        return
    _values[tensor] = value
    on_piece = _recording.get()
    if on_piece is not None:
        on_piece()


def lookup(tensor: Any) -> Layout | Lost | None:
    """``tensor``'s recorded layout, if any."""
    if not _values or not isinstance(tensor, torch.Tensor):
        return None
    return _values.get(tensor)


def any_recorded() -> bool:
    """Whether any tensor has a recorded layout now."""
    return bool(_values)


def touches(args: Any) -> bool:
    """Whether any tensor among ``args`` (any nesting) has a recorded layout."""
    return bool(_values) and any(isinstance(a, torch.Tensor) and a in _values for a in tree_leaves(args))
