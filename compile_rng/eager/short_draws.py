"""The common eager draws on a short path: counters, then the CPU kernel into the tensor.

Most random ops in a step are one of a few calls on a plain, dense float32 CPU tensor:
dropout's ``bernoulli_(p)`` on the ``empty_like`` it fills (and timm's drop path's), ``uniform_``
and ``normal_`` fills, ``rand``/``randn`` and their ``*_like`` (masks, noise), ``bernoulli`` and
``normal`` with tensor probabilities, means or stds. The general path (:mod:`compile_rng.eager.dispatch_modes`) serves every op, dtype,
layout and device through layers - the op's rule, the functional op, its kernel choice, a
key tensor - at ~40 us a call on a Xeon core. Here such a draw takes its counters from the
same place (:func:`~compile_rng.eager.draw_counters.contiguous_window`, the stream's position)
and calls the same vectorized kernel straight into the tensor: the same counters and
values (tested against the general path, draw by draw).

The in-place fills reach here from C++ (``csrc/random_op_kernels.cpp``'s lane): the
kernel checks the tensor and the stream there, calls :func:`lane_counter` for the
arguments' check and the counters, and fills the tensor itself. ``rand``, ``randn`` and
their ``*_like`` reach the lane through torch's kernels (:data:`LANE_FACTORIES`), which fill
an empty tensor; :func:`short_draw` serves them where the lane is off. The lane also
serves ``random_(low, high)`` on a dense integer tensor, and so ``randint`` and
``randint_like`` (torch's kernels fill an empty tensor with it) where the range spans at
most 2**32 (one word per value), and in bfloat16, float16 and float64 the fills whose values
need no arithmetic of the dtype: ``bernoulli_(p)`` (0 and 1), rand's ``uniform_(0, 1)``
(exact in the dtype) and, in half precision, ``normal_`` (the float32 values rounded); and
``exponential_`` in every float dtype (torch's own ``log`` and ``mul``, run by the lane).

Anything else is not served and takes the general path *before* a counter is reserved:
another op, dtype, device or layout; a subclass (a Parameter, a fake or functional
tensor); a dispatch mode above; ``generator=``; arguments torch refuses (its own error
comes from the general path); counters that are not one contiguous run (interleaved rows,
a sequence-major tensor, whose batch rows take the outermost counters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from compile_rng import stream
from compile_rng.ops import CHUNK, make_key
from compile_rng._torch.core_internals import OpOverload, current_dispatch_mode
from compile_rng.eager import draw_counters
from compile_rng.semantics import local_values
from compile_rng.semantics.named_draws import draw_position
from compile_rng.semantics.random_ops import integer_bounds, is_probability, normalized_arguments, uniform_fault
from compile_rng.stream import state
from compile_rng.stream.cpu_kernel import (
    FAST_BERNOULLI, FAST_UNIFORM, INTEGERS_MAX_SPAN, fast_f32, fast_uniform_ok, integers, normal_f32, to_float32,
)

aten = torch.ops.aten

#: what :func:`short_draw` returns for a call it does not serve
NOT_SERVED = object()

#: A draw's kernel and its arguments, ``(kernel, x0, x1, x2, n)``: ``FAST_UNIFORM``
#: ``(low, float32 high - low, high, 0)``, ``FAST_BERNOULLI`` ``(0, 1, 1, threshold)``,
#: :data:`BERNOULLI_BITS` ``(0, threshold, 0, the dtype's 1.0 as bits)``, :data:`UNIT_UNIFORM`
#: ``(0, 0, 0, the dtype's uniform bits)``, :data:`EXPONENTIAL` ``(-1 / lambd, 0, 0, 0)``,
#: :data:`NORMAL` ``(mean, std, 0, 0)``, :data:`INTEGERS` ``(0, high - low, 0, low mod
#: 2**64)`` (a span of at most 2**32 is an exact float) - plain numbers, which the C++ lane
#: reads too
Fill = tuple[int, float, float, float, int]

#: the codes of the float32 normal kernel, of the exponential (the lane's ``log`` and ``mul``
#: of ``cr_open_unit_bits``' ``(0, 1]``) and of the word kernels in a :data:`Fill`
#: (``FAST_*`` are ``fast_f32``'s): integers, bernoulli in another float dtype, rand's
#: ``[0, 1)`` in another float dtype
NORMAL, EXPONENTIAL, INTEGERS, BERNOULLI_BITS, UNIT_UNIFORM = 3, 7, 4, 5, 6

#: the word kernels' C functions (``csrc/philox.c``: one word per element, any width), which
#: take a :data:`Fill`'s ``n`` and ``x1`` as their numbers ``a`` and ``b``; the C++ lane reads
#: this, :data:`NORMAL` and :data:`EXPONENTIAL` from this module
WORD_KERNELS = {INTEGERS: "cr_integers", BERNOULLI_BITS: "cr_bernoulli_bits", UNIT_UNIFORM: "cr_unit_uniform_bits"}


def short_draw(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` drawn in the eager stream here on the short path, or
    :data:`NOT_SERVED` (nothing drawn, nothing reserved)."""
    parse = _CALLS.get(func)
    if parse is None or current_dispatch_mode() is not None:
        return NOT_SERVED
    kw = normalized_arguments(func, args, kwargs)
    served = parse(kw) if kw.get("generator") is None else None
    if served is None:
        return NOT_SERVED
    size, draw = served
    reserved = _reserve(func, size)
    if reserved is None:
        return NOT_SERVED
    return draw(*reserved)


