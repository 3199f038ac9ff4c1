"""The functional random ops (``torch.ops.compile_rng.*``).

Every op is a pure function of its arguments. The shared leading arguments say which
counters the output's elements get:

* ``key``: int64 tensor ``[seed, base]`` (uint64 values stored two's complement) on
  the output's device. Compiled graphs receive it as an input; nothing is read from a
  generator.
* ``offset``: added to ``base``.
* ``strides``: counter strides, one per output dim. Element ``idx`` has counter
  ``base + offset + sum(idx[d] * strides[d])`` (mod 2**64). Contiguous strides give a
  plain stream (tracker mode); the strides of a larger global tensor, with the shard's
  start folded into ``offset``, give a shard of it (invariant mode).

Values follow canonical stream v1 (:mod:`compile_rng.stream`). Each op has an eager CPU
kernel here, a fake kernel for tracing, and an Inductor lowering in
:mod:`compile_rng.ops.lowering`.
"""

from __future__ import annotations

import array
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from compile_rng import stream
from compile_rng._torch.core_internals import current_dispatch_mode
from compile_rng.ops import samplers
from compile_rng.stream import accelerator_ops, checks
from compile_rng.stream.cpu_kernel import (
    FAST_BERNOULLI,
    FAST_DROPOUT,
    FAST_UNIFORM,
    fast_f32,
    fast_uniform_ok,
    normal_f32,
    philox_words,
)

_M = stream.TENSOR_MATH

#: op name -> its CPU kernel (the function the custom op wraps), for :func:`call`
_CPU_KERNELS: dict[str, Callable[..., Any]] = {}


def _op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Define ``torch.ops.compile_rng.<name>`` with the decorated function as its CPU kernel.
    The op's tensors are contiguous, as its fake says (Inductor checks a fallback kernel's
    strides against the fake's): arithmetic on a ``channels_last`` input would hand back
    that layout."""

    def define(fn: Callable[..., Any]) -> Any:
        _CPU_KERNELS[name] = fn

        @functools.wraps(fn)
        def contiguous(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()

        return torch.library.custom_op(f"compile_rng::{name}", mutates_args=())(contiguous)

    return define


def _key_values(key: torch.Tensor, offset: int) -> tuple[int, int]:
    if key.device.type != "cpu":
        raise NotImplementedError(
            f"compile_rng: eager kernels run on CPU only (key is on {key.device}); "
            "compile the function with backend='compile_rng' to run on this device"
        )
    seed, base = (stream.as_uint64(v) for v in key.tolist())
    return seed, stream.as_uint64(base + offset)


def _words(key, offset, size, strides, op, **kw):
    checks.check_layout(op, size, strides)
    seed, base = _key_values(key, offset)
    return philox_words(seed, base, list(size), list(strides), **kw)


# Eager kernels work on blocks of about this many elements: transient memory stays
# small next to the output (a 1B-parameter init must not need several times its size).
CHUNK = 1 << 20


def _by_rows(offset: int, size: Sequence[int], strides: Sequence[int], compute, *tensors: torch.Tensor):
    """``compute(offset, size, *tensors)`` over blocks of dim-0 rows, assembled.

    Block ``[r0, r1)`` has counters shifted by ``r0 * strides[0]`` and the rows of
    ``tensors`` it covers, so the result equals one call on the whole output.
    """
    size = list(size)
    numel = math.prod(size)
    if numel <= CHUNK or not size:
        return compute(offset, size, *tensors)
    rows, inner = size[0], numel // size[0]
    block = max(1, CHUNK // max(inner, 1))
    out = None
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        part = compute(offset + r0 * strides[0], [r1 - r0, *size[1:]], *(t[r0:r1] for t in tensors))
        parts = part if isinstance(part, tuple) else (part,)
        if out is None:
            out = tuple(torch.empty([rows, *size[1:]], dtype=t.dtype, device=t.device) for t in parts)
        for o, t in zip(out, parts):
            o[r0:r1] = t
    return out if isinstance(part, tuple) else out[0]


# Rows shorter than this take the generic path: the vectorized kernel is one call per row
# (a few microseconds each), the generic path one call for all rows.
FAST_ROW_MIN = 4096


def _fast_layout(size: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the vectorized float32 kernel serves these counters: one contiguous stream,
    or dim-0 rows that are each a contiguous stream, ``strides[0]`` apart (a step's rows
    of the global batch), long enough to be worth a call each."""
    if stream.contiguous_stream(size, strides):
        return True
    return len(size) > 1 and stream.contiguous_stream(size[1:], strides[1:]) and math.prod(size[1:]) >= FAST_ROW_MIN


