"""The eager stream: random ops on plain tensors and local pieces drawn from compile_rng's stream.

* :class:`RandomOpMode` replaces each random op (plain or local tensors) with the
  functional op at the counters a callback assigns; the DTensor tracker
  (:mod:`compile_rng.eager.tracker`) runs one with the shard's layout;
* :func:`eager_stream` and :func:`compiled_call` draw a plain tensor's random ops as a
  replica on a one-rank mesh's, through the kernels of
  :mod:`~compile_rng.eager.random_kernels` (no other op reaches Python), and enter a
  :class:`RandomOpMode` only once a tensor-parallel rank's local piece is recorded: every
  op on a piece must be followed;
* their counters come from :mod:`compile_rng.eager.draw_counters`; the common draws take
  the short path of :mod:`compile_rng.eager.short_draws`.

Nothing here needs DTensor: plain-tensor code pays no DTensor import.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from compile_rng import ops as cr_ops
from compile_rng.eager import draw_counters, random_kernels
from compile_rng.eager.draw_counters import Counters, plain_counters, replay_error
from compile_rng.eager.short_draws import NOT_SERVED, short_draw
from compile_rng._torch.core_internals import (
    OpOverload,
    TorchDispatchMode,
    current_dispatch_mode,
    has_internal_overlap,
    dispatch_mode_stack,
    higher_order_op_name,
    insert_dispatch_mode,
    op_arguments,
    op_name,
    is_run_with_rng_state,
    pop_dispatch_mode_temporarily,
    remove_dispatch_mode,
)
from compile_rng.semantics import local_values
from compile_rng.semantics.random_ops import (
    draws_nothing,
    INPLACE,
    RULES,
    Form,
    RandomArgumentError,
    RandomCall,
    counter_shape,
    draws,
    foreign_seed_draw,
    functional_form,
    is_random,
    normalized_arguments,
    unsupported,
)
from compile_rng.semantics.named_draws import set_namer
from compile_rng.semantics.pieces import Pieces
from compile_rng.semantics.rows import (
    set_rows,
)
from compile_rng.stream import contiguous_strides

aten = torch.ops.aten


def _out_shape_dtype(func: OpOverload, kw: dict) -> tuple[list, torch.dtype]:
    """The shape a random op draws counters over (its output's, but see
    :func:`~compile_rng.semantics.random_ops.counter_shape`) and its output dtype, from its
    normalized arguments."""
    if "size" in kw:
        default = torch.int64 if "randint" in func.name() else torch.get_default_dtype()
        return list(kw["size"]), kw.get("dtype") or default
    if "n" in kw:  # randperm
        return [int(kw["n"])], kw.get("dtype") or torch.int64
    if isinstance(kw.get("mean"), torch.Tensor) or isinstance(kw.get("std"), torch.Tensor):
        tensors = [t for t in (kw.get("mean"), kw.get("std")) if isinstance(t, torch.Tensor)]
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:  # torch's own error says it in its words (_torch_refusal)
            raise RandomArgumentError(f"compile_rng: {func}: mean and std do not broadcast") from None
        return list(shape), tensors[0].dtype
    if "num_samples" in kw:  # multinomial
        out = [*kw["input"].shape[:-1], int(kw["num_samples"])]
        return list(counter_shape(func, kw, out, lambda t: t.shape)), torch.int64
    first = kw["input"] if "input" in kw else kw["count"]
    return list(first.shape), kw.get("dtype") or first.dtype


def _out_device(kw: dict) -> torch.device:
    """The device a random op's output lives on, from its normalized arguments: its
    ``device=`` (a factory's, or a ``*_like``'s other device), else its tensors'."""
    device = kw.get("device")
    if device is not None:
        return torch.device(device)
    for name in ("input", "self", "mean", "std"):
        if isinstance(kw.get(name), torch.Tensor):
            return kw[name].device
    return torch.get_default_device()


def drawn_shape(func: OpOverload, args: tuple, kwargs: dict) -> list | None:
    """The shape of the tensor ``func`` draws, if it is a random op with a counter-based
    form (None otherwise: the modes here refuse the other random ops themselves)."""
    functional = INPLACE.get(func, func)
    if functional not in RULES:
        return None
    return list(_out_shape_dtype(functional, normalized_arguments(func, args, kwargs))[0])


