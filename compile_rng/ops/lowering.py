"""Inductor lowerings of the functional random ops.

Fused vs. extern in CPU graphs: a large float32 uniform/bernoulli/dropout over a contiguous stream
becomes a call to the eager C kernel instead (``cpu_kernel.fast_f32``), which uses all
four words of each Philox block and vectorizes across blocks; measured here it is about
2x faster than the fused loop, which recomputes the whole block for every element in
emulated 64-bit arithmetic. Without AVX-512 (Inductor at AVX2, NEON) that arithmetic has
no vector instruction: the fused loop runs 25-40x slower than the kernel and costs gcc
5-20 s per op to build, so there every op of static size calls the eager op, whatever its
size, dtype and layout (:func:`_extern_worthy`). Small, strided (with AVX-512) or
dynamically sized ones stay fused with their neighbours, and so does ``exponential`` (its
``log`` is Inductor's: within 4 ulp of the eager op's). Both give the same bits
(integer-derived values, same float ops), so the choice never changes a result; the
loop's own tests compile it under :func:`fused_loops`. ``normal`` has no lowering: its
transcendental functions must come from one implementation (the C kernel, or torch's ops
for float64) whatever the size or layout, so Inductor always calls the eager op.

Each op becomes one fused ``Pointwise`` node whose ``inner_fn`` builds Philox4x32-10
with ``ops.*`` once (building rounds from aten integer ops instead makes Inductor
re-evaluate them recursively and compile time explodes). The transforms are the shared
definitions in :mod:`compile_rng.stream`, so compiled values match the eager kernels.
The integer arithmetic depends on the code Inductor emits (:attr:`compile_rng.stream.Math.wraps`):
C++ for CPU graphs, where signed overflow is undefined, gets int64 values holding uint32
words that never overflow (products split on 16 bits); Triton for CUDA graphs, whose
integer ops wrap, gets int32 words and one 64-bit product per multiply, which ptxas
turns into one ``IMAD.WIDE.U32``.

CUDA graphs get the fused loops too (:data:`FUSED_DEVICE_TYPES`): the draw is generated
inside the Triton kernel of what reads it (``dropout(x) + residual`` is one kernel, as in
stock Inductor), where a call of the eager Triton kernel
(:mod:`compile_rng.stream.triton_kernels`) wrote values and mask to memory for the next
kernel to read back (2.2-2.8x stock Inductor's ``dropout(x) + residual`` on an H200).
An Inductor pointwise body sees one element, so the word of a counter is one op of its
own there (:mod:`compile_rng.ops.triton_words`): a Triton helper that computes one Philox
block per four lanes where a program's lanes hold whole blocks in order (from the
program's first counter where the kernel computed them consecutive, else checked on every
lane at run time), else a block per lane: sm_90 counts of 24.6-32.8 instructions per
element (63-73 with a block per element) against the eager kernel's 28-33 and stock
Inductor's 28-37 (``benchmarks/aot_gpu.py --per-element``). ``normal`` and ``exponential``
(their transcendental functions) and a ``uniform`` whose scaling an FMA would round
(:func:`_scaling_exact`) stay calls there.
The generated Triton is checked bitwise against the eager ops, in Triton's interpreter
and on a GPU (``tests/test_accelerator_path.py``), and compiled for sm_90 without spills.
Other accelerators (XPU, MPS) call the eager kernels.

Import this module to register the lowerings; the backend does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch

from compile_rng import stream
from compile_rng._torch.core_internals import OpOverload
from compile_rng._torch.inductor_internals import (
    fallback_handler,
    inductor_caches_off,
    inductor_vector_isa,
    register_lowering,
)
from compile_rng._torch.inductor_internals import inductor_ir as ir
from compile_rng._torch.inductor_internals import inductor_ops as ops
from compile_rng.ops import triton_words


class InductorMath:
    """:class:`compile_rng.stream.Math` on Inductor's ``ops`` handler, for C++ code."""

    wraps = False

    const = staticmethod(lambda value, dtype: ops.constant(value, dtype))
    cast = staticmethod(lambda x, dtype: ops.to_dtype(x, dtype))
    add = staticmethod(lambda a, b: ops.add(a, b))
    sub = staticmethod(lambda a, b: ops.sub(a, b))
    mul = staticmethod(lambda a, b: ops.mul(a, b))
    mod = staticmethod(lambda a, b: ops.mod(a, b))
    shr = staticmethod(lambda a, b: ops.bitwise_right_shift(a, b))
    band = staticmethod(lambda a, b: ops.bitwise_and(a, b))
    bor = staticmethod(lambda a, b: ops.bitwise_or(a, b))
    bxor = staticmethod(lambda a, b: ops.bitwise_xor(a, b))
    lt = staticmethod(lambda a, b: ops.lt(a, b))
    ge = staticmethod(lambda a, b: ops.ge(a, b))
    eq = staticmethod(lambda a, b: ops.eq(a, b))
    where = staticmethod(lambda c, a, b: ops.where(c, a, b))
    log = staticmethod(lambda a: ops.log(a))
    sqrt = staticmethod(lambda a: ops.sqrt(a))
    cos = staticmethod(lambda a: ops.cos(a))
    sin = staticmethod(lambda a: ops.sin(a))


