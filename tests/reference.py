"""Independent scalar pure-Python reference for canonical stream v1.

Written from the Random123 definition and docs/contract.md §4-§5 only: no torch, no code
shared with compile_rng. Slow on purpose; tests use it on small tensors.
"""

from __future__ import annotations

import math

M32 = 0xFFFFFFFF

#: Random123's known answers for philox4x32_10 (kat_vectors): (counter, key, output)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def block(seed: int, n: int, c2: int = 0) -> tuple[int, ...]:
    b = (n % 2**64) >> 2
    return philox4x32_10((b & M32, b >> 32, c2, 0), (seed & M32, seed >> 32))


def word(seed: int, n: int, c2: int = 0) -> int:
    return block(seed, n, c2)[n % 4]


UNIFORM_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 32}


def uniform01(seed: int, n: int, dtype: str) -> float:
    m = UNIFORM_BITS[dtype]
    return (word(seed, n) >> (32 - m)) * 2.0**-m


def normal_std(seed: int, n: int) -> float:
    """The exact-math standard normal (float64 transcendental functions)."""
    lane = n % 4
    w = block(seed, n)
    p = lane >> 1
    u1 = (w[2 * p] + 1) * 2.0**-32
    u2 = w[2 * p + 1] * 2.0**-32
    r = math.sqrt(-2.0 * math.log(u1))
    return r * (math.cos(2 * math.pi * u2) if lane % 2 == 0 else math.sin(2 * math.pi * u2))


def exponential(seed: int, n: int, lambd: float) -> float:
    return -math.log((word(seed, n) + 1) * 2.0**-32) / lambd


def keep_bernoulli(seed: int, n: int, p: float) -> bool:
    return word(seed, n) * 2.0**-32 < p


def randint(seed: int, n: int, low: int, high: int) -> int:
    r = high - low
    w = word(seed, n)
    if r > 2**32:
        w = ((word(seed, n, c2=1) & 0x7FFFFFFF) << 32) | w
    return low + w % r


def bits64(seed: int, n: int) -> int:
    v = (word(seed, n, c2=1) << 32) | word(seed, n)
    return v - 2**64 if v >= 2**63 else v


def counters(base: int, size: list[int], strides: list[int]) -> list[int]:
    """Row-major list of counters of a ``size``-shaped output."""
    out = [base]
    for s, st in zip(size, strides):
        out = [c + i * st for c in out for i in range(s)]
    return [c % 2**64 for c in out]