def _fast(op: int, key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
          x: torch.Tensor | None = None, out: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, Any]:
    """The vectorized kernel over a layout :func:`_fast_layout` accepts, into ``out`` (a
    contiguous float32 tensor of ``size``) or a new tensor; dropout's ``x`` is contiguous."""
    seed, base = _key_values(key, offset)
    size = list(size)
    out = torch.empty(size, dtype=torch.float32) if out is None else out
    mask = torch.empty(size, dtype=torch.bool) if op == FAST_DROPOUT else None
    if stream.contiguous_stream(size, strides):
        fast_f32(op, out.numel(), seed, base, x=x, out=out, mask=mask, **kw)
        return out, mask
    for r in range(size[0]):  # the rows of a contiguous tensor are contiguous
        fast_f32(op, out[r].numel(), seed, base + r * strides[0], x=None if x is None else x[r], out=out[r],
                 mask=None if mask is None else mask[r], **kw)
    return out, mask


def _empty(key: torch.Tensor, size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(list(size), dtype=dtype, device=key.device)


# --- uniform ---------------------------------------------------------------------------


@_op("uniform")
def uniform(
    key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
    low: float, high: float, dtype: torch.dtype,
) -> torch.Tensor:
    """Uniform values in ``[low, high)``."""
    checks.check_float("uniform", dtype)
    # Allocated only where the C kernel fills it: a caching allocator would keep a dropped
    # buffer reserved beside the one the general path makes.
    if key.device.type == "cpu" and _uniform_fast(size, strides, high, dtype):
        out = _empty(key, size, dtype)
        if uniform_into(out, key, offset, size, strides, low, high, dtype):
            return out

    def compute(off, sz):
        return stream.uniform(_M, _words(key, off, sz, strides, "uniform")[0], dtype, low, high)

    return _by_rows(offset, size, strides, compute)


@uniform.register_fake
def _(key, offset, size, strides, low, high, dtype):
    return _empty(key, size, dtype)


def _writable(out: torch.Tensor, size: Sequence[int], dtype: torch.dtype = torch.float32) -> bool:
    # Only real storage: a tensor subclass (LocalTensor, fake, functional) has no data
    # pointer of its own and takes the functional op plus copy_.
    return type(out) in (torch.Tensor, torch.nn.Parameter) and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous() and list(out.shape) == list(size)


def uniform_into(out: torch.Tensor, key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
                 low: float, high: float, dtype: torch.dtype) -> bool:
    """Eager ``uniform`` written straight into ``out`` when the C kernel can (float32,
    contiguous, a layout :func:`_fast_layout` accepts); returns whether it did. Same
    values as :func:`uniform`."""
    if not (_writable(out, size) and _uniform_fast(size, strides, high, dtype)):
        return False
    _fast(FAST_UNIFORM, key, offset, size, strides, out=out, low=low, high=high)
    return True


def _uniform_fast(size: Sequence[int], strides: Sequence[int], high: float, dtype: torch.dtype) -> bool:
    """Whether the C kernel computes this uniform (float32, a layout it takes, a bound it
    handles)."""
    return dtype == torch.float32 and _fast_layout(size, strides) and fast_uniform_ok(high)


# --- normal ----------------------------------------------------------------------------


@_op("normal")
def normal(
    key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
    mean: float, std: float, dtype: torch.dtype,
) -> torch.Tensor:
    """Normal values (Box-Muller, canonical lanes)."""
    checks.check_float("normal", dtype)
    checks.check_layout("normal", size, strides)
    if dtype != torch.float64:  # computed in float32: the C kernel, for every layout
        seed, base = _key_values(key, offset)
        return normal_f32(seed, base, list(size), list(strides), mean, std).to(dtype)

    def compute(off, sz):
        w, lanes = _words(key, off, sz, strides, "normal", pair=True, lanes=True)
        return stream.normal(_M, w[..., 0], w[..., 1], lanes, dtype, mean, std)

    return _by_rows(offset, size, strides, compute)


def normal_into(out: torch.Tensor, key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
                mean: float, std: float, dtype: torch.dtype) -> bool:
    """Eager ``normal`` written straight into ``out`` when it is a contiguous float32
    tensor of ``size``; returns whether it did. Same values as :func:`normal`."""
    if not (dtype == torch.float32 and _writable(out, size)):
        return False
    checks.check_layout("normal", size, strides)
    seed, base = _key_values(key, offset)
    normal_f32(seed, base, list(size), list(strides), mean, std, out=out)
    return True


@normal.register_fake
def _(key, offset, size, strides, mean, std, dtype):
    return _empty(key, size, dtype)


# --- exponential -----------------------------------------------------------------------


@_op("exponential")
def exponential(
    key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
    lambd: float, dtype: torch.dtype,
) -> torch.Tensor:
    """Exponential values with rate ``lambd``."""
    checks.check_float("exponential", dtype)

    def compute(off, sz):
        return stream.exponential(_M, _words(key, off, sz, strides, "exponential")[0], dtype, lambd)

    return _by_rows(offset, size, strides, compute)


@exponential.register_fake
def _(key, offset, size, strides, lambd, dtype):
    return _empty(key, size, dtype)


# --- bernoulli -------------------------------------------------------------------------


@_op("bernoulli")
def bernoulli(
    key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
    p: float, dtype: torch.dtype,
) -> torch.Tensor:
    """1 with probability ``p``, else 0, in ``dtype``."""
    if key.device.type == "cpu" and _fast_layout(size, strides):  # allocated only where the C kernel fills it
        out = _empty(key, size, dtype)
        if bernoulli_into(out, key, offset, size, strides, p, dtype):
            return out

    def compute(off, sz):
        return stream.bernoulli_scalar(_M, _words(key, off, sz, strides, "bernoulli")[0], dtype, p)

    return _by_rows(offset, size, strides, compute)


def bernoulli_into(out: torch.Tensor, key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
                   p: float, dtype: torch.dtype) -> bool:
    """Eager ``bernoulli`` written into ``out`` (a contiguous CPU tensor of ``size`` and
    ``dtype``) when the C kernel serves the layout: straight for float32, else one
    converting copy (eager CPU dropout's ``bernoulli_`` on a float64 or bfloat16 tensor);
    returns whether it did. Same values as :func:`bernoulli`."""
    if not (_writable(out, size, dtype) and _fast_layout(size, strides)):
        return False
    threshold = stream.threshold32(p)
    if dtype == torch.float32:
        _fast(FAST_BERNOULLI, key, offset, size, strides, out=out, threshold=threshold)
    else:  # 0 and 1 convert exactly to every dtype
        out.copy_(_fast(FAST_BERNOULLI, key, offset, size, strides, threshold=threshold)[0])
    return True


@bernoulli.register_fake
def _(key, offset, size, strides, p, dtype):
    return _empty(key, size, dtype)


@_op("bernoulli_tensor")
def bernoulli_tensor(
    key: torch.Tensor, offset: int, p: torch.Tensor, strides: Sequence[int], dtype: torch.dtype,
) -> torch.Tensor:
    """Elementwise bernoulli with probabilities ``p`` (output shaped like ``p``)."""
    def compute(off, sz, p_rows):
        return stream.bernoulli_tensor(_M, _words(key, off, sz, strides, "bernoulli_tensor")[0], p_rows, dtype)

    return _by_rows(offset, p.shape, strides, compute, p)


@bernoulli_tensor.register_fake
def _(key, offset, p, strides, dtype):
    return _empty(key, p.shape, dtype)


# --- dropout ---------------------------------------------------------------------------


@_op("dropout")
def dropout(
    key: torch.Tensor, offset: int, x: torch.Tensor, strides: Sequence[int], p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * keep / (1 - p), keep)`` like ``aten.native_dropout`` in training mode."""
    checks.check_float("dropout", x.dtype)
    if _fast_layout(x.shape, strides):
        threshold = stream.threshold32(1.0 - p)
        if x.dtype == torch.float32:  # a strided x is copied once: the kernel reads it in counter order
            return _fast(FAST_DROPOUT, key, offset, x.shape, strides, threshold=threshold,
                         scale=stream.dropout_scale(p, torch.float32), x=x.contiguous())
        # other dtypes: the kernel's keep mask (0.0 or 1.0), applied as the generic path
        # applies its own
        keep = _fast(FAST_BERNOULLI, key, offset, x.shape, strides, threshold=threshold)[0]
        return stream.dropout_apply(_M, x, keep, x.dtype, p), keep.bool()

    def compute(off, sz, x_rows):
        keep = stream.dropout_keep(_M, _words(key, off, sz, strides, "dropout")[0], p)
        return stream.dropout_apply(_M, x_rows, keep, x.dtype, p), keep

    return _by_rows(offset, x.shape, strides, compute, x)


@dropout.register_fake
def _(key, offset, x, strides, p):
    return _empty(key, x.shape, x.dtype), _empty(key, x.shape, torch.bool)


# --- integers --------------------------------------------------------------------------


@_op("randint")
def randint(
    key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
    low: int, high: int, dtype: torch.dtype,
) -> torch.Tensor:
    """Integers in ``[low, high)``; ``high - low`` at most 2**63."""
    checks.check_randint_range(low, high)
    def compute(off, sz):
        w, _ = _words(key, off, sz, strides, "randint")
        w_high = _words(key, off, sz, strides, "randint", c2=1)[0] if stream.needs_high_word(low, high) else None
        return stream.randint(_M, w, w_high, dtype, low, high)

    return _by_rows(offset, size, strides, compute)


@randint.register_fake
def _(key, offset, size, strides, low, high, dtype):
    return _empty(key, size, dtype)


@_op("random_bits")
def random_bits(
    key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
) -> torch.Tensor:
    """Raw 64-bit values as int64 (two's complement)."""
    def compute(off, sz):
        w, _ = _words(key, off, sz, strides, "random_bits")
        return stream.random_bits(_M, w, _words(key, off, sz, strides, "random_bits", c2=1)[0])

    return _by_rows(offset, size, strides, compute)


@random_bits.register_fake
def _(key, offset, size, strides):
    return _empty(key, size, torch.int64)


# --- samplers (compile_rng.ops.samplers: rounds at fixed counters) -----------------------


def _raw_bits(key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """:func:`random_bits` by its kernel (:func:`call`), for a sampler's rounds."""
    return call(torch.ops.compile_rng.random_bits.default, key, offset, size, strides)


@_op("poisson")
def poisson(key: torch.Tensor, offset: int, rates: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """Poisson counts of ``rates`` (shaped and typed like ``rates``)."""
    checks.check_layout("poisson", rates.shape, strides)
    draws = samplers.Draws(key, offset, rates.shape, strides, _raw_bits)
    return samplers.poisson_values(draws, rates.double()).to(rates.dtype)


@poisson.register_fake
def _(key, offset, rates, strides):
    return _empty(key, rates.shape, rates.dtype)


@_op("binomial")
def binomial(key: torch.Tensor, offset: int, count: torch.Tensor, prob: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """Binomial counts of ``count`` trials of probability ``prob`` (shaped and typed like ``count``)."""
    checks.check_layout("binomial", count.shape, strides)
    draws = samplers.Draws(key, offset, count.shape, strides, _raw_bits)
    return samplers.binomial_values(draws, count.double(), prob.double().expand(count.shape)).to(count.dtype)


@binomial.register_fake
def _(key, offset, count, prob, strides):
    return _empty(key, count.shape, count.dtype)


@_op("standard_gamma")
def standard_gamma(key: torch.Tensor, offset: int, alpha: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """Standard gamma samples of shapes ``alpha``, at least the dtype's smallest normal (as ATen)."""
    checks.check_layout("standard_gamma", alpha.shape, strides)
    draws = samplers.Draws(key, offset, alpha.shape, strides, _raw_bits)
    return samplers.gamma_values(draws, alpha.double()).to(alpha.dtype).clamp_(min=torch.finfo(alpha.dtype).tiny)


@standard_gamma.register_fake
def _(key, offset, alpha, strides):
    return _empty(key, alpha.shape, alpha.dtype)


@_op("dirichlet")
def dirichlet(key: torch.Tensor, offset: int, alpha: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """Dirichlet samples of concentrations ``alpha`` (its last dim): gamma samples at the
    elements' counters, normalized over the last dim in float64."""
    checks.check_layout("dirichlet", alpha.shape, strides)
    draws = samplers.Draws(key, offset, alpha.shape, strides, _raw_bits)
    gamma = samplers.gamma_values(draws, alpha.double()).clamp_(min=torch.finfo(alpha.dtype).tiny)
    return (gamma / gamma.sum(-1, keepdim=True)).to(alpha.dtype)


@dirichlet.register_fake
def _(key, offset, alpha, strides):
    return _empty(key, alpha.shape, alpha.dtype)


def make_key(
    seed: int, base: int, device: str | torch.device = "cpu", rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """The ``key`` tensor for ``(seed, base)`` (uint64 values, stored two's complement);
    a batched graph's key also holds its ``rows`` ``(start, total)``. On an accelerator,
    one asynchronous host-to-device copy: the host never waits for the device."""
    # from a buffer, not a list: a third of torch.tensor's time, on every eager draw
    values = torch.frombuffer(array.array("q", (stream.as_int64(seed), stream.as_int64(base), *(rows or ()))),
                              dtype=torch.int64)
    device = torch.device(device)
    if device.type == "cpu":
        return values
    if device.type == "meta":
        return values.to(device)
    # From pageable memory the copy synchronizes the stream (torch's copy waits for it):
    # every draw and every compiled call would stall the host until the GPU caught up. From
    # pinned memory it is asynchronous; torch's host allocator keeps the block until done.
    return values.pin_memory().to(device, non_blocking=True)


def call(op: Any, key: torch.Tensor, *args: Any) -> Any:
    """``op(key, *args)`` for a functional op ``op`` (``torch.ops.compile_rng.*``). Eagerly -
    plain tensors, no dispatch mode active (inside a mode's handler, its own is off) - the
    op's kernel for the key's device is called directly: the custom op's dispatch (its
    autograd wrapper, kernel lookup and Dynamo guard) costs more than a small draw
    (measured 22 us a call against 9 for a 16-element uniform on CPU). Anything traced or
    intercepted goes through the op."""
    name = _NAMES.get(op)
    if name is not None and current_dispatch_mode() is None and all(
        type(a) is torch.Tensor for a in (key, *args) if isinstance(a, torch.Tensor)
    ):
        kind = key.device.type
        kernel = _CPU_KERNELS[name] if kind == "cpu" else accelerator_ops.KERNELS.get(name)
        if kernel is not None and (kind == "cpu" or kind in accelerator_ops.DEVICE_TYPES):
            return kernel(key, *args)
    return op(key, *args)


_NAMES = {getattr(torch.ops.compile_rng, name).default: name for name in _CPU_KERNELS}


#: Eager in-place ``uniform_`` / ``normal_`` / ``bernoulli_``: functional op -> writer that
#: fills the target itself (a parameter init then needs no temporary and no copy).
INTO = {torch.ops.compile_rng.uniform.default: uniform_into, torch.ops.compile_rng.normal.default: normal_into,
        torch.ops.compile_rng.bernoulli.default: bernoulli_into}


# Here, where the ops are defined: they must have their CUDA/XPU kernels whoever imports
# them first (registering imports no triton).
accelerator_ops.register()

stream.register_implementation(
    # The C kernel's per-element walk (any layout; words cached per block).
    stream.Implementation("c-scalar", (((3, 5), (7, 1)), ((2, 3, 4), (40, 8, 1)), ((), ())), lambda fn: fn)
)
stream.register_implementation(
    # The C kernel's vectorized batches of blocks: contiguous float32 streams (uniform,
    # normal, bernoulli, dropout), with a head and a tail around the batches.
    stream.Implementation("c-vectorized", (((4, 1027), (1027, 1)),), lambda fn: fn)
)
