"""Canonical stream v1 in Triton: the accelerator (CUDA, XPU) kernels of the functional ops.

One kernel, specialized per op, computes every op of :mod:`compile_rng.ops` over the
same counter layouts as the CPU kernel: element ``idx`` of a contiguous output has
counter ``base + offset + sum(idx[d] * strides[d])`` (mod 2**64), with the key's seed
and base loaded from the key tensor on the device (no host sync per op).

* **Layouts.** The host collapses the layout to rows of an inner dim (``rows x inner``,
  outer dims up to three with any strides). Where the inner counter stride is 1 (a
  plain stream, or a shard window of a row-major global tensor) a program walks Philox
  *blocks* and writes all four words of each; otherwise each element computes its own
  block and takes its lane.
* **64-bit.** Counters and seeds are full uint64 (carried in uint64 lanes, wrapping like
  the contract), element indices int64: no int32 truncation anywhere.
* **Floats.** Float parameters travel as their float64 bit patterns and are rounded to
  the compute dtype in the kernel, as :mod:`compile_rng.stream` rounds its constants.
  Kernels launch with ``enable_fp_fusion=False``: a multiply-add contracted into an FMA
  would round differently from the CPU kernel.

``TRITON_INTERPRET=1`` (set before this module is imported) runs the kernels on CPU
tensors with Triton's interpreter; the test suite checks them that way bitwise against
the scalar reference. Import needs ``triton`` (``pip install compile_rng[gpu]``).
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from compile_rng import stream

#: Whether the kernels run in Triton's interpreter (on CPU tensors).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

UNIFORM, NORMAL, EXPONENTIAL, BERNOULLI, BERNOULLI_TENSOR, DROPOUT, RANDINT, RANDOM_BITS = range(8)
_OUTER_DIMS = 3  # outer dims a launch takes; more are looped over on the host
_BLOCKS = 256  # Philox blocks per program (1024 elements) on the block path
_ELEMS = 1024  # elements per program on the per-element path

# --- device code ------------------------------------------------------------------------


# The contract's constants, as compile-time values of the device code.
_M0 = tl.constexpr(stream.PHILOX_M0)
_M1 = tl.constexpr(stream.PHILOX_M1)
_W0 = tl.constexpr(stream.PHILOX_W0)
_W1 = tl.constexpr(stream.PHILOX_W1)
_ROUNDS = tl.constexpr(stream.PHILOX_ROUNDS)
_MASK32 = tl.constexpr(stream.MASK32)
_TWO_POW_MINUS_32 = tl.constexpr(2.0**-32)


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 words (Random123's rounds; key bumped between rounds)."""
    for r in tl.static_range(_ROUNDS):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def _words(block, k0, k1, c2: tl.constexpr):
    """The four words of Philox block ``block`` (uint64) with third counter word ``c2``."""
    lo = (block & _MASK32).to(tl.uint32)
    hi = (block >> 32).to(tl.uint32)
    zero = tl.zeros_like(lo)
    return _philox(lo, hi, zero + c2, zero, k0, k1)


@triton.jit
def _pick(w0, w1, w2, w3, lane):
    return tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))


@triton.jit
def _float_param(bits, CDT: tl.constexpr):
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(CDT)


@triton.jit
def _open_unit(w, CDT: tl.constexpr):
    """``(w + 1) * 2**-32`` in ``(0, 1]``."""
    return (w.to(tl.int64) + 1).to(CDT) * _TWO_POW_MINUS_32


@triton.jit
def _to(v, ODT: tl.constexpr):
    """``v`` rounded to the output dtype, to nearest even. bfloat16 is rounded on the bits:
    one definition everywhere (Triton's interpreter truncates the cast; GPUs round it)."""
    if ODT == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(ODT)


@triton.jit
def _widen(v):
    """``v`` as float64 (bfloat16 via float32: the interpreter casts it only to float32)."""
    if v.dtype == tl.bfloat16:
        return v.to(tl.float32).to(tl.float64)
    else:
        return v.to(tl.float64)


