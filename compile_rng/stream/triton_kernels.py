"""Canonical stream v1 in Triton: the accelerator (CUDA, XPU) kernels of the functional ops.

One kernel, specialized per op, computes every op of :mod:`compile_rng.ops` over the
same counter layouts as the CPU kernel: element ``idx`` of a contiguous output has
counter ``base + offset + sum(idx[d] * strides[d])`` (mod 2**64), with the key's seed
and base loaded from the key tensor on the device (no host sync per op).

* **Layouts.** The host collapses the layout to rows of an inner dim (``rows x inner``,
  outer dims up to three with any strides). Where the inner counter stride is 1 (a
  plain stream, or a shard window of a row-major global tensor) a program walks Philox
  *blocks* and writes all four words of each, in element order (16-byte stores for a
  whole aligned tile); otherwise each element computes its own block and takes its lane.
* **64-bit where it must be.** Counters and seeds are full uint64 (block numbers carried
  as two uint32 words, wrapping like the contract); a program's first element offset is
  int64 and the offsets within it int32; program ids and rows are int32 (the host refuses
  a launch of 2**31 rows or more).
* **Floats.** Float parameters travel as their float64 bit patterns and are rounded to
  the compute dtype in the kernel, as :mod:`compile_rng.stream` rounds its constants.
  Kernels launch with ``enable_fp_fusion=False``: a multiply-add contracted into an FMA
  would round differently from the CPU kernel.

``TRITON_INTERPRET=1`` (set before this module is imported) runs the kernels on CPU
tensors with Triton's interpreter; the test suite checks them that way bitwise against
the scalar reference. Import needs ``triton`` (``pip install compile_rng[gpu]``).
"""

from __future__ import annotations

import functools
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
_BLOCKS = 512  # Philox blocks per program (2048 elements) on the block path
_ELEMS = 512  # elements per program on the per-element path (1024 spilled normal on sm_100)
_GRID_ROWS = 65535  # the most programs a grid's second dim holds (CUDA's limit)

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
def _words(lo, hi, k0, k1, c2: tl.constexpr):
    """The four words of the Philox blocks ``hi * 2**32 + lo`` with third counter word ``c2``."""
    zero = tl.zeros_like(lo)
    return _philox(lo, hi, zero + c2, zero, k0, k1)


@triton.jit
def _pick(w0, w1, w2, w3, lane):
    return tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))


@triton.jit
def _in_order(v0, v1, v2, v3):
    """``[v0[0], v1[0], v2[0], v3[0], v0[1], ...]``: block k's four values at 4k..4k+3,
    each thread holding its blocks' four (so its stores are four contiguous elements)."""
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [4 * v0.shape[0]])


@triton.jit
def _float_param(bits, CDT: tl.constexpr):
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(CDT)


@triton.jit
def _open_unit(w, CDT: tl.constexpr):
    """``(w + 1) * 2**-32`` in ``(0, 1]``."""
    return (w.to(tl.int64) + 1).to(CDT) * _TWO_POW_MINUS_32