def _filled(size: list[int], target: torch.Tensor | None, fill: Fill, seed: int, first: int,
            strides: Sequence[int]) -> torch.Tensor:
    """``target`` (or a new float32 tensor of ``size``) filled with ``fill``'s values of the
    counters from ``first`` at ``strides``."""
    out = torch.empty(size, dtype=torch.float32) if target is None else target
    kernel, x0, x1, x2, threshold = fill
    if kernel == NORMAL:
        normal_f32(seed, first, size, list(strides), x0, x1, out=out)
    elif kernel == FAST_UNIFORM:
        fast_f32(kernel, out.numel(), seed, first, out=out, low=x0, high=x2)
    else:
        fast_f32(kernel, out.numel(), seed, first, out=out, threshold=threshold)
    return out


#: the ops the C++ lane serves (:mod:`compile_rng.eager.native_kernels`), by the index its
#: kernels are given: the in-place fills of a dense float tensor (dropout's ``bernoulli_``;
#: ``rand``, ``randn`` and their ``*_like`` fill ``uniform_``/``normal_``; ``exponential_``),
#: and ``random_`` with bounds on a dense integer tensor (``randint``'s fill)
LANE_OPS = (aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default, getattr(aten.random_, "from"),
            aten.exponential_.default)


#: the factories whose torch kernel fills an empty tensor with a lane op (``uniform_``,
#: ``normal_``, ``random_(low, high)``): in the eager stream the C++ kernel runs torch's kernel
#: where :func:`lane_through_torch` says so, and the fill takes the lane (or the Python kernel,
#: for what the lane does not serve) - the values and counters a factory's own rule gives
LANE_FACTORIES = (
    aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default,
    aten.randint.default, aten.randint.low, aten.randint_like.default, aten.randint_like.low_dtype,
)

#: the lane index a C++ kernel is given for a :data:`LANE_FACTORIES` op (the C++
#: ``kThroughTorch``), and for an op with no lane (``LANE_OPS`` are indexed from 0)
THROUGH_TORCH, NO_LANE = -2, -1


def lane_through_torch() -> bool:
    """Whether a :data:`LANE_FACTORIES` call here may run torch's kernel: no tensor-parallel
    piece is recorded (a ``*_like`` of a piece draws the piece, which the fill of a fresh
    tensor cannot know)."""
    return not local_values.any_recorded()


def lane_counter(op: int, size: tuple[int, ...], *numbers: Any) -> tuple | None:
    """The C++ lane's draw of ``LANE_OPS[op]`` with its number arguments ``numbers`` on a
    tensor of ``size`` here (the tensor's dtype after its numbers unless it is float32):
    ``(kernel, seed, counter of element 0, x0, x1, x2, n)`` (a :data:`Fill`'s kernel and
    arguments), its counters reserved, or None (nothing reserved: the call takes the Python kernel). The
    lane has checked what it can in C++ (a dense CPU tensor, a float dtype for float numbers
    and an integer dtype for int ones, no generator, no dispatch mode, this thread's eager
    stream) and walked the stack (none of :func:`draw_counters.watched_codes` on it); here:
    the arguments the lane serves, no tensor-parallel piece recorded, one contiguous run of
    counters."""
    func = LANE_OPS[op]
    fill = _LANE_FILLS[op](*numbers)
    if fill is None or local_values.any_recorded():
        return None
    reserved = _reserve(func, size, walked=True)
    if reserved is None:
        return None
    kernel, x0, x1, x2, n = fill
    return kernel, reserved[0], reserved[1] % 2**64, x0, x1, x2, n