class TritonMath(InductorMath):
    """:class:`InductorMath` for Triton code, whose integer arithmetic wraps: Philox on
    int32 words (see :attr:`compile_rng.stream.Math.wraps`)."""

    wraps = True


_I64 = torch.int64


class _Counter:
    """Per-element Philox words at ``key[1] + offset + sum(idx * strides)``, in the math
    of the graph's device (C++ for CPU graphs, Triton for the others)."""

    def __init__(self, key: ir.TensorBox, offset: Any, strides: Sequence[Any]):
        # A batched graph's key is computed (row terms added in the graph): a buffer, so
        # that every element loads it instead of recomputing it.
        key.realize()
        self.key_loader = key.make_loader()
        self.offset = sympy.sympify(offset)
        self.strides = [sympy.sympify(s) for s in strides]
        self.m: InductorMath = InductorMath() if key.get_device_or_error().type == "cpu" else TritonMath()

    def word(self, index: Sequence[sympy.Expr], c2: int = 0) -> Any:
        m = self.m
        rel = self.offset + sum((i * s for i, s in zip(index, self.strides)), sympy.Integer(0))
        base = self.key_loader([sympy.Integer(1)])
        if m.wraps and c2 == 0:  # a Triton kernel: four lanes share a block where they can
            return triton_words.word(self.key_loader([sympy.Integer(0)]), base, ops.index_expr(rel, _I64))
        key = stream.key_words(m, self.key_loader([sympy.Integer(0)]))
        block_lo, block_hi, lane = stream.block_and_lane(m, base, ops.index_expr(rel, _I64))
        ctr = [block_lo, block_hi, m.const(c2, _I64), m.const(0, _I64)]
        return stream.philox_word(m, stream.philox4x32_10(m, ctr, key), lane)


def _pointwise(
    key: ir.TensorBox, size: Sequence[Any], dtype: torch.dtype, fn: Callable[[list], Any]
) -> ir.TensorBox:
    return ir.Pointwise.create(
        device=key.get_device_or_error(), dtype=dtype, inner_fn=fn, ranges=list(size)
    )


#: The device types whose graphs get the fused loops; elsewhere (XPU, MPS...) each op is a
#: call of its eager kernel. See the module docstring; tests pin it.
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")


def _register(op: OpOverload) -> Callable:
    """Register ``fn`` as ``op``'s lowering for the graphs of :data:`FUSED_DEVICE_TYPES`;
    elsewhere the op stays a call of its kernel (see the module docstring)."""

    def register(fn: Callable) -> Callable:
        def lower(key, *args):
            if key.get_device_or_error().type not in FUSED_DEVICE_TYPES:
                return _extern(op, key, *args)
            return fn(key, *args)

        return register_lowering(op, type_promotion_kind=None)(lower)

    return register


#: Streams at least this long go to the C kernel when Inductor vectorizes for AVX-512
#: (float32 and a contiguous stream: the kernel's fast path; see the module docstring).
EXTERN_MIN_NUMEL = 1 << 18

_fused_loops_forced = False