@triton.jit
def _box_muller(w_even, w_odd, CDT: tl.constexpr):
    """The cos and sin normals of the word pairs ``(w_even, w_odd)`` (before mean and std)."""
    r2 = tl.log(_open_unit(w_even, CDT)) * -2.0
    if CDT == tl.float32:
        radius = tl.sqrt_rn(r2)  # IEEE-rounded (tl.sqrt may approximate on a GPU)
    else:
        radius = tl.sqrt(r2)  # float64 sqrt is IEEE-rounded
    angle = w_odd.to(CDT) * 2.3283064365386963e-10 * tl.full([], 6.283185307179586, CDT)
    return radius * tl.cos(angle), radius * tl.sin(angle)


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
def _emit(
    w, w_high, z, out_ptr, mask_ptr, in_ptr, at, valid,
    a_bits, b_bits, i_a, i_b,
    OP: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr, BIG: tl.constexpr, MOD: tl.constexpr,
):
    """Op ``OP``'s values of the stream words ``w`` (``w_high``: the ``c2 = 1`` words;
    ``z``: the Box-Muller normals), stored at element offsets ``at`` of the pointers where
    ``valid`` (None: everywhere, which lets the stores vectorize)."""
    ODT: tl.constexpr = out_ptr.dtype.element_ty
    if OP == 0:  # uniform in [a, b); i_a: the first output value at or above b (bits)
        low = _float_param(a_bits, CDT)
        span = (_float_param(b_bits, tl.float64) - _float_param(a_bits, tl.float64)).to(CDT)
        u = (w >> (32 - BITS)).to(CDT) * (1.0 / (1 << BITS))
        v = _to(u * span + low, ODT)
        v = tl.where(v.to(CDT) >= _float_param(i_a, CDT), _to(low, ODT), v)
        tl.store(out_ptr + at, v, mask=valid)
    elif OP == 1:  # normal(mean=a, std=b)
        tl.store(out_ptr + at, _to(z * _float_param(b_bits, CDT) + _float_param(a_bits, CDT), ODT), mask=valid)
    elif OP == 2:  # exponential, a = -1 / lambd
        tl.store(out_ptr + at, _to(tl.log(_open_unit(w, CDT)) * _float_param(a_bits, CDT), ODT), mask=valid)
    elif OP == 3:  # bernoulli, i_a = ceil(p * 2**32)
        tl.store(out_ptr + at, _to(w.to(tl.int64) < i_a, ODT), mask=valid)
    elif OP == 4:  # bernoulli with probabilities in in_ptr, compared exactly in float64
        p = _widen(tl.load(in_ptr + at, mask=valid))
        tl.store(out_ptr + at, _to((w.to(tl.float64) * 2.3283064365386963e-10) < p, ODT), mask=valid)
    elif OP == 5:  # dropout of in_ptr, i_a = ceil((1 - p) * 2**32), a = the scale
        keep = w.to(tl.int64) < i_a
        x = tl.load(in_ptr + at, mask=valid).to(CDT)
        y = x * keep.to(CDT) * _float_param(a_bits, CDT)
        tl.store(out_ptr + at, _to(y, ODT), mask=valid)
        tl.store(mask_ptr + at, keep, mask=valid)
    elif OP == 6:  # integers in [i_a, i_a + i_b)
        v = w.to(tl.int64)
        if BIG:
            v = (w_high & 0x7FFFFFFF).to(tl.int64) * 4294967296 + v
        if MOD:
            v = v % i_b
        tl.store(out_ptr + at, _to(v + i_a, ODT), mask=valid)
    else:  # raw 64-bit values
        v = (w_high.to(tl.uint64) << 32) | w.to(tl.uint64)
        tl.store(out_ptr + at, v.to(tl.int64, bitcast=True), mask=valid)


