"""A recomputed forward draws what the forward drew: torch's RNG states carry the stream.

Activation checkpointing (``torch.utils.checkpoint``, reentrant or not, and every wrapper
built on it) saves ``torch.get_rng_state()`` before a forward and, when ``backward()``
recomputes that forward, sets it back inside ``torch.random.fork_rng``. ``backward()``
often runs after the block the forward ran in (``scaler.scale(loss).backward()``,
``accelerator.backward(loss)`` after a step's block), or on a device thread that has none
of the caller's context. So a CPU state handed out records where the draws of that moment
came from (:func:`captured`): every stream's position, and the stream - its handler and its
context variables (the step's rows, names, batch dim, layout) - or that there was none.
Setting the state back inside ``fork_rng`` then draws the rest of the fork from it
(:func:`replaying`): the forward's stream at the forward's positions, on any thread,
whether or not a stream is open there now; or torch's generators, where the forward ran
outside every stream.

A draw in backward that is *not* such a recomputation (a gradient hook's noise, a
communication hook's projections) is not an activation: it is drawn as a replica, from
the stream's sequence, not at the step's rows (:func:`recomputing` tells them apart).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from compile_rng.eager import random_kernels
from compile_rng.stream import state

_recomputing: contextvars.ContextVar[bool] = contextvars.ContextVar("compile_rng_recomputing", default=False)


@dataclass(frozen=True)
class Capture:
    """What a torch RNG state handed out knew: every stream's ``(seed, offset)`` and the
    stream its draws came from (None: torch's generators)."""

    streams: dict[str, tuple[int, int]]
    stream: tuple[random_kernels.Handler, contextvars.Context] | None


def captured() -> Capture:
    """Where random ops here draw from, now."""
    return Capture(state.snapshot(), random_kernels.stream_here())


def recomputing() -> bool:
    """Whether the code here is a recomputation that :func:`replaying` serves."""
    return _recomputing.get()


def _recomputation_context(capture: Capture) -> contextvars.Context:
    """A private copy of the forward's context, its accelerator streams held at the
    forward's positions (torch's generator, which the checkpoint may not have set back,
    is not moved) and marked as a recomputation."""
    _, forward = capture.stream
    context = forward.copy()
    context.run(state.hold, capture.streams)
    context.run(_recomputing.set, True)
    return context


@contextlib.contextmanager
def replaying(capture: Capture) -> Iterator[None]:
    """Random ops in the block draw what they drew when ``capture`` was taken: from its
    stream at its positions, or from torch's generators where it had none. The CPU
    stream's position is the caller's to set (``torch.set_rng_state`` sets it)."""
    if capture.stream is None:
        with random_kernels.drawing(None) if random_kernels.stream_here() is not None else contextlib.nullcontext():
            yield
        return
    handler, _ = capture.stream
    with random_kernels.drawing(handler, _recomputation_context(capture)):
        yield