@triton.jit
def _values(
    w, w_even, w_odd, w_high, lane, flat, valid, out_ptr, mask_ptr, in_ptr,
    a_bits, b_bits, i_a, i_b,
    OP: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr, BIG: tl.constexpr, MOD: tl.constexpr,
):
    """Transform stream words into the op's values and store them at ``flat``."""
    ODT: tl.constexpr = out_ptr.dtype.element_ty
    if OP == 0:  # uniform in [a, b)
        low = _float_param(a_bits, CDT)
        high64 = _float_param(b_bits, tl.float64)
        span = (high64 - _float_param(a_bits, tl.float64)).to(CDT)
        u = (w >> (32 - BITS)).to(CDT) * (1.0 / (1 << BITS))
        v = _to(u * span + low, ODT)
        v = tl.where(_widen(v) >= high64, _to(low, ODT), v)
        tl.store(out_ptr + flat, v, mask=valid)
    elif OP == 1:  # normal(mean=a, std=b), Box-Muller on the lane's word pair
        r2 = tl.log(_open_unit(w_even, CDT)) * -2.0
        if CDT == tl.float32:
            radius = tl.sqrt_rn(r2)  # IEEE-rounded (tl.sqrt may approximate on a GPU)
        else:
            radius = tl.sqrt(r2)  # float64 sqrt is IEEE-rounded
        angle = w_odd.to(CDT) * 2.3283064365386963e-10 * tl.full([], 6.283185307179586, CDT)
        z = radius * tl.where((lane & 1) == 0, tl.cos(angle), tl.sin(angle))
        tl.store(out_ptr + flat, _to(z * _float_param(b_bits, CDT) + _float_param(a_bits, CDT), ODT), mask=valid)
    elif OP == 2:  # exponential, a = -1 / lambd
        tl.store(out_ptr + flat, _to(tl.log(_open_unit(w, CDT)) * _float_param(a_bits, CDT), ODT), mask=valid)
    elif OP == 3:  # bernoulli, i_a = ceil(p * 2**32)
        tl.store(out_ptr + flat, _to(w.to(tl.int64) < i_a, ODT), mask=valid)
    elif OP == 4:  # bernoulli with probabilities in in_ptr, compared exactly in float64
        p = _widen(tl.load(in_ptr + flat, mask=valid, other=0))
        tl.store(out_ptr + flat, _to((w.to(tl.float64) * 2.3283064365386963e-10) < p, ODT), mask=valid)
    elif OP == 5:  # dropout of in_ptr, i_a = ceil((1 - p) * 2**32), a = the scale
        keep = w.to(tl.int64) < i_a
        x = tl.load(in_ptr + flat, mask=valid, other=0).to(CDT)
        y = x * keep.to(CDT) * _float_param(a_bits, CDT)
        tl.store(out_ptr + flat, _to(y, ODT), mask=valid)
        tl.store(mask_ptr + flat, keep, mask=valid)
    elif OP == 6:  # integers in [i_a, i_a + i_b)
        v = w.to(tl.int64)
        if BIG:
            v = (w_high & 0x7FFFFFFF).to(tl.int64) * 4294967296 + v
        if MOD:
            v = v % i_b
        tl.store(out_ptr + flat, _to(v + i_a, ODT), mask=valid)
    else:  # raw 64-bit values
        v = (w_high.to(tl.uint64) << 32) | w.to(tl.uint64)
        tl.store(out_ptr + flat, v.to(tl.int64, bitcast=True), mask=valid)