# Every scalar is typed by annotation and the pointers are specialized only on their
# 16-byte alignment, which :func:`plan` guarantees: a launch's compiled variant depends only
# on its constexprs and tensor dtypes (an offset crossing 2**31 mid-training does not
# compile a new kernel), and :func:`~compile_rng.stream.accelerator_ops.specializations`
# can list every variant. The alignment is what lets a whole tile's stores vectorize.
@triton.jit(
    do_not_specialize=["offset", "first", "inner", "inner_stride", "row0", "s1", "s2", "t0", "t1", "t2",
                       "a_bits", "b_bits", "i_a", "i_b"],
    do_not_specialize_on_alignment=["key_ptr"],
)
def _stream_kernel(
    out_ptr, mask_ptr, in_ptr, key_ptr, offset: tl.int64, first: tl.int64,
    inner: tl.int64, inner_stride: tl.int64, row0: tl.int32, s1: tl.int32, s2: tl.int32,
    t0: tl.int64, t1: tl.int64, t2: tl.int64,
    a_bits: tl.int64, b_bits: tl.int64, i_a: tl.int64, i_b: tl.int64,
    OP: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr, BIG: tl.constexpr, MOD: tl.constexpr,
    HIGH: tl.constexpr, CONTIG: tl.constexpr, BLOCK: tl.constexpr,
):
    # The grid is (programs per row, rows): no division for the common layouts (a stream,
    # or rows of one outer dim); 32-bit program arithmetic, 64-bit element offsets and
    # counters computed once per program, and per element only 32-bit offsets.
    col = tl.program_id(0)
    row = row0 + tl.program_id(1)
    if s1 == 1:  # at most one outer dim
        row_rel = row.to(tl.int64) * t2
    else:
        i2 = row % s2
        i1 = (row // s2) % s1
        i0 = row // (s2 * s1)
        row_rel = i0.to(tl.int64) * t0 + i1.to(tl.int64) * t1 + i2.to(tl.int64) * t2
    seed = tl.load(key_ptr).to(tl.uint64, bitcast=True)
    base = tl.load(key_ptr + 1).to(tl.uint64, bitcast=True)
    k0 = (seed & _MASK32).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    start = base + offset.to(tl.uint64) + row_rel.to(tl.uint64)  # an int cast wraps mod 2**64
    row_at = first + row.to(tl.int64) * inner  # the row's first element in the tensors
    if CONTIG:
        # Program ``col`` owns Philox blocks [col * BLOCK, (col + 1) * BLOCK) of the row's
        # stream: block k's lane l is element 4k + l - lane0 of the row. The block number
        # is carried in two uint32 words (counters wrap at 2**64, blocks at 2**62).
        TILE: tl.constexpr = 4 * BLOCK
        first_block = (start >> 2) + col.to(tl.uint64) * BLOCK  # widened first: col * BLOCK passes 2**31
        lo0 = (first_block & _MASK32).to(tl.uint32)
        hi0 = ((first_block >> 32) & 0x3FFFFFFF).to(tl.uint32)
        lo = lo0 + tl.arange(0, BLOCK).to(tl.uint32)
        hi = (hi0 + (lo < lo0).to(tl.uint32)) & 0x3FFFFFFF
        w0, w1, w2, w3 = _words(lo, hi, k0, k1, 0)
        w = _in_order(w0, w1, w2, w3)
        w_high = w
        if HIGH:
            h0, h1, h2, h3 = _words(lo, hi, k0, k1, 1)
            w_high = _in_order(h0, h1, h2, h3)
        z = w
        if OP == 1:
            z0, z1 = _box_muller(w0, w1, CDT)
            z2, z3 = _box_muller(w2, w3, CDT)
            z = _in_order(z0, z1, z2, z3)
        j0 = col.to(tl.int64) * TILE - (start & 3).to(tl.int64)  # the tile's first element in the row
        at = row_at + j0
        a = tl.arange(0, TILE)
        # A whole tile's unmasked accesses are as wide as its alignment lets Triton make
        # them: 16 bytes for 2-byte outputs only with groups of eight aligned. Not normal's
        # (Triton would reorder its values through shared memory); and not a second branch
        # for tiles at 4 mod 8 (ptxas merges it with this one at the narrower width).
        ALIGN: tl.constexpr = 8 if (out_ptr.dtype.element_ty.primitive_bitwidth < 32) and (OP != 1) else 4
        if (j0 >= 0) & (j0 + TILE <= inner) & (at % ALIGN == 0):
            # A whole tile, its groups aligned: unmasked stores, vectorized.
            at = tl.multiple_of(at, ALIGN)
            _emit(w, w_high, z, out_ptr + at, mask_ptr + at, in_ptr + at, a, None,
                  a_bits, b_bits, i_a, i_b, OP, BITS, CDT, BIG, MOD)
        else:
            lo_j = tl.maximum(-j0, 0).to(tl.int32)
            hi_j = tl.minimum(inner - j0, TILE).to(tl.int32)
            _emit(w, w_high, z, out_ptr + at, mask_ptr + at, in_ptr + at, a, (a >= lo_j) & (a < hi_j),
                  a_bits, b_bits, i_a, i_b, OP, BITS, CDT, BIG, MOD)
    else:
        # Each element computes its own block and takes its lane.
        a = tl.arange(0, BLOCK)
        j = col.to(tl.int64) * BLOCK + a.to(tl.int64)
        n = start + (j * inner_stride).to(tl.uint64)
        lane = (n & 3).to(tl.int32)
        blk = (n >> 2) & 0x3FFFFFFFFFFFFFFF
        lo = (blk & _MASK32).to(tl.uint32)
        hi = (blk >> 32).to(tl.uint32)
        w0, w1, w2, w3 = _words(lo, hi, k0, k1, 0)
        w = _pick(w0, w1, w2, w3, lane)
        w_high = w
        if HIGH:
            h0, h1, h2, h3 = _words(lo, hi, k0, k1, 1)
            w_high = _pick(h0, h1, h2, h3, lane)
        z = w
        if OP == 1:
            z_cos, z_sin = _box_muller(tl.where(lane < 2, w0, w2), tl.where(lane < 2, w1, w3), CDT)
            z = tl.where((lane & 1) == 0, z_cos, z_sin)
        at = row_at + col.to(tl.int64) * BLOCK
        hi_j = tl.minimum(inner - col.to(tl.int64) * BLOCK, BLOCK).to(tl.int32)
        _emit(w, w_high, z, out_ptr + at, mask_ptr + at, in_ptr + at, a, a < hi_j,
              a_bits, b_bits, i_a, i_b, OP, BITS, CDT, BIG, MOD)


# --- host side --------------------------------------------------------------------------

_TL_CDT = {torch.float32: tl.float32, torch.float64: tl.float64}


def _bits(x: float) -> int:
    """The float64 bit pattern of ``x`` as a signed int64."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


@functools.lru_cache(maxsize=64)  # a host-side cost on every uniform launch otherwise
def _first_at_or_above(x: float, dtype: torch.dtype) -> float:
    """The least ``dtype`` value at or above ``x`` (inf if none): a uniform value rounded
    to ``dtype`` is ``>= x`` exactly when it is ``>=`` this, compared without widening."""
    t = torch.tensor(x, dtype=torch.float64).to(dtype)
    if t.item() < x:
        t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
    return t.item()


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

    grid: tuple[int, int]
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
    if out.numel() == 0:
        return []
    out_f = out.view(-1)
    mask_f = mask.view(-1) if mask is not None else out_f
    # The kernel's pointers are specialized on 16-byte alignment (the vectorized stores):
    # a source that starts mid-storage is copied, so every launch meets the one variant.
    src_f = source.view(-1) if source is not None else out_f
    if src_f.data_ptr() % 16:
        src_f = src_f.clone()
    if op == UNIFORM:
        i_a = _bits(_first_at_or_above(b, out.dtype))
    shape = _schedule(op, tuple(out.shape), tuple(strides), out.dtype, offset, _bits(a), _bits(b), i_a, i_b, big, mod,
                      _GRID_ROWS)
    return [Launch(grid, (out_f, mask_f, src_f, key, *scalars), constexprs) for grid, scalars, constexprs in shape]


@functools.lru_cache(maxsize=4096)  # the host's cost of a launch, paid once per op and layout
def _schedule(op: int, size: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype, offset: int,
              a_bits: int, b_bits: int, i_a: int, i_b: int, big: bool, mod: bool,
              grid_rows: int) -> tuple[tuple[tuple[int, int], tuple[int, ...], tuple[tuple[str, Any], ...]], ...]:
    """:func:`plan`'s launches without their tensors: ``(grid, scalar arguments,
    constexprs)`` each (floats as their float64 bits: a key that tells -0.0 from 0.0)."""
    dims = collapse(list(size), list(strides))
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
    fdtype = dtype if dtype.is_floating_point else torch.float32
    constexprs = (
        ("OP", op), ("BITS", stream.UNIFORM_BITS.get(fdtype, 24)), ("CDT", _TL_CDT[stream.compute_dtype(fdtype)]),
        ("BIG", big), ("MOD", mod), ("HIGH", op == RANDOM_BITS or big), ("CONTIG", contig), ("BLOCK", block),
    )
    if rows >= 2**31:  # the kernel's row arithmetic is 32-bit
        raise ValueError(f"compile_rng: a random op over {rows} rows of {inner} elements: at most 2**31 - 1 rows "
                         "(after merging contiguous dims) in one op; split the tensor")
    chunk = rows * inner
    launches = []
    # Dims beyond the kernel's: one launch per leading index, each on its slice of the
    # rows; and a launch per grid_rows rows (a grid's second dim holds no more).
    for n, idx in enumerate(itertools.product(*(range(s) for s, _ in lead))):
        lead_rel = sum(i * st for i, (_, st) in zip(idx, lead))
        for row0 in range(0, rows, grid_rows):
            scalars = (
                stream.as_int64(offset + lead_rel), n * chunk, inner, inner_stride,
                row0, outer[1][0], outer[2][0], outer[0][1], outer[1][1], outer[2][1],
                a_bits, b_bits, stream.as_int64(i_a), stream.as_int64(i_b),
            )
            launches.append(((col_programs, min(rows - row0, grid_rows)), scalars, constexprs))
    return tuple(launches)


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