def op_device(func: OpOverload, args: tuple, kwargs: dict) -> torch.device:
    """The device random op ``func`` draws on, from its arguments."""
    return _out_device(normalized_arguments(func, args, kwargs))


class _TensorCall(RandomCall):
    """A random op call on local tensors, replaced at dispatch time."""

    def __init__(self, func, kw, key, offset, strides, size, dtype, out=None, device=None):
        self.op, self.kw, self.key, self.offset = func, kw, key, offset
        self._strides, self._size, self.dtype = strides, size, dtype
        self.device = key.device if key is not None else device  # the key is made on the output's device
        self.out = out  # an in-place op's target: the values may be written straight into it

    def size(self):
        return self._size

    def strides(self):
        return self._strides

    def emit(self, target, *args):
        into = cr_ops.INTO.get(target)
        if self.out is not None and into is not None and into(self.out, self.key, self.offset, *args):
            return self.out
        return cr_ops.call(target, self.key, self.offset, *args)

    def apply(self, target, *args, **kwargs):
        return target(*args, **kwargs)


class _Accepted(Exception):
    """A rule reached its first draw: it has checked its arguments."""


class _ArgumentCheck(_TensorCall):
    """A call that runs an op's rule up to its first draw or computation, where the rule
    has checked its arguments (:func:`_check_arguments`)."""

    def emit(self, target, *args):
        raise _Accepted

    def apply(self, target, *args, **kwargs):
        raise _Accepted


def _check_arguments(func: OpOverload, kw: dict, size: list, dtype: torch.dtype) -> None:
    """Raise the :class:`RandomArgumentError` ``func``'s rule raises for arguments ``kw``
    before it draws, without reserving counters."""
    functional = INPLACE.get(func, func)
    try:
        RULES[functional](_ArgumentCheck(functional, kw, None, 0, contiguous_strides(size), size, dtype))
    except _Accepted:
        pass


#: How an eager op on a tensor-parallel rank's local piece of a DTensor runs:
#: :mod:`compile_rng.eager.eager_shards` registers it (it imports DTensor; plain-tensor
#: code never needs it), imported by whatever records such pieces (the installer's
#: ``to_local`` hook, the backend's graphs).
_local_piece_dispatch: list[Callable] = []


def register_local_piece_dispatch(dispatch: Callable) -> None:
    """``dispatch(func, args, kwargs)`` runs each op :class:`RandomOpMode` meets on a
    tensor :mod:`compile_rng.semantics.local_values` recorded (idempotent)."""
    _local_piece_dispatch[:] = [dispatch]


class _OpKind(enum.Enum):
    HIGHER_ORDER = enum.auto()
    RULE = enum.auto()  # a random op drawn by its counter-based rule
    RANDOM_WITHOUT_RULE = enum.auto()  # refused where it draws
    PLAIN = enum.auto()


# Every aten op a step runs passes through the mode (forward and backward), so the kind,
# which depends on the op alone, is looked up once per op: it is most of the mode's own
# cost per call.
_op_kinds: dict[Any, _OpKind] = {}


def _op_kind(func: Any) -> _OpKind:
    kind = _op_kinds.get(func)
    if kind is None:
        if higher_order_op_name(func) is not None:
            kind = _OpKind.HIGHER_ORDER
        elif INPLACE.get(func, func) in RULES or functional_form(func) is not None:
            kind = _OpKind.RULE
        elif is_random(func):
            kind = _OpKind.RANDOM_WITHOUT_RULE
        else:
            kind = _OpKind.PLAIN
        _op_kinds[func] = kind
    return kind


