"""Inductor lowerings of the functional random ops.

Fused vs. extern: a large float32 uniform/bernoulli/dropout over a contiguous stream
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
re-evaluate them recursively and compile time explodes). All integer work is on int64
values holding uint32 words and never overflows int64 (see ``stream._mulhilo``), so the
generated C++ has no undefined behaviour. The transforms are the shared definitions in
:mod:`compile_rng.stream`, so compiled values match the eager kernels.

Fused loops only for CPU graphs (:data:`FUSED_DEVICE_TYPES`): on accelerators every op
is a call of its Triton kernel (:mod:`compile_rng.stream.triton_kernels`), the code that is
checked - bitwise in Triton's interpreter, and compiled ahead of time for sm_80/90/100
with no spills (:mod:`compile_rng.debug.gpu_aot`). The fused Triton these lowerings give a CUDA
graph is correct too (``tests/test_accelerator_path.py`` generates it on fake CUDA
tensors, runs it in the interpreter bitwise and compiles it for sm_90), but it is built
for C++: int64 words with products split on 16 bits and one whole Philox block per
element. For a float32 dropout on sm_90 that is 312 SASS instructions per element against
the Triton kernel's 97 (it uses all four words of a block); the H100 prediction
(``benchmarks/aot_gpu.py --per-element``) puts the fused loop at about 4x the kernel's time,
bound by the integer pipe where the kernel is bound by memory - more than fusing saves (a
read and a write of the neighbour's tensor). So accelerators keep the kernel, until
``bench_gpu.py`` on a GPU says otherwise.

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


class InductorMath:
    """:class:`compile_rng.stream.Math` on Inductor's ``ops`` handler."""

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


_M = InductorMath()
_I64 = torch.int64


class _Counter:
    """Per-element Philox words at ``key[1] + offset + sum(idx * strides)``."""

    def __init__(self, key: ir.TensorBox, offset: Any, strides: Sequence[Any]):
        # A batched graph's key is computed (row terms added in the graph): a buffer, so
        # that every element loads it instead of recomputing it.
        key.realize()
        self.key_loader = key.make_loader()
        self.offset = sympy.sympify(offset)
        self.strides = [sympy.sympify(s) for s in strides]

    def block(self, index: Sequence[sympy.Expr], c2: int = 0) -> tuple[list[Any], Any]:
        rel = self.offset + sum((i * s for i, s in zip(index, self.strides)), sympy.Integer(0))
        key = stream.key_words(_M, self.key_loader([sympy.Integer(0)]))
        base = self.key_loader([sympy.Integer(1)])
        block_lo, block_hi, lane = stream.block_and_lane(_M, base, ops.index_expr(rel, _I64))
        ctr = [block_lo, block_hi, _M.const(c2, _I64), _M.const(0, _I64)]
        return stream.philox4x32_10(_M, ctr, key), lane

    @staticmethod
    def select(words: Sequence[Any], lane: Any) -> Any:
        """``words[lane]`` for a lane value in ``[0, len(words))``."""
        out = words[-1]
        for i in range(len(words) - 2, -1, -1):
            out = _M.where(_M.eq(lane, _M.const(i, _I64)), words[i], out)
        return out

    def word(self, index: Sequence[sympy.Expr], c2: int = 0) -> Any:
        words, lane = self.block(index, c2)
        return self.select(words, lane)


def _pointwise(
    key: ir.TensorBox, size: Sequence[Any], dtype: torch.dtype, fn: Callable[[list], Any]
) -> ir.TensorBox:
    return ir.Pointwise.create(
        device=key.get_device_or_error(), dtype=dtype, inner_fn=fn, ranges=list(size)
    )


#: The device types whose graphs get the fused loops; elsewhere (CUDA, XPU) each op is a
#: call of its Triton kernel. See the module docstring; tests pin it.
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cpu",)


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


def _extern_worthy(size: Sequence[Any], strides: Sequence[Any], dtype: torch.dtype, fast_path: bool = True) -> bool:
    """Whether a CPU graph calls the eager op instead of a fused loop: with AVX-512, long
    float32 streams that take the C kernel's fast path (``fast_path``: the op's own
    condition for it); without, every stream of static size.

    Without AVX-512 the fused loop's 64-bit multiplies are emulated: with Inductor at AVX2
    it ran 31-41 ns/element from 1K to 256K elements, against the kernel call's 30-40 us
    (the custom op's Python layers, on a 2-core EPYC) plus ~1 ns/element, and gcc took
    5-20 s to build each op's loop there (a 4-rank job's cold compile was 1.6x stock
    Inductor's, most of it gcc on loops of a few hundred elements). A call costs a tiny
    op at most ~35 us per step; the loop costs every cold start seconds per op."""
    if _fused_loops_forced or not all(isinstance(v, (int, sympy.Integer)) for v in (*size, *strides)):
        return False
    if inductor_vector_isa() != "avx512":
        return True
    numel = math.prod(int(s) for s in size)
    contiguous = stream.contiguous_stream([int(s) for s in size], [int(s) for s in strides])
    return fast_path and dtype == torch.float32 and contiguous and numel >= EXTERN_MIN_NUMEL