# Every scalar is typed int64 by annotation and no pointer is specialized on its alignment,
# so a launch's compiled variant depends only on its constexprs and tensor dtypes, never
# on argument values: an offset crossing 2**31 mid-training does not compile a new kernel,
# and :func:`~compile_rng.stream.accelerator_ops.specializations` can list every variant. Alignment buys nothing here: element
# addresses start at a runtime lane offset, so every load and store is scalar (same SASS
# with and without it, checked on sm_90).
@triton.jit(
    do_not_specialize=["offset", "rows", "inner", "inner_stride", "s1", "s2", "t0", "t1", "t2",
                       "col_programs", "a_bits", "b_bits", "i_a", "i_b"],
    do_not_specialize_on_alignment=["out_ptr", "mask_ptr", "in_ptr", "key_ptr"],
)
def _stream_kernel(
    out_ptr, mask_ptr, in_ptr, key_ptr, offset: tl.int64,
    rows: tl.int64, inner: tl.int64, inner_stride: tl.int64, s1: tl.int64, s2: tl.int64,
    t0: tl.int64, t1: tl.int64, t2: tl.int64, col_programs: tl.int64,
    a_bits: tl.int64, b_bits: tl.int64, i_a: tl.int64, i_b: tl.int64,
    OP: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr, BIG: tl.constexpr, MOD: tl.constexpr,
    HIGH: tl.constexpr, CONTIG: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // col_programs
    col = pid % col_programs
    seed = tl.load(key_ptr).to(tl.uint64, bitcast=True)
    base = tl.load(key_ptr + 1).to(tl.uint64, bitcast=True)
    k0 = (seed & _MASK32).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    i2 = row % s2
    i1 = (row // s2) % s1
    i0 = row // (s2 * s1)
    row_rel = i0 * t0 + i1 * t1 + i2 * t2
    start = base + offset.to(tl.uint64) + row_rel.to(tl.uint64)  # an int cast wraps mod 2**64
    if CONTIG:
        # Program ``col`` owns Philox blocks [col * BLOCK, (col + 1) * BLOCK) of the row's
        # stream; block k's lane l is element 4k + l - lane0 of the row.
        k = col * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        block = ((start >> 2) + k.to(tl.uint64)) & 0x3FFFFFFFFFFFFFFF  # counters wrap at 2**64
        w0, w1, w2, w3 = _words(block, k0, k1, 0)
        lane = tl.arange(0, 4)[None, :]
        j = k[:, None] * 4 + lane - (start & 3).to(tl.int64)
        w = _pick(w0[:, None], w1[:, None], w2[:, None], w3[:, None], lane)
        w_even = tl.where(lane < 2, w0[:, None], w2[:, None])
        w_odd = tl.where(lane < 2, w1[:, None], w3[:, None])
        w_high = w
        if HIGH:
            h0, h1, h2, h3 = _words(block, k0, k1, 1)
            w_high = _pick(h0[:, None], h1[:, None], h2[:, None], h3[:, None], lane)
    else:
        j = col * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        n = start + (j * inner_stride).to(tl.uint64)
        lane = (n & 3).to(tl.int32)
        w0, w1, w2, w3 = _words(n >> 2, k0, k1, 0)
        w = _pick(w0, w1, w2, w3, lane)
        w_even = tl.where(lane < 2, w0, w2)
        w_odd = tl.where(lane < 2, w1, w3)
        w_high = w
        if HIGH:
            h0, h1, h2, h3 = _words(n >> 2, k0, k1, 1)
            w_high = _pick(h0, h1, h2, h3, lane)
    valid = (j >= 0) & (j < inner)
    _values(w, w_even, w_odd, w_high, lane, row * inner + j, valid, out_ptr, mask_ptr, in_ptr,
            a_bits, b_bits, i_a, i_b, OP, BITS, CDT, BIG, MOD)


# --- host side --------------------------------------------------------------------------

_TL_CDT = {torch.float32: tl.float32, torch.float64: tl.float64}


def _bits(x: float) -> int:
    """The float64 bit pattern of ``x`` as a signed int64."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def collapse(size: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """``(size, counter stride)`` dims with size-1 dims dropped and dims merged where the
    outer one continues the inner one; the row-major element order is unchanged."""
    dims: list[tuple[int, int]] = []
    for s, st in zip(size, strides):
        if s == 1:
            continue
        if dims and dims[-1][1] == st * s:
            dims[-1] = (dims[-1][0] * s, st)
        else:
            dims.append((s, st))
    return dims or [(1, 1)]


@dataclass(frozen=True)
class Launch:
    """One launch of :func:`_stream_kernel`: what :func:`launch` passes it."""

    grid: tuple[int]
    args: tuple[Any, ...]
    constexprs: tuple[tuple[str, Any], ...]


#: Compile options of every launch. ``enable_fp_fusion=False``: a multiply-add contracted
#: into an FMA would round differently from the CPU kernel.
OPTIONS: dict[str, Any] = {"num_warps": 4, "enable_fp_fusion": False}


def plan(
    op: int,
    out: torch.Tensor,
    key: torch.Tensor,
    offset: int,
    strides: Sequence[int],
    *,
    mask: torch.Tensor | None = None,
    source: torch.Tensor | None = None,
    a: float = 0.0,
    b: float = 0.0,
    i_a: int = 0,
    i_b: int = 0,
    big: bool = False,
    mod: bool = False,
) -> list[Launch]:
    """The launches that fill the contiguous ``out`` with op ``op``'s values at the layout
    ``(out.shape, strides)``. ``source`` (dropout's input, bernoulli's probabilities) and
    ``mask`` (dropout's keep mask) are contiguous and shaped like ``out``."""
    numel = out.numel()
    if numel == 0:
        return []
    dims = collapse(list(out.shape), list(strides))
    inner, inner_stride = dims[-1]
    outer, lead = dims[:-1][-_OUTER_DIMS:], dims[:-1][:-_OUTER_DIMS]
    outer = [(1, 0)] * (_OUTER_DIMS - len(outer)) + outer
    rows = math.prod(s for s, _ in outer)
    contig = inner_stride == 1
    block = _BLOCKS if contig else _ELEMS
    if contig and op == RANDINT and big:
        # Each element's 64-bit modulo is a ptxas subroutine call; at two blocks (eight
        # calls) per thread ptxas spilled 4 bytes on sm_80 (kernels that call are held to
        # 64 registers there). One block per thread: 42 registers, no spill (gpu_aot).
        block = _BLOCKS // 2
    col_programs = triton.cdiv(triton.cdiv(inner + 3, 4) if contig else inner, block)
    dtype = out.dtype if out.dtype.is_floating_point else torch.float32
    constexprs = (
        ("OP", op), ("BITS", stream.UNIFORM_BITS.get(dtype, 24)), ("CDT", _TL_CDT[stream.compute_dtype(dtype)]),
        ("BIG", big), ("MOD", mod), ("HIGH", op == RANDOM_BITS or big), ("CONTIG", contig), ("BLOCK", block),
    )
    flat = [t.view(-1) if t is not None else None for t in (out, mask, source)]
    chunk = rows * inner
    launches = []
    # Dims beyond the kernel's: one launch per leading index, each on a contiguous slice.
    for n, idx in enumerate(itertools.product(*(range(s) for s, _ in lead))):
        lead_rel = sum(i * st for i, (_, st) in zip(idx, lead))
        at = n * chunk
        out_v, mask_v, src_v = [t[at:at + chunk] if t is not None else None for t in flat]
        args = (
            out_v, mask_v if mask_v is not None else out_v, src_v if src_v is not None else out_v, key,
            stream.as_int64(offset + lead_rel), rows, inner, inner_stride,
            outer[1][0], outer[2][0], outer[0][1], outer[1][1], outer[2][1], col_programs,
            _bits(a), _bits(b), stream.as_int64(i_a), stream.as_int64(i_b),
        )
        launches.append(Launch((rows * col_programs,), args, constexprs))
    return launches


#: While :func:`recording` is active, :func:`launch` appends its launches here instead.
_recorder: ContextVar[list[Launch] | None] = ContextVar("compile_rng_triton_recorder", default=None)


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block :func:`launch` records its launches (the list yielded) and runs
    nothing: how :func:`~compile_rng.stream.accelerator_ops.specializations` sees what
    the ops launch without a device."""
    seen: list[Launch] = []
    token = _recorder.set(seen)
    try:
        yield seen
    finally:
        _recorder.reset(token)


def launch(op: int, out: torch.Tensor, key: torch.Tensor, offset: int, strides: Sequence[int], **params: Any) -> None:
    """Fill ``out`` as :func:`plan` says (same arguments)."""
    steps = plan(op, out, key, offset, strides, **params)
    seen = _recorder.get()
    if seen is not None:
        seen.extend(steps)
        return
    for step in steps:
        _stream_kernel[step.grid](*step.args, **dict(step.constexprs), **OPTIONS)


# --- the compiled variants ----------------------------------------------------------------

OP_NAMES = ("uniform", "normal", "exponential", "bernoulli", "bernoulli_tensor", "dropout", "randint", "random_bits")


def variant_name(step: Launch) -> str:
    """A readable name of the compiled variant a launch uses, e.g. ``dropout.float16.stream``
    or ``bernoulli_tensor.bool.p_float64.strided``."""
    c = dict(step.constexprs)
    parts = [OP_NAMES[c["OP"]], _dtype_name(step.args[0].dtype)]
    if c["OP"] == BERNOULLI_TENSOR:
        parts.append("p_" + _dtype_name(step.args[2].dtype))
    if c["OP"] == RANDINT:
        parts.append(("hi" if c["BIG"] else "lo") + ("" if c["MOD"] else ".nomod"))
    parts.append("stream" if c["CONTIG"] else "strided")
    return ".".join(parts)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