def _reserve(func: OpOverload, size: Sequence[int], walked: bool = False) -> tuple[int, int, Sequence[int]] | None:
    """``(seed, counter of element 0, counter strides)`` of a draw of ``func`` on a plain
    tensor of ``size`` here, reserved (and recorded), where element ``i`` takes counter
    ``first + i``; else None (nothing reserved). ``walked``: as
    :func:`draw_counters.contiguous_window`'s."""
    window = draw_counters.contiguous_window(func, size, walked)
    if window is None:
        return None
    advance, offset, strides = window
    seed, base = draw_position(func, advance, state.CPU)
    if draw_counters.recording():
        draw_counters.record(draw_counters.Counters(make_key(seed, base), offset, tuple(strides), tuple(size)))
    return seed, base + offset, strides


def _dense(t: Any) -> bool:
    """A plain, contiguous float32 CPU tensor (a Parameter, a fake or functional tensor
    is not: their writes take torch's own path)."""
    return type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _number(*values: Any) -> bool:
    for v in values:  # a loop, not all() of a generator: this runs on every lane draw
        if not isinstance(v, (float, int)):
            return False
    return True


def _factory(kw: dict, like: torch.Tensor | None = None) -> list[int] | None:
    """The size of a float32 CPU tensor a factory (or ``*_like`` of ``like``) makes, or None."""
    dtype = kw.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
    device = kw.get("device") or (like.device if like is not None else torch.get_default_device())
    if (dtype != torch.float32 or torch.device(device).type != "cpu" or kw.get("layout") not in (None, torch.strided)
            or kw.get("pin_memory") or kw.get("memory_format") not in (None, torch.preserve_format,
                                                                      torch.contiguous_format)):
        return None
    if like is not None:
        return list(like.shape) if type(like) is torch.Tensor and like.is_contiguous() else None
    size = kw["size"]
    return list(size) if all(type(n) is int and n >= 0 for n in size) else None


# The fills take the tensor's dtype where the lane passes it (a float tensor's unless
# float32, an integer tensor's): bernoulli's values, 0 and 1, are the same in every float
# dtype, and a half-precision normal is the float32 one rounded; uniform's depend on the
# dtype's bits.
@functools.lru_cache(maxsize=256)  # pure; a step repeats a few arguments (dropout's p)
def _uniform(low: Any, high: Any, dtype: torch.dtype | None = None) -> Fill | None:
    if dtype is not None:  # rand's [0, 1) is exact in every float dtype: written as its bits
        return (UNIT_UNIFORM, 0.0, 0.0, 0.0, stream.UNIFORM_BITS[dtype]) if (low, high) == (0.0, 1.0) else None
    if not _number(low, high):
        return None
    low, high = float(low), float(high)
    if uniform_fault(low, high, torch.float32) is not None or not fast_uniform_ok(high):
        return None
    return FAST_UNIFORM, low, to_float32(high - low), high, 0


@functools.lru_cache(maxsize=256)
def _normal(mean: Any, std: Any, dtype: torch.dtype | None = None) -> Fill | None:
    # bfloat16 and float16 normals are the float32 ones rounded (the lane rounds them)
    if dtype not in _NORMAL_DTYPES or not (_number(mean, std) and std >= 0):  # torch refuses a negative or NaN std
        return None
    return NORMAL, float(mean), float(std), 0.0, 0


#: the float dtypes of :func:`_normal`'s tensors: float32 (None), bfloat16, float16
_NORMAL_DTYPES = (None, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=256)
def _exponential(lambd: Any, dtype: torch.dtype | None = None) -> Fill | None:
    # computed as the general path computes it in every float dtype (the C++ lane runs its log)
    if not (_number(lambd) and lambd > 0):  # torch refuses lambd <= 0 (and NaN)
        return None
    return EXPONENTIAL, -1.0 / float(lambd), 0.0, 0.0, 0


@functools.lru_cache(maxsize=256)
def _bernoulli(p: Any, dtype: torch.dtype | None = None) -> Fill | None:
    if not (_number(p) and is_probability(p)) or dtype not in _BERNOULLI_DTYPES:
        return None
    threshold = stream.threshold32(float(p))
    if dtype is None:
        return FAST_BERNOULLI, 0.0, 1.0, 1.0, threshold
    one = torch.ones((), dtype=dtype).view(_SAME_WIDTH_INT[dtype]).item()  # positive: 1.0's sign bit is 0
    return BERNOULLI_BITS, 0.0, float(threshold), 0.0, one


#: the float dtypes of :func:`_bernoulli`'s tensors: float32 (None), and those it writes
#: 1.0 in as bits (a bfloat16 dropout's mask), with the integer dtype of their width
_SAME_WIDTH_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}
_BERNOULLI_DTYPES = (None, *_SAME_WIDTH_INT)