class RandomOpMode(TorchDispatchMode):
    """Replaces random ops with the functional ops at the counters ``counters`` assigns.

    ``counters(op, local_shape, device) -> (key, offset, strides)``, or ``(key, Pieces,
    None)`` for a shard whose counters are affine only piecewise. With ``plain_only`` the
    mode leaves ops on tensor subclasses (DTensor) to their own dispatch, whose tracker
    region then applies the sharded layout.
    """

    # Higher-order operators reach __torch_dispatch__ too: torch's activation checkpointing
    # wraps each random-tagged op of a compiled region in run_with_rng_state (SDPA with
    # dropout_p=0 included), which must meet the rules below, not torch's "no rule" error.
    supports_higher_order_operators = True

    def __init__(self, counters, plain_only: bool = False):
        super().__init__()
        self.counters, self.plain_only = counters, plain_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _op_kind(func)
        if kind is _OpKind.PLAIN and not (self.plain_only and local_values.touches((args, kwargs))):
            # Most ops of a step: run as they are. (A plain op on a DTensor runs its own
            # dispatch either way; one on a recorded local piece needs the piece's.)
            return func(*args, **kwargs)
        if kind is _OpKind.HIGHER_ORDER:
            return _higher_order_op(self, func, args, kwargs)
        if self.plain_only and any(t is not torch.Tensor for t in types):
            return func(*args, **kwargs)
        if self.plain_only and local_values.touches((args, kwargs)):
            # a tensor-parallel rank's local piece of a DTensor: recorded only once DTensor
            # exists, so its dispatch (which imports DTensor) has registered by then
            return _local_piece_dispatch[0](func, args, kwargs)
        return _random_op(self.counters, func, args, kwargs, func)


def _random_op(counters: Callable, func: OpOverload, args: tuple, kwargs: dict, stock: Callable) -> Any:
    """Random op ``func`` on plain tensors drawn at the counters ``counters`` assigns (see
    :class:`RandomOpMode`); one without a counter-based form is refused where it draws.
    ``stock(*args, **kwargs)`` is torch's own op: for what draws nothing, for an explicit
    ``generator=`` (torch's values from it), and for torch's own error where the arguments
    are refused."""
    kw = normalized_arguments(func, args, kwargs)
    if kw.get("generator") is not None:  # torch's generator, asked for by name: torch's values
        return stock(*args, **kwargs)
    if _op_kind(func) is _OpKind.RANDOM_WITHOUT_RULE or foreign_seed_draw(func, kw):
        if draws(func, kw):
            raise unsupported(func, kw)
        return stock(*args, **kwargs)
    device = _out_device(kw)
    if device.type == "meta" or not draws(func, kw):  # nothing drawn (a shape; dropout's train=False)
        return stock(*args, **kwargs)
    form = functional_form(func)
    drawn, drawn_kw = (func, kw) if form is None or form.op is func else (form.op, _sibling_arguments(form, kw))
    size = None
    try:
        size, dtype = _out_shape_dtype(drawn, drawn_kw)
        if any(n < 0 for n in size) or _refused_by_its_outputs(func, form, kw, dtype, stock):
            # torch refuses the shape or what it writes before it draws: its error, not the rows'
            with random_kernels.drawing(None):
                stock(*args, **kwargs)
        if dtype.is_complex:
            result = _draw_complex(counters, drawn, drawn_kw, size, dtype)
        elif draws_nothing(drawn, drawn_kw):  # the rule's values from the arguments alone: nothing reserved
            result = RULES[drawn](_TensorCall(drawn, drawn_kw, None, 0, [], size, dtype, device=device))
        else:
            result = _draw_at(counters, drawn, drawn_kw, size, dtype, device)
    except RandomArgumentError as refused:
        if size is not None and math.prod(size) == 0:  # torch draws nothing: its outcome (its kernels
            with random_kernels.drawing(None):       # may skip a check an empty tensor needs no more)
                return stock(*args, **kwargs)
        raise _torch_refusal(func, kw, stock) or refused from None
    if form is not None and form.outs:
        return _written(result, [kw[name] for name in form.outs])
    if "memory_format" in drawn_kw:
        return _like_layout(result, drawn_kw)
    return result


