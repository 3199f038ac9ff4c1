"""The common eager draws on a short path: counters, then the CPU kernel into the tensor.

Most random ops in a step are one of a few calls on a plain, dense float32 CPU tensor:
dropout's ``bernoulli_(p)`` on the ``empty_like`` it fills, ``uniform_`` and ``rand``-style
fills. The general path (:mod:`compile_rng.eager.dispatch_modes`) serves every op, dtype,
layout and device through layers - the op's rule, the functional op, its kernel choice, a
key tensor - at ~40 us a call on a Xeon core. Here such a draw takes its counters from the
same place (:func:`~compile_rng.eager.draw_counters.plain_window`, the stream's position)
and calls the same vectorized kernel straight into the tensor: the same counters and
values (tested against the general path, draw by draw).

Anything else is not served and takes the general path *before* a counter is reserved:
another op, dtype, device or layout; a subclass (a Parameter, a fake or functional
tensor); a dispatch mode above; ``generator=``; arguments torch refuses (its own error
comes from the general path); counters that are not one contiguous run (interleaved rows,
a batch dim other than 0 on more than one row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compile_rng import stream
from compile_rng.ops import make_key
from compile_rng._torch.core_internals import OpOverload, current_dispatch_mode
from compile_rng.eager import draw_counters
from compile_rng.semantics.named_draws import draw_position
from compile_rng.semantics.random_ops import is_probability, normalized_arguments, uniform_fault
from compile_rng.stream.cpu_kernel import FAST_BERNOULLI, FAST_UNIFORM, fast_f32, fast_uniform_ok

aten = torch.ops.aten

#: what :func:`short_draw` returns for a call it does not serve
NOT_SERVED = object()


def short_draw(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` drawn in the eager stream here on the short path, or
    :data:`NOT_SERVED` (nothing drawn, nothing reserved)."""
    fill = _FILLS.get(func)
    if fill is None:
        return NOT_SERVED
    kw = normalized_arguments(func, args, kwargs)
    target = kw["input"]
    if (type(target) is not torch.Tensor or target.dtype != torch.float32 or target.device.type != "cpu"
            or not target.is_contiguous() or kw["generator"] is not None or current_dispatch_mode() is not None):
        return NOT_SERVED
    arguments = fill(kw)
    if arguments is None:
        return NOT_SERVED
    size = list(target.shape)
    advance, offset, strides = draw_counters.plain_window(func, size)
    if not stream.contiguous_stream(size, strides):
        return NOT_SERVED
    seed, base = draw_position(func, advance, target.device)
    if draw_counters.recording():
        draw_counters.record(draw_counters.Counters(make_key(seed, base), offset, tuple(strides), tuple(size)))
    fast_f32(arguments[0], target.numel(), seed, base + offset, out=target, **arguments[1])
    return target


def _bernoulli(kw: dict) -> tuple[int, dict] | None:
    p = kw["p"]
    if not (isinstance(p, (float, int)) and is_probability(p)):
        return None
    return FAST_BERNOULLI, {"threshold": stream.threshold32(float(p))}


def _uniform(kw: dict) -> tuple[int, dict] | None:
    low, high = kw["from"], kw["to"]
    if not (isinstance(low, (float, int)) and isinstance(high, (float, int))):
        return None
    low, high = float(low), float(high)
    if uniform_fault(low, high, torch.float32) is not None or not fast_uniform_ok(high):
        return None
    return FAST_UNIFORM, {"low": low, "high": high}


#: op -> its kernel's arguments from the call's (None: not served)
_FILLS: dict[OpOverload, Callable[[dict], tuple[int, dict] | None]] = {
    aten.bernoulli_.float: _bernoulli,
    aten.uniform_.default: _uniform,
}