@contextlib.contextmanager
def fused_loops() -> Iterator[None]:
    """Compiles inside lower every op to its fused loop, whatever the CPU and the size:
    how the loop itself is tested and benchmarked on any machine. Inductor's caches are
    off inside, since their keys do not hold this choice."""
    global _fused_loops_forced
    forced, _fused_loops_forced = _fused_loops_forced, True
    try:
        with inductor_caches_off():
            yield
    finally:
        _fused_loops_forced = forced


def _extern_worthy(device: torch.device, size: Sequence[Any], strides: Sequence[Any], dtype: torch.dtype,
                   fast_path: bool = True) -> bool:
    """Whether a CPU graph calls the eager op instead of a fused loop: with AVX-512, long
    float32 streams that take the C kernel's fast path (``fast_path``: the op's own
    condition for it); without, every stream of static size. A CUDA graph always fuses
    (see the module docstring).

    Without AVX-512 the fused loop's 64-bit multiplies are emulated: with Inductor at AVX2
    it ran 31-41 ns/element from 1K to 256K elements, against the kernel call's 30-40 us
    (the custom op's Python layers, on a 2-core EPYC) plus ~1 ns/element, and gcc took
    5-20 s to build each op's loop there (a 4-rank job's cold compile was 1.6x stock
    Inductor's, most of it gcc on loops of a few hundred elements). A call costs a tiny
    op at most ~35 us per step; the loop costs every cold start seconds per op."""
    if _fused_loops_forced or device.type != "cpu":
        return False
    if not all(isinstance(v, (int, sympy.Integer)) for v in (*size, *strides)):
        return False
    if inductor_vector_isa() != "avx512":
        return True
    numel = math.prod(int(s) for s in size)
    contiguous = stream.contiguous_stream([int(s) for s in size], [int(s) for s in strides])
    return fast_path and dtype == torch.float32 and contiguous and numel >= EXTERN_MIN_NUMEL


def _significant_bits(v: float) -> int:
    """The bits of ``v``'s significand up to its last set one (0 for zero)."""
    n = int(math.frexp(abs(v))[0] * 2**53)
    return 0 if n == 0 else 53 - ((n & -n).bit_length() - 1)


def _scaling_exact(device: torch.device, low: float, high: float, dtype: torch.dtype) -> bool:
    """Whether ``u * (high - low) + low`` has the contract's value (a multiply, then an
    add, each rounded) in a Triton kernel too, where Inductor lets the compiler contract
    them into one FMA (one rounding): when ``low`` is 0 or the product is exact (``u``
    has ``UNIFORM_BITS`` significant bits). Else a CUDA graph calls the eager kernel,
    compiled without contraction. C++ code (CPU graphs) is checked bitwise as it is."""
    if device.type == "cpu" or low == 0.0:
        return True
    cdt = stream.compute_dtype(dtype)
    span = float(torch.tensor(high - low, dtype=cdt))
    bits, finfo, span_bits = stream.UNIFORM_BITS[dtype], torch.finfo(cdt), _significant_bits(span)
    precision = 1 - int(math.log2(finfo.eps))  # 24 for float32, 53 for float64
    # a p-bit by q-bit product needs at most p + q bits, p bits where q = 1 (a power of two)
    product_bits = bits + (span_bits if span_bits > 1 else 0)
    return product_bits <= precision and abs(span) * 2.0**-bits >= finfo.tiny


def _extern(op: OpOverload, *args: Any) -> Any:
    return fallback_handler(op, add_to_fallback_set=False)(*args)


@_register(torch.ops.compile_rng.uniform.default)
def _uniform(key, offset, size, strides, low, high, dtype):
    from compile_rng.stream.cpu_kernel import fast_uniform_ok

    device = key.get_device_or_error()
    if _extern_worthy(device, size, strides, dtype, fast_uniform_ok(high)) or not _scaling_exact(device, low, high, dtype):
        return _extern(torch.ops.compile_rng.uniform.default, key, offset, size, strides, low, high, dtype)
    ctr = _Counter(key, offset, strides)
    return _pointwise(key, size, dtype, lambda idx: stream.uniform(ctr.m, ctr.word(idx), dtype, low, high))