def _refused_by_its_outputs(func: OpOverload, form: Form | None, kw: dict, dtype: torch.dtype, stock: Callable) -> bool:
    """Whether torch refuses what ``func`` (of functional form ``form``, drawing ``dtype``)
    writes before it draws, as its kernels check first: an in-place target whose elements
    share memory, or ``out=`` tensors of another dtype it will not cast to (asked of torch
    by :func:`_torch_refusal`, only then: its probe may draw from torch's generator)."""
    if func in INPLACE and isinstance(kw.get("input"), torch.Tensor) and has_internal_overlap(kw["input"]):
        return True
    if form is None or not form.outs:
        return False
    outs = [kw[name] for name in form.outs]
    return (len(outs) > 1 or outs[0].dtype != dtype) and _torch_refusal(func, kw, stock) is not None


def _draw_at(counters: Callable, func: OpOverload, kw: dict, size: list, dtype: torch.dtype, device) -> Any:
    """``func`` drawn at the counters ``counters`` assigns to its ``size``-shaped result,
    reserved once its rule has accepted the arguments (as torch, a refused call leaves
    the stream where it was)."""
    _check_arguments(func, kw, size, dtype)
    key, offset, strides = counters(func, size, device)
    if isinstance(offset, Pieces):
        return _draw_pieces(func, kw, key, offset, size, dtype)
    if draw_counters.recording():
        draw_counters.record(Counters(key, offset, tuple(strides), tuple(size)))
    return _draw(func, kw, key, offset, strides, size, dtype)


def _sibling_arguments(form: Form, kw: dict) -> dict:
    """The arguments of ``form.op`` (the overload that draws) from those of its out= or
    generator= sibling: the outputs' dtype and device for a factory, int bounds for a
    ``randint_like.Tensor``'s 0-d tensors."""
    own = normalized_arguments(form.op, (), {})
    drawn = {name: kw[name] for name in own if name in kw}
    if form.outs:
        out = kw[form.outs[0]]
        for name, value in (("dtype", out.dtype), ("device", out.device)):
            if name in own and drawn.get(name) is None:
                drawn[name] = value
    for name in ("low", "high"):
        if isinstance(drawn.get(name), torch.Tensor):
            drawn[name] = int(drawn[name])
    return drawn


def _written(result: Any, outs: list[torch.Tensor]) -> Any:
    """``out=``: the values written into the outputs, each resized to its value's shape."""
    values = result if isinstance(result, tuple) else (result,)
    for out, value in zip(outs, values):
        if out.shape != value.shape:
            out.resize_(value.shape)
        out.copy_(value)
    return tuple(outs) if len(outs) > 1 else outs[0]


def _like_layout(result: torch.Tensor, kw: dict) -> torch.Tensor:
    """A ``*_like`` result in the memory format torch gives it (``preserve_format``: the
    input's strides, channels-last included); the values are the contiguous draw's."""
    like, memory_format = kw["input"], kw.get("memory_format")
    if memory_format in (None, torch.preserve_format) and like.is_contiguous() or memory_format is torch.contiguous_format:
        return result
    shaped = torch.empty_like(like, dtype=result.dtype, device=result.device,
                              memory_format=memory_format or torch.preserve_format)
    return result if shaped.stride() == result.stride() else shaped.copy_(result)


# torch draws a complex tensor as its real view, (*size, 2) (ATen's uniform_ and normal_
# on a complex tensor, normal_ with std / sqrt(2) for each part): the ops that accept one
_COMPLEX_FILLS = {
    aten.rand.default: aten.uniform_.default,
    aten.rand_like.default: aten.uniform_.default,
    aten.uniform.default: aten.uniform_.default,
    aten.randn.default: aten.normal_.default,
    aten.randn_like.default: aten.normal_.default,
    aten.normal_functional.default: aten.normal_.default,
    aten.normal.float_float: aten.normal_.default,
}