def _extern(op: OpOverload, *args: Any) -> Any:
    return fallback_handler(op, add_to_fallback_set=False)(*args)


@_register(torch.ops.compile_rng.uniform.default)
def _uniform(key, offset, size, strides, low, high, dtype):
    from compile_rng.stream.cpu_kernel import fast_uniform_ok

    if _extern_worthy(size, strides, dtype, fast_uniform_ok(high)):
        return _extern(torch.ops.compile_rng.uniform.default, key, offset, size, strides, low, high, dtype)
    ctr = _Counter(key, offset, strides)
    return _pointwise(key, size, dtype, lambda idx: stream.uniform(_M, ctr.word(idx), dtype, low, high))


@_register(torch.ops.compile_rng.exponential.default)
def _exponential(key, offset, size, strides, lambd, dtype):
    # Always fused: its log is Inductor's (within 4 ulp of the eager op's), and a choice
    # by size or CPU must not change a value.
    ctr = _Counter(key, offset, strides)
    return _pointwise(key, size, dtype, lambda idx: stream.exponential(_M, ctr.word(idx), dtype, lambd))


@_register(torch.ops.compile_rng.bernoulli.default)
def _bernoulli(key, offset, size, strides, p, dtype):
    if _extern_worthy(size, strides, dtype):
        return _extern(torch.ops.compile_rng.bernoulli.default, key, offset, size, strides, p, dtype)
    ctr = _Counter(key, offset, strides)
    return _pointwise(key, size, dtype, lambda idx: stream.bernoulli_scalar(_M, ctr.word(idx), dtype, p))


@_register(torch.ops.compile_rng.bernoulli_tensor.default)
def _bernoulli_tensor(key, offset, p, strides, dtype):
    if _extern_worthy(p.get_size(), strides, dtype, fast_path=False):
        return _extern(torch.ops.compile_rng.bernoulli_tensor.default, key, offset, p, strides, dtype)
    ctr = _Counter(key, offset, strides)
    load_p = p.make_loader()
    return _pointwise(
        key, p.get_size(), dtype,
        lambda idx: stream.bernoulli_tensor(_M, ctr.word(idx), load_p(idx), dtype),
    )


@_register(torch.ops.compile_rng.dropout.default)
def _dropout(key, offset, x, strides, p):
    if _extern_worthy(x.get_size(), strides, x.get_dtype()):
        return _extern(torch.ops.compile_rng.dropout.default, key, offset, x, strides, p)
    ctr = _Counter(key, offset, strides)
    load_x = x.make_loader()
    size, dtype = x.get_size(), x.get_dtype()
    # Two pointwise nodes recomputing the same words: Inductor fuses them into one loop.
    keep = lambda idx: stream.dropout_keep(_M, ctr.word(idx), p)  # noqa: E731
    out = _pointwise(key, size, dtype, lambda idx: stream.dropout_apply(_M, load_x(idx), keep(idx), dtype, p))
    return out, _pointwise(key, size, torch.bool, keep)


@_register(torch.ops.compile_rng.randint.default)
def _randint(key, offset, size, strides, low, high, dtype):
    if _extern_worthy(size, strides, dtype, fast_path=False):
        return _extern(torch.ops.compile_rng.randint.default, key, offset, size, strides, low, high, dtype)
    ctr = _Counter(key, offset, strides)

    def fn(idx):
        w_high = ctr.word(idx, c2=1) if stream.needs_high_word(low, high) else None
        return stream.randint(_M, ctr.word(idx), w_high, dtype, low, high)

    return _pointwise(key, size, dtype, fn)


@_register(torch.ops.compile_rng.random_bits.default)
def _random_bits(key, offset, size, strides):
    if _extern_worthy(size, strides, _I64, fast_path=False):
        return _extern(torch.ops.compile_rng.random_bits.default, key, offset, size, strides)
    ctr = _Counter(key, offset, strides)
    return _pointwise(
        key, size, _I64, lambda idx: stream.random_bits(_M, ctr.word(idx), ctr.word(idx, c2=1))
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
