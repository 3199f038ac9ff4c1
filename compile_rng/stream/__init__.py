"""Canonical stream v1: the contract every compile_rng implementation follows
(docs/contract.md §4-§5).

Every element of every random op owns a 64-bit counter ``n``. Its value is a pure
function of ``(seed, n)`` and the op's parameters:

* key ``(seed & 0xffffffff, seed >> 32)``; block ``b = n >> 2``, lane ``l = n & 3``;
  ``W = Philox4x32-10(key, (b & 0xffffffff, b >> 32, c2, 0))`` with ``c2 = 0``;
  the element's word is ``W[l]``.
* ``uniform`` of a float dtype with ``m`` significand bits (fp32 24, fp16 11, bf16 8,
  fp64 32): ``u = (W[l] >> (32 - m)) * 2**-m``, exact, in ``[0, 1)``. With bounds,
  ``v = u * (high - low) + low`` in the compute dtype (fp32 for fp32/fp16/bf16, fp64 for
  fp64; separate multiply and add), rounded once to the dtype; a ``v >= high`` produced
  by rounding is mapped to ``low`` (as ATen does) so the result stays in ``[low, high)``.
* ``normal``: Box-Muller on ``(W[2p], W[2p+1])``, ``p = l >> 1``; ``u1 = (W[2p] + 1) *
  2**-32`` in ``(0, 1]``, ``u2 = W[2p+1] * 2**-32``; ``z = sqrt(-2 ln u1) * (cos | sin)(2
  pi u2)``, cos for even lanes, sin for odd; ``z * std + mean`` in the compute dtype.
* ``exponential(lambd)``: ``ln(u1) * (-1 / lambd)`` with ``u1 = (W[l] + 1) * 2**-32``.
* ``bernoulli(p)``, scalar ``p``: ``W[l] < ceil(p * 2**32)``, i.e. ``uniform32 < p`` with
  the 32-bit uniform ``W[l] * 2**-32`` for every output dtype (masks do not depend on
  the activation dtype). Tensor ``p``: the same comparison done exactly in fp64.
* ``dropout(p)``: keep iff ``W[l] < ceil((1 - p) * 2**32)``; kept values are
  ``x * s`` in the compute dtype, rounded once, with ``s = 1 / (1 - p)`` divided in the
  compute dtype and rounded to the dtype (ATen's CPU dropout composite rounds it so);
  ``p == 1`` drops everything.
* integers in ``[low, high)``, ``r = high - low``: ``W[l] mod r`` if ``r <= 2**32``,
  else ``((H & 0x7fffffff) * 2**32 + W[l]) mod r`` where ``H`` is the same lane of the
  block with ``c2 = 1`` (an independent block, so no counter is shared with another
  element); ``r <= 2**63``. Raw 64-bit values: ``H * 2**32 + W[l]`` as a two's
  complement int64.

The transforms below are written once against a small arithmetic protocol and run both
on torch tensors (eager kernels) and on Inductor's ``ops`` (compiled lowerings), so the
two cannot drift apart. Philox itself has two independent implementations (C for
eager, :func:`philox4x32_10` here for Inductor), both pinned by the tests against a
scalar pure-Python reference and the Random123 known-answer vectors.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

#: The version of this contract. A saved stream position (``compile_rng.state_dict``)
#: records it: the same position under another version draws other numbers.
STREAM_VERSION = 1
MASK32 = 0xFFFFFFFF
UINT64 = 2**64
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10

UNIFORM_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 32}
FLOAT_DTYPES = tuple(UNIFORM_BITS)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def ceil4(n: Any) -> Any:
    """The per-op counter advance for ``n`` elements (works on ints and SymInts)."""
    return (n + 3) // 4 * 4


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float arithmetic happens in fp64 for fp64 outputs, else in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def threshold32(p: float) -> int:
    """``ceil(p * 2**32)``: ``W < threshold32(p)`` iff ``W * 2**-32 < p`` (exact)."""
    return math.ceil(p * 2**32)


class Math(Protocol):
    """The arithmetic the transforms need; implemented for tensors and Inductor ops."""

    #: Whether int32 arithmetic wraps and an int64 product may overflow, wrapping (Triton's
    #: code: LLVM's integer ops carry no overflow flags). Then Philox runs on int32 words,
    #: one 64-bit product per multiply (sm_90: one ``IMAD.WIDE.U32``); else (C++, whose signed
    #: overflow is undefined; torch tensors) on int64 words, products split on 16 bits.
    wraps: bool

    def const(self, value: float | int, dtype: torch.dtype) -> Any: ...
    def cast(self, x: Any, dtype: torch.dtype) -> Any: ...
    def add(self, a: Any, b: Any) -> Any: ...
    def sub(self, a: Any, b: Any) -> Any: ...
    def mul(self, a: Any, b: Any) -> Any: ...
    def mod(self, a: Any, b: Any) -> Any: ...
    def shr(self, a: Any, b: Any) -> Any: ...
    def band(self, a: Any, b: Any) -> Any: ...
    def bor(self, a: Any, b: Any) -> Any: ...
    def bxor(self, a: Any, b: Any) -> Any: ...
    def lt(self, a: Any, b: Any) -> Any: ...
    def ge(self, a: Any, b: Any) -> Any: ...
    def eq(self, a: Any, b: Any) -> Any: ...
    def where(self, c: Any, a: Any, b: Any) -> Any: ...
    def log(self, a: Any) -> Any: ...
    def sqrt(self, a: Any) -> Any: ...
    def cos(self, a: Any) -> Any: ...
    def sin(self, a: Any) -> Any: ...


class TensorMath:
    """:class:`Math` on torch tensors (used by the eager kernels)."""

    wraps = False

    def const(self, value, dtype):
        return torch.tensor(value, dtype=dtype)

    def cast(self, x, dtype):
        return x.to(dtype)

    add = staticmethod(torch.add)
    sub = staticmethod(torch.sub)
    mul = staticmethod(torch.mul)
    mod = staticmethod(torch.remainder)
    shr = staticmethod(torch.bitwise_right_shift)
    band = staticmethod(torch.bitwise_and)
    bor = staticmethod(torch.bitwise_or)
    bxor = staticmethod(torch.bitwise_xor)
    lt = staticmethod(torch.lt)
    ge = staticmethod(torch.ge)
    eq = staticmethod(torch.eq)
    where = staticmethod(torch.where)
    log = staticmethod(torch.log)
    sqrt = staticmethod(torch.sqrt)
    cos = staticmethod(torch.cos)
    sin = staticmethod(torch.sin)


#: the one :class:`TensorMath` (it holds no state) every eager caller shares
TENSOR_MATH = TensorMath()


# --- Philox on the Math protocol (int64 values holding uint32 words) -----------------


def key_words(m: Math, seed: Any) -> tuple[Any, Any]:
    """The Philox key ``(seed & 0xffffffff, seed >> 32)`` of a uint64 seed held in an int64."""
    i64 = torch.int64
    return m.band(seed, m.const(MASK32, i64)), m.band(m.shr(seed, m.const(32, i64)), m.const(MASK32, i64))


def block_and_lane(m: Math, base: Any, rel: Any) -> tuple[Any, Any, Any]:
    """``(block_lo, block_hi, lane)`` of counter ``n = base + rel`` (mod 2**64): block
    ``n >> 2`` as two 32-bit words, lane ``n & 3``. ``base`` is a uint64 in an int64 and
    ``rel`` a non-negative int64; the sum is carried through 32-bit halves, so no int64
    addition overflows (where :attr:`Math.wraps`, one wrapping 64-bit add)."""
    i64 = torch.int64
    c = lambda v: m.const(v, i64)  # noqa: E731
    if m.wraps:  # one wrapping 64-bit add; the shift's sign bits masked off
        n = m.add(base, rel)
        block = m.band(m.shr(n, c(2)), c((1 << 62) - 1))
        return m.band(block, c(MASK32)), m.shr(block, c(32)), m.band(n, c(3))
    lo = m.add(m.band(base, c(MASK32)), m.band(rel, c(MASK32)))
    hi = m.add(m.band(m.shr(base, c(32)), c(MASK32)), m.shr(rel, c(32)))
    hi = m.band(m.add(hi, m.shr(lo, c(32))), c(MASK32))
    lo = m.band(lo, c(MASK32))
    block_lo = m.bor(m.shr(lo, c(2)), m.mul(m.band(hi, c(3)), c(1 << 30)))
    return block_lo, m.shr(hi, c(2)), m.band(lo, c(3))


def _mulhilo(m: Math, x: Any, multiplier: int) -> tuple[Any, Any]:
    """``(hi, lo)`` words of ``x * multiplier`` with no int64 product above 2**48.

    A direct int64 product of two 32-bit words can exceed 2**63; signed overflow is
    undefined behaviour in the C++ Inductor emits, so the product is split on 16 bits.
    """
    i64 = torch.int64
    p_lo = m.mul(m.band(x, m.const(0xFFFF, i64)), m.const(multiplier, i64))
    p_hi = m.mul(m.shr(x, m.const(16, i64)), m.const(multiplier, i64))
    lo = m.band(
        m.add(p_lo, m.mul(m.band(p_hi, m.const(0xFFFF, i64)), m.const(1 << 16, i64))),
        m.const(MASK32, i64),
    )
    hi = m.shr(m.add(p_hi, m.shr(p_lo, m.const(16, i64))), m.const(16, i64))
    return hi, lo


def _as_int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _zero_extended(m: Math, w: Any) -> Any:
    """An int32 word as the int64 in ``[0, 2**32)`` holding the same bits."""
    return m.band(m.cast(w, torch.int64), m.const(MASK32, torch.int64))


def _mulhilo_wrapping(m: Math, x: Any, multiplier: int) -> tuple[Any, Any]:
    """``(hi, lo)`` int32 words of ``x * multiplier`` from one wrapping int64 product of the
    zero-extended word (where :attr:`Math.wraps`)."""
    p = m.mul(_zero_extended(m, x), m.const(multiplier, torch.int64))
    return m.cast(m.shr(p, m.const(32, torch.int64)), torch.int32), m.cast(p, torch.int32)


def philox4x32_10(m: Math, ctr: list[Any], key: tuple[Any, Any]) -> list[Any]:
    """Philox4x32-10 on four counter words and two key words (int64 in [0, 2**32)).

    The words it returns are int64 in ``[0, 2**32)``, or, where :attr:`Math.wraps`, int32
    holding the same bits (:func:`philox_word` selects and widens them)."""
    if m.wraps:
        ctr, key = [m.cast(w, torch.int32) for w in ctr], tuple(m.cast(w, torch.int32) for w in key)
        mulhilo = _mulhilo_wrapping
        bump = lambda k, w: m.add(k, m.const(_as_int32(w), torch.int32))  # noqa: E731
    else:
        mulhilo = _mulhilo
        bump = lambda k, w: m.band(m.add(k, m.const(w, torch.int64)), m.const(MASK32, torch.int64))  # noqa: E731
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = bump(k0, PHILOX_W0), bump(k1, PHILOX_W1)
        hi0, lo0 = mulhilo(m, c0, PHILOX_M0)
        hi1, lo1 = mulhilo(m, c2, PHILOX_M1)
        c0, c1, c2, c3 = m.bxor(m.bxor(hi1, c1), k0), lo1, m.bxor(m.bxor(hi0, c3), k1), lo0
    return [c0, c1, c2, c3]


def philox_word(m: Math, words: Sequence[Any], lane: Any) -> Any:
    """``words[lane]`` of a :func:`philox4x32_10` block, ``lane`` an int64 in ``[0, 4)``, as
    an int64 in ``[0, 2**32)`` (selected in int32 and widened once, where :attr:`Math.wraps`)."""
    dt = torch.int32 if m.wraps else torch.int64
    lane = m.cast(lane, dt) if m.wraps else lane
    out = words[-1]
    for i in range(len(words) - 2, -1, -1):
        out = m.where(m.eq(lane, m.const(i, dt)), words[i], out)
    return _zero_extended(m, out) if m.wraps else out


# --- transforms: stream words -> values ------------------------------------------------


def uniform(m: Math, w: Any, dtype: torch.dtype, low: float, high: float) -> Any:
    bits = UNIFORM_BITS[dtype]
    cdt = compute_dtype(dtype)
    u = m.mul(m.cast(m.shr(w, m.const(32 - bits, torch.int64)), cdt), m.const(2.0**-bits, cdt))
    if low == 0.0 and high == 1.0:
        # rand's bounds: u * 1 + 0 is u, exact in the dtype (it has `bits` bits) and below 1,
        # so the scaling and the check for `high` are the identity: left out of every graph
        return m.cast(u, dtype)
    v = m.cast(m.add(m.mul(u, m.const(high - low, cdt)), m.const(low, cdt)), dtype)
    hit_high = m.ge(m.cast(v, torch.float64), m.const(high, torch.float64))
    return m.where(hit_high, m.cast(m.const(low, cdt), dtype), v)


def _open_unit(m: Math, w: Any, cdt: torch.dtype) -> Any:
    """``(w + 1) * 2**-32`` in ``(0, 1]``: safe to take the log of."""
    return m.mul(m.cast(m.add(w, m.const(1, torch.int64)), cdt), m.const(2.0**-32, cdt))


def normal(
    m: Math, w_even: Any, w_odd: Any, lane: Any, dtype: torch.dtype, mean: float, std: float
) -> Any:
    cdt = compute_dtype(dtype)
    radius = m.sqrt(m.mul(m.log(_open_unit(m, w_even, cdt)), m.const(-2.0, cdt)))
    angle = m.mul(m.mul(m.cast(w_odd, cdt), m.const(2.0**-32, cdt)), m.const(2 * math.pi, cdt))
    even = m.eq(m.band(lane, m.const(1, torch.int64)), m.const(0, torch.int64))
    z = m.mul(radius, m.where(even, m.cos(angle), m.sin(angle)))
    return m.cast(m.add(m.mul(z, m.const(std, cdt)), m.const(mean, cdt)), dtype)


def exponential(m: Math, w: Any, dtype: torch.dtype, lambd: float) -> Any:
    cdt = compute_dtype(dtype)
    return m.cast(m.mul(m.log(_open_unit(m, w, cdt)), m.const(-1.0 / lambd, cdt)), dtype)


def bernoulli_scalar(m: Math, w: Any, dtype: torch.dtype, p: float) -> Any:
    return m.cast(m.lt(w, m.const(threshold32(p), torch.int64)), dtype)


def bernoulli_tensor(m: Math, w: Any, p: Any, dtype: torch.dtype) -> Any:
    f64 = torch.float64
    u = m.mul(m.cast(w, f64), m.const(2.0**-32, f64))
    return m.cast(m.lt(u, m.cast(p, f64)), dtype)


def dropout_keep(m: Math, w: Any, p: float) -> Any:
    return m.lt(w, m.const(threshold32(1.0 - p), torch.int64))


def dropout_scale(p: float, dtype: torch.dtype) -> float:
    """``1 / (1 - p)`` rounded as ATen's CPU dropout rounds it: divided in the compute
    dtype, stored in ``dtype`` (so eager DTensor dropout, which runs ATen's
    ``bernoulli_``/``div_``/``mul`` composite, gives the same bits)."""
    return keep_scale(1.0 - p, dtype)


@functools.lru_cache(maxsize=256)  # two tensor ops per call: a third of a small eager dropout's cost
def keep_scale(keep: float, dtype: torch.dtype) -> float:
    """:func:`dropout_scale` from the keep probability ``1 - p``."""
    if keep == 0.0:
        return 0.0
    cdt = compute_dtype(dtype)
    return float((torch.tensor(1.0, dtype=cdt) / torch.tensor(keep, dtype=cdt)).to(dtype))


def dropout_apply(m: Math, x: Any, keep: Any, dtype: torch.dtype, p: float) -> Any:
    cdt = compute_dtype(dtype)
    kept = m.mul(m.cast(x, cdt), m.cast(keep, cdt))
    return m.cast(m.mul(kept, m.const(dropout_scale(p, dtype), cdt)), dtype)


def needs_high_word(low: int, high: int) -> bool:
    return high - low > 2**32


def randint(m: Math, w: Any, w_high: Any | None, dtype: torch.dtype, low: int, high: int) -> Any:
    i64 = torch.int64
    span = high - low
    if needs_high_word(low, high):
        hi31 = m.band(w_high, m.const(0x7FFFFFFF, i64))
        w = m.add(m.mul(hi31, m.const(2**32, i64)), w)
    if span < 2**63:  # a span of exactly 2**63 keeps all 63 bits
        w = m.mod(w, m.const(span, i64))
    return m.cast(m.add(w, m.const(low, i64)), dtype)


def random_bits(m: Math, w: Any, w_high: Any) -> Any:
    i64 = torch.int64
    top = m.ge(w_high, m.const(2**31, i64))
    signed_high = m.sub(w_high, m.where(top, m.const(2**32, i64), m.const(0, i64)))
    return m.add(m.mul(signed_high, m.const(2**32, i64)), w)


def as_uint64(v: int) -> int:
    """``v`` modulo 2**64: a seed or counter read back from its int64 storage."""
    return int(v) % UINT64


def as_int64(v: int) -> int:
    """The int64 (two's complement) that stores the uint64 ``v`` in a key tensor."""
    v = as_uint64(v)
    return v - UINT64 if v >= 2**63 else v


def named_seed(seed: int, domain: bytes, name: str) -> int:
    """The 64-bit seed of the stream called ``name`` under ``seed``: the first 8 bytes
    (little endian) of SHA-256(``domain || seed as 8 bytes || name as UTF-8``). Per-name
    streams (parameters by FQN, activations by module and op) are independent of the
    order the program draws in; ``domain`` keeps the kinds of names apart."""
    digest = hashlib.sha256(domain + seed.to_bytes(8, "little") + name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def contiguous_stream(size: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether element ``i`` (row-major) has counter ``base + i``: the layout of a fresh
    replica, and the one the vectorized kernels serve."""
    expected = 1
    for i in range(len(size) - 1, -1, -1):
        if size[i] != 1 and strides[i] != expected:
            return False
        expected *= size[i]
    return True


def contiguous_strides(shape: Sequence[Any]) -> list:
    """Row-major strides of ``shape``: element ``idx`` of a replica has counter
    ``base + sum(idx * strides)`` (ints or SymInts)."""
    strides, acc = [1] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc = acc * shape[i]
    return strides


# --- the implementations of this contract ---------------------------------------------


@dataclass(frozen=True)
class Implementation:
    """One implementation of canonical stream v1 (as JAX's ``PRNGImpl`` records one of its
    PRNGs). Every implementation provides the functional ops ``torch.ops.compile_rng.*``
    (``uniform``, ``normal``, ``exponential``, ``bernoulli``, ``bernoulli_tensor``,
    ``dropout``, ``randint``, ``random_bits``) with the values this module defines.
    ``tests/test_stream_conformance.py`` runs every entry of :data:`IMPLEMENTATIONS`
    against the scalar pure-Python reference; a new backend (Triton) adds one."""

    name: str
    #: ``(size, counter strides)`` layouts that select this implementation
    layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    #: ``run(fn)``: ``fn`` (which calls the functional ops) made to run on this implementation
    run: Callable[[Callable[..., Any]], Callable[..., Any]]
    #: the optional package it needs, if any
    requires: str | None = None


#: Every registered implementation, in registration order: each implementation module
#: registers its own entries when it is imported (this module imports none of them).
IMPLEMENTATIONS: list[Implementation] = []


def register_implementation(impl: Implementation) -> None:
    """Add ``impl`` to :data:`IMPLEMENTATIONS` (once per name)."""
    if all(i.name != impl.name for i in IMPLEMENTATIONS):
        IMPLEMENTATIONS.append(impl)