def _draw_complex(counters: Callable, func: OpOverload, kw: dict, size: list, dtype: torch.dtype) -> Any:
    """A complex tensor drawn as torch defines it: its real view ``(*size, 2)``, filled by
    the real op (counters over that view, row-major: the parts of an element adjacent)."""
    functional = INPLACE.get(func, func)
    fill = _COMPLEX_FILLS.get(functional)
    if fill is None:
        raise RandomArgumentError(
            f"compile_rng: {func}: dtype {dtype} is not drawn by this op in the stream (complex values are drawn by "
            "rand, randn and the in-place uniform_ and normal_); draw the real view "
            "(torch.view_as_real(t).normal_(...)) instead, or draw outside the stream"
        )
    if counters is not plain_counters:
        raise NotImplementedError(
            f"compile_rng: {func} on a complex DTensor or tensor-parallel piece: its shard layout is not "
            "defined for complex values. Draw the real view (torch.view_as_real) as a DTensor"
        )
    if func is not functional:
        target = kw["input"]
    elif "input" in kw:
        target = torch.empty_like(kw["input"], dtype=dtype, device=_out_device(kw))
    else:
        target = torch.empty(size, dtype=dtype, device=_out_device(kw))
    real = torch.view_as_real(target)
    if fill is aten.uniform_.default:
        fill(real, kw.get("from", 0.0), kw.get("to", 1.0))
    else:
        std = kw.get("std", 1.0)
        fill(real, kw.get("mean", 0.0), std / math.sqrt(2) if std >= 0 else std)
    return target


# functional ops whose input is only a template (its shape, dtype, device): torch is asked
# with a one-element one; every other op's tensors carry values the checks read (rates,
# probabilities, means), and are passed as they are
_TEMPLATES = {"uniform", "exponential", "cauchy", "log_normal", "geometric", "random", "normal_functional",
              "rand_like", "randn_like", "randint_like"}


def _torch_refusal(func: OpOverload, kw: dict, stock: Callable) -> BaseException | None:
    """torch's own exception for a call whose arguments compile_rng refuses (its type and
    message: code that catches torch's error keeps working): the same call on one element
    (``size`` [1], a one-element target, fresh outputs: a factory's empty, another's of the
    caller's shape), whose arguments ATen checks before it draws, with a generator of its
    own where the op takes one. None where torch accepts it (compile_rng's own error then
    stands)."""
    one = dict(kw)
    if "size" in one:
        one["size"] = [1]
    target = one.get("input")
    if isinstance(target, torch.Tensor) and (func in INPLACE or op_name(func) in _TEMPLATES):
        # a scratch target: of one element, or of the target's shape where another tensor
        # (bernoulli_'s p) must expand to it
        others = any(isinstance(v, torch.Tensor) for name, v in one.items() if name != "input")
        one["input"] = torch.empty(target.shape if others else 1, dtype=target.dtype, device=target.device)
    positional, keywords = [], {}
    for argument in op_arguments(func):
        name = "input" if argument.name == "self" else argument.name
        value = one.get(name)
        if argument.is_out:  # a factory's resizes to its size; another's is the caller's shape
            value = torch.empty(0 if "size" in one else value.shape, dtype=value.dtype, device=value.device)
        elif name == "generator":  # where torch accepts the call it draws: not from its global generator
            value = torch.Generator(_out_device(kw))
        if argument.kwarg_only:
            keywords[argument.name] = value
        else:
            positional.append(value)
    try:
        with random_kernels.drawing(None):  # the ops a composite calls are torch's too
            stock(*positional, **keywords)
    except Exception as error:  # noqa: BLE001 - whatever torch raises is the answer
        return error
    return None


def _higher_order_op(mode: RandomOpMode, func, args: tuple, kwargs: dict):
    """``run_with_rng_state(rng_state, op, *op_args)``: ``op`` as the mode runs it, when
    ``op`` draws nothing (torch's generator state is then irrelevant). An op that draws
    would be replayed from torch's generator in the recomputation, outside any stream;
    it and every other higher-order op are refused."""
    if is_run_with_rng_state(func):
        _, op, *op_args = args
        if not (is_random(op) and draws(op, normalized_arguments(op, tuple(op_args), kwargs))):
            return mode.__torch_dispatch__(op, [], tuple(op_args), kwargs)
        raise replay_error(op)
    raise NotImplementedError(
        f"compile_rng: the higher-order op {higher_order_op_name(func)} ran eagerly under compile_rng's "
        "random-op mode, which cannot see the random ops inside it. Compile the code that calls it "
        "(torch.compile with compile_rng.backend(...)), or run it outside the step"
    )