@functools.lru_cache(maxsize=256)
def _integers(low: int, high: int, dtype: torch.dtype) -> Fill | None:
    """``random_(low, high)`` on an integer tensor of ``dtype``: served where the range is
    not empty, fits the dtype (else the general path raises torch's error) and spans one word."""
    smallest, largest = integer_bounds(dtype)
    if not (smallest <= low < high <= largest + 1 and high - low <= INTEGERS_MAX_SPAN):
        return None
    return INTEGERS, 0.0, float(high - low), 0.0, low % 2**64


#: a served call's ``(size, draw)``: ``draw(seed, counter of element 0, counter strides)``
#: computes its values once :func:`_reserve` has reserved their counters
Served = tuple[list[int], Callable[[int, int, Sequence[int]], torch.Tensor]]


def _in_place(fill: Callable[[dict], Fill | None]) -> Callable[[dict], Served | None]:
    def parse(kw: dict) -> Served | None:
        target = kw["input"]
        drawn = fill(kw) if _dense(target) else None
        size = list(target.shape)
        return None if drawn is None else (size, functools.partial(_filled, size, target, drawn))
    return parse


def _made(fill: Callable[[dict], Fill | None], like: bool) -> Callable[[dict], Served | None]:
    def parse(kw: dict) -> Served | None:
        size = _factory(kw, kw["input"] if like else None)
        drawn = fill(kw) if size is not None else None
        return None if drawn is None else (size, functools.partial(_filled, size, None, drawn))
    return parse


def _small(t: Any) -> bool:
    """A :func:`_dense` tensor the general path would draw in one piece (``ops.CHUNK``)."""
    return _dense(t) and t.numel() <= CHUNK


def _bernoulli_of_input(kw: dict) -> Served | None:
    """``bernoulli(p)``, the probabilities a float32 tensor: the general path's
    ``stream.bernoulli_tensor`` on the stream's words, which the integer kernel gives
    (``W mod 2**32``); where an element is not a probability, the general path raises."""
    p = kw["input"]
    if not (_small(p) and bool(((p >= 0) & (p <= 1)).all())):
        return None

    def draw(seed: int, first: int, strides: Sequence[int]) -> torch.Tensor:
        words = integers(seed, first, 0, INTEGERS_MAX_SPAN, torch.empty(p.shape, dtype=torch.int64))
        return stream.bernoulli_tensor(stream.TENSOR_MATH, words, p, torch.float32)

    return list(p.shape), draw


def _normal_of_tensors(kw: dict) -> Served | None:
    """``normal`` with a tensor mean or std (float32 tensors of one shape, or a number for
    the other): the general path's ``z * std + mean`` on the float32 standard normal;
    where a std is negative (or NaN), the general path raises."""
    mean, std = kw.get("mean", 0.0), kw.get("std", 1.0)
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if not all(_small(t) and t.shape == tensors[0].shape for t in tensors) or not all(
            _number(v) for v in (mean, std) if not isinstance(v, torch.Tensor)):
        return None
    if not bool(std.min() >= 0 if isinstance(std, torch.Tensor) else std >= 0):
        return None
    size = list(tensors[0].shape)

    def draw(seed: int, first: int, strides: Sequence[int]) -> torch.Tensor:
        z = normal_f32(seed, first, size, list(strides), 0.0, 1.0)
        return aten.add.Tensor(aten.mul.Tensor(z, std), mean)

    return size, draw


def _uniform_of(kw: dict) -> Fill | None:
    return _uniform(kw.get("from", 0.0), kw.get("to", 1.0))


def _normal_of(kw: dict) -> Fill | None:
    return _normal(kw.get("mean", 0.0), kw.get("std", 1.0))


#: op -> its call's :data:`Served` from its arguments (None: not served)
_CALLS: dict[OpOverload, Callable[[dict], Served | None]] = {
    aten.bernoulli_.float: _in_place(lambda kw: _bernoulli(kw["p"])),
    aten.uniform_.default: _in_place(_uniform_of),
    aten.normal_.default: _in_place(_normal_of),
    aten.rand.default: _made(_uniform_of, like=False),
    aten.rand_like.default: _made(_uniform_of, like=True),
    aten.randn.default: _made(_normal_of, like=False),
    aten.randn_like.default: _made(_normal_of, like=True),
    aten.bernoulli.default: _bernoulli_of_input,
    aten.normal.Tensor_Tensor: _normal_of_tensors,
    aten.normal.Tensor_float: _normal_of_tensors,
    aten.normal.float_Tensor: _normal_of_tensors,
}

#: ``LANE_OPS[i]``'s :data:`Fill` from its number arguments, and the tensor's dtype where
#: the lane passes it (None: not served)
_LANE_FILLS: tuple[Callable[..., Fill | None], ...] = (_bernoulli, _uniform, _normal, _integers, _exponential)