@_register(torch.ops.compile_rng.exponential.default)
def _exponential(key, offset, size, strides, lambd, dtype):
    # CPU graphs always fuse it: its log is Inductor's (within 4 ulp of the eager op's), and
    # a choice by size or CPU must not change a value. CUDA graphs always call the eager
    # kernel, whose log the GPU suite holds to the 4-ulp bound (Triton's log in Inductor's
    # kernels has not been measured on a GPU).
    if key.get_device_or_error().type != "cpu":
        return _extern(torch.ops.compile_rng.exponential.default, key, offset, size, strides, lambd, dtype)
    ctr = _Counter(key, offset, strides)
    return _pointwise(key, size, dtype, lambda idx: stream.exponential(ctr.m, ctr.word(idx), dtype, lambd))


@_register(torch.ops.compile_rng.bernoulli.default)
def _bernoulli(key, offset, size, strides, p, dtype):
    if _extern_worthy(key.get_device_or_error(), size, strides, dtype):
        return _extern(torch.ops.compile_rng.bernoulli.default, key, offset, size, strides, p, dtype)
    ctr = _Counter(key, offset, strides)
    return _pointwise(key, size, dtype, lambda idx: stream.bernoulli_scalar(ctr.m, ctr.word(idx), dtype, p))


@_register(torch.ops.compile_rng.bernoulli_tensor.default)
def _bernoulli_tensor(key, offset, p, strides, dtype):
    if _extern_worthy(key.get_device_or_error(), p.get_size(), strides, dtype, fast_path=False):
        return _extern(torch.ops.compile_rng.bernoulli_tensor.default, key, offset, p, strides, dtype)
    ctr = _Counter(key, offset, strides)
    load_p = p.make_loader()
    return _pointwise(
        key, p.get_size(), dtype,
        lambda idx: stream.bernoulli_tensor(ctr.m, ctr.word(idx), load_p(idx), dtype),
    )


@_register(torch.ops.compile_rng.dropout.default)
def _dropout(key, offset, x, strides, p):
    if _extern_worthy(key.get_device_or_error(), x.get_size(), strides, x.get_dtype()):
        return _extern(torch.ops.compile_rng.dropout.default, key, offset, x, strides, p)
    ctr = _Counter(key, offset, strides)
    load_x = x.make_loader()
    size, dtype = x.get_size(), x.get_dtype()
    # Two pointwise nodes recomputing the same words: Inductor fuses them into one loop.
    keep = lambda idx: stream.dropout_keep(ctr.m, ctr.word(idx), p)  # noqa: E731
    out = _pointwise(key, size, dtype, lambda idx: stream.dropout_apply(ctr.m, load_x(idx), keep(idx), dtype, p))
    return out, _pointwise(key, size, torch.bool, keep)


@_register(torch.ops.compile_rng.randint.default)
def _randint(key, offset, size, strides, low, high, dtype):
    if _extern_worthy(key.get_device_or_error(), size, strides, dtype, fast_path=False):
        return _extern(torch.ops.compile_rng.randint.default, key, offset, size, strides, low, high, dtype)
    ctr = _Counter(key, offset, strides)

    def fn(idx):
        w_high = ctr.word(idx, c2=1) if stream.needs_high_word(low, high) else None
        return stream.randint(ctr.m, ctr.word(idx), w_high, dtype, low, high)

    return _pointwise(key, size, dtype, fn)


@_register(torch.ops.compile_rng.random_bits.default)
def _random_bits(key, offset, size, strides):
    if _extern_worthy(key.get_device_or_error(), size, strides, _I64, fast_path=False):
        return _extern(torch.ops.compile_rng.random_bits.default, key, offset, size, strides)
    ctr = _Counter(key, offset, strides)
    return _pointwise(
        key, size, _I64, lambda idx: stream.random_bits(ctr.m, ctr.word(idx), ctr.word(idx, c2=1))
    )


def _compiled_by_inductor(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)

    def run(*args: Any) -> Any:
        with fused_loops():
            return compiled(*args)

    return run


stream.register_implementation(
    # Philox and the transforms in Inductor's generated kernel: the fused loops whatever
    # the CPU (the choice of a kernel call is the C kernel's implementation, checked apart).
    stream.Implementation("inductor-lowering", (((3, 5), (7, 1)), ((257,), (1,))), _compiled_by_inductor)
)