def _draw(func: OpOverload, kw: dict, key, offset, strides, size: list, dtype: torch.dtype):
    """``func`` (normalized arguments ``kw``) by its rule at one affine counter window;
    an in-place op's values land in its ``kw["input"]``, which is returned."""
    functional = INPLACE.get(func, func)
    inplace = func is not functional
    # Writing straight into the target needs real values: a plain tensor, no mode that
    # traces or intercepts (checked as cheaply as possible: this runs for every draw)
    direct = inplace and type(kw["input"]) is torch.Tensor and current_dispatch_mode() is None
    call = _TensorCall(functional, kw, key, offset, strides, size, dtype, out=kw["input"] if direct else None)
    result = RULES[functional](call)
    if inplace:
        target = kw["input"]
        result = result[0] if isinstance(result, tuple) else result
        if result is not target:
            target.copy_(result)
        return target
    return result


def _draw_pieces(func: OpOverload, kw: dict, key, pieces: Pieces, size: list, dtype: torch.dtype):
    """``func`` drawn piece by piece on the ``narrow``s of its output (and of the tensor
    arguments that span it) along ``pieces.dim``: functional results are concatenated,
    an in-place op writes each piece into its narrow of the target."""
    dim = pieces.dim
    parts = []
    for start, length, offset, strides in pieces.pieces:
        piece_kw = {name: _narrow_operand(v, len(size), dim, size[dim], start, length) for name, v in kw.items()}
        piece_size = list(size)
        piece_size[dim] = length
        parts.append(_draw(func, piece_kw, key, offset, strides, piece_size, dtype))
    if func is not INPLACE.get(func, func):
        return kw["input"]
    return _concat(parts, dim)


def _concat(parts: list, dim: int):
    if isinstance(parts[0], tuple):  # native_dropout: (output, mask)
        return tuple(torch.cat(column, dim) for column in zip(*parts))
    return torch.cat(parts, dim)


def _narrow_operand(value, out_ndim: int, dim: int, full: int, start: int, length: int):
    """``value``'s part for the output slice ``[start, start + length)`` of ``dim``: a
    tensor that spans the output's ``dim`` (aligned from the right, as broadcasting)
    is narrowed; a broadcast one and non-tensors are shared by every piece."""
    if not isinstance(value, torch.Tensor):
        return value
    own = dim - (out_ndim - value.dim())
    if own < 0 or value.shape[own] != full:
        return value
    return value.narrow(own, start, length)


def stream_op(func: OpOverload, args: tuple, kwargs: dict, stock: Callable) -> Any:
    """The eager stream's handler of a random op on plain tensors (a
    :mod:`~compile_rng.eager.random_kernels` kernel's): drawn as a replica, or as its
    piece where a tensor-parallel rank's recorded local piece is among the operands.
    Dropout's ``bernoulli_`` in its streams may never reach it: the C++ kernel's lane
    serves the common call (:func:`~compile_rng.eager.short_draws.lane_counter`)."""
    if local_values.touches((args, kwargs)):
        return _local_piece_dispatch[0](func, args, kwargs)
    drawn = short_draw(func, args, kwargs)
    if drawn is not NOT_SERVED:
        return drawn
    return _random_op(plain_counters, func, args, kwargs, stock)


class _PieceMode(RandomOpMode):
    """A stream's dispatch mode for tensor-parallel ranks' local pieces: every op on a
    recorded piece must pass through compile_rng, which follows the piece's layout
    (:mod:`compile_rng.eager.eager_shards`). A stream enters it only once a piece is
    recorded; plain code never pays for it.

    Dynamo compiles under a mode that ignores compile internals and the compiled graphs
    run under it; only the eager code between graphs reaches the mode with random ops
    (the graphs' own random ops are functional already)."""

    def __init__(self) -> None:
        super().__init__(plain_counters, plain_only=True)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _Stream:
    """The outermost eager stream block of a thread: where its piece mode goes."""

    def __init__(self) -> None:
        self.depth = len(dispatch_mode_stack())
        self.piece_mode: _PieceMode | None = None

    def follow_pieces(self) -> None:
        """Enter the piece mode (once) at the depth the stream began at, under any mode
        the stream's code entered since, so that it lasts as long as the stream."""
        if self.piece_mode is None:
            self.piece_mode = _PieceMode()
            insert_dispatch_mode(self.piece_mode, self.depth)

    def close(self) -> None:
        if self.piece_mode is not None:
            remove_dispatch_mode(self.piece_mode)


_stream: contextvars.ContextVar[_Stream | None] = contextvars.ContextVar("compile_rng_stream", default=None)


@contextlib.contextmanager
def _drawing() -> Iterator[None]:
    """Random ops on plain tensors draw from the stream in the block; a nested block
    leaves following pieces to the outermost, whose pieces outlive the inner block."""
    if _stream.get() is not None:
        with random_kernels.drawing(stream_op):
            yield
        return
    stream = _Stream()
    token = _stream.set(stream)
    try:
        with random_kernels.drawing(stream_op), local_values.recording(stream.follow_pieces):
            yield
    finally:
        _stream.reset(token)
        stream.close()


@contextlib.contextmanager
def eager_stream() -> Iterator[None]:
    """Eager random ops on plain tensors inside the block draw from compile_rng's
    stream (a plain tensor is a replica on a one-rank mesh: counter ``base + i``, then
    ``base += ceil4(numel)``), exactly as they would in a compiled graph. DTensor ops
    keep going through the tracker. Only random ops reach compile_rng
    (:mod:`~compile_rng.eager.random_kernels`); a graph compiled by another backend that
    draws in the block is refused."""
    with _drawing():
        yield


def _leave_the_stream_in_a_child() -> None:
    # A process forked inside a step (a DataLoader's workers started in one) is in no
    # stream: random_kernels forgets the handler there; DTensor's tracker, which serves
    # every process, must not find the step's rows or names, nor pieces a mode follows.
    stream = _stream.get()
    if stream is not None:
        stream.close()
        _stream.set(None)
    set_rows(None)
    set_namer(None)


os.register_at_fork(after_in_child=_leave_the_stream_in_a_child)


def _foreign_graphs_refused(func: OpOverload, args: tuple, kwargs: dict, stock: Callable) -> Any:
    # a layout block's guard: torch's random ops as they are, but not a graph compiled by
    # another backend, whose draws the block's layout would not reach
    kw = normalized_arguments(func, args, kwargs)
    if foreign_seed_draw(func, kw):
        raise unsupported(func, kw)
    return stock(*args, **kwargs)


def foreign_graphs_refused() -> contextlib.AbstractContextManager[None]:
    """Outside a stream, random ops in the block run as in torch, but a graph compiled by
    another backend (stock Inductor) that draws is refused, naming the fix: its draws
    would be torch's per-rank values, not a compile_rng layout's."""
    return random_kernels.guarded(_foreign_graphs_refused)


def in_stream() -> bool:
    """Whether eager random ops on plain tensors here draw from compile_rng's stream."""
    return random_kernels.active() is not None or any(isinstance(m, RandomOpMode) for m in dispatch_mode_stack())


_IN_COMPILED_CALL = contextvars.ContextVar("compile_rng_in_compiled_call", default=False)


@contextlib.contextmanager
def compiled_call() -> Iterator[None]:
    """Around a call of a ``compile_rng.compile``d function: the eager code Dynamo runs
    between graphs draws plain-tensor random ops from the stream (as
    :func:`eager_stream`), while ``torch.compile`` keeps compiling inside."""
    token = _IN_COMPILED_CALL.set(True)
    try:
        with _drawing():
            yield
    finally:
        _IN_COMPILED_CALL.reset(token)


def in_compiled_call() -> bool:
    """Whether the code runs inside :func:`compiled_call`."""
    return _IN_COMPILED_CALL.get()


@contextlib.contextmanager
def graph_call() -> Iterator[None]:
    """Around a compiled graph, and around a compile: the graph's ops skip the stream
    (its random ops are functional already; the piece mode would cost a Python dispatch
    per op), and so does the compile - a compile can run while a step's eager code runs
    (DDP's optimizer compiles its pieces at their first call), and Inductor traces its
    own patterns then, random ops included."""
    with contextlib.ExitStack() as stack:
        while isinstance(current_dispatch_mode(), _PieceMode):
            stack.enter_context(pop_dispatch_mode_temporarily())
        stack.enter_context(random_kernels.drawing(None))
        yield
