"""Rejection samplers on the canonical stream: ``poisson``, ``binomial``, ``standard_gamma``,
``dirichlet`` (``torch.ops.compile_rng.*``; docs/contract.md, "Samplers").

A rejection sampler needs a number of uniforms per element that depends on the values,
but an op's advance must not (ranks holding other rows must end at the same position).
So every element owns one counter ``n`` (the op's layout, as for ``uniform``) and takes
its uniforms from *draws* of that counter: draw ``j`` is the 64-bit value of counter
``n`` under the seed ``seed ^ C_j`` (``C_0 = 0``, ``C_j`` the first 8 bytes of
SHA-256(``"compile_rng/draw/v1" || 0 as 8 bytes || str(j)``), as :func:`~compile_rng.stream.named_seed`),
its uniform ``u = ((bits >> 11) + 0.5) * 2**-53`` in ``(0, 1)``, computed in float64.
Round ``r`` of a sampler that takes ``K`` uniforms a round uses draws ``first + r * K +
i``; an element keeps the value of its first accepted round. The op advances the stream
by ``ceil4`` of its elements, whatever the rounds.

Each sampler is torch's algorithm for that distribution (ATen's ``Distributions.h``:
Knuth/inversion below a threshold, Hormann's PTRS and BTRS above it, Marsaglia-Tsang for
gamma), with its uniforms taken as above; the values are compile_rng's, the distribution
torch's. Round 0 over the whole tensor uses the stream's ``random_bits`` kernel; the rounds
after it, for the few elements still pending, the same Philox in torch ops at those
elements' counters (any device).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from compile_rng import stream

DRAW_DOMAIN = b"compile_rng/draw/v1"
_U53 = 2.0**-53
_MAX_ROUNDS = 256  # far past any acceptance rate's tail; reached, the sampler raises


@functools.cache
def draw_constant(j: int) -> int:
    """``C_j`` (as an int64): draw ``j``'s seed is ``seed ^ C_j``."""
    return 0 if j == 0 else stream.as_int64(stream.named_seed(0, DRAW_DOMAIN, str(j)))


class Draws:
    """The uniforms a sampler's elements take: element ``idx`` of a ``size``-shaped result
    has counter ``base + offset + sum(idx * strides)`` under ``key``."""

    def __init__(self, key: torch.Tensor, offset: int, size: Sequence[int], strides: Sequence[int],
                 random_bits: Callable[..., torch.Tensor]):
        # random_bits: the stream's raw-values op (compile_rng.ops.random_bits), the kernel
        # of round 0 over the whole tensor
        self._random_bits = random_bits
        self.key, self.offset, self.size, self.strides = key, offset, list(size), list(strides)

    def _key(self, j: int) -> torch.Tensor:
        c = draw_constant(j)
        return self.key if c == 0 else self.key ^ torch.tensor([c, 0], dtype=torch.int64, device=self.key.device)

    def all(self, j: int) -> torch.Tensor:
        """Draw ``j``'s uniforms for every element, shaped ``size`` (float64)."""
        bits = self._random_bits(self._key(j), self.offset, self.size, self.strides)
        return _unit(bits)

    def at(self, j: int, flat: torch.Tensor) -> torch.Tensor:
        """Draw ``j``'s uniforms for the elements at row-major positions ``flat``."""
        rel = torch.full_like(flat, self.offset)
        rest = flat.clone()
        for extent, stride in zip(reversed(self.size), reversed(self.strides)):
            rel += (rest % extent) * stride
            rest //= extent
        return _unit(_bits_at(self._key(j), rel))


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """The uniform of 64-bit values: their top 53 bits, centred, in ``(0, 1)``."""
    return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64).add_(0.5).mul_(_U53)


def _bits_at(key: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """``random_bits`` at counters ``key[1] + rel``: the contract's Philox in torch ops."""
    m = stream.TENSOR_MATH
    seed, base = key[0], key[1]
    words = stream.key_words(m, seed)
    block_lo, block_hi, lane = stream.block_and_lane(m, base, rel)
    zero, one = torch.zeros_like(block_lo), torch.ones_like(block_lo)
    low = stream.philox_word(m, stream.philox4x32_10(m, [block_lo, block_hi, zero, zero], words), lane)
    high = stream.philox_word(m, stream.philox4x32_10(m, [block_lo, block_hi, one, zero], words), lane)
    return stream.random_bits(m, low, high)


# A sampler: (draws, parameters as float64 tensors shaped like the result) -> values (float64)
Sampler = Callable[..., torch.Tensor]


def rejection(draws: Draws, first: int, per_round: int, pending: torch.Tensor,
              round_: Callable[..., tuple[torch.Tensor, torch.Tensor]], *params: torch.Tensor) -> torch.Tensor:
    """Run ``round_(uniforms, *params) -> (accepted, values)`` for the elements where
    ``pending`` (a flat bool tensor), round after round, each element keeping its first
    accepted value; returns the values (flat, float64; 0 where never pending)."""
    out = torch.zeros(pending.shape, dtype=torch.float64, device=pending.device)
    flat = pending.nonzero().view(-1)
    for r in range(_MAX_ROUNDS):
        if flat.numel() == 0:
            return out
        js = range(first + r * per_round, first + (r + 1) * per_round)
        if r == 0 and flat.numel() == pending.numel():
            uniforms = [draws.all(j).view(-1) for j in js]
        else:
            uniforms = [draws.at(j, flat) for j in js]
        accepted, values = round_(uniforms, *(p[flat] for p in params))
        out[flat[accepted]] = values[accepted]
        flat = flat[~accepted]
    raise RuntimeError(f"compile_rng: a rejection sampler did not accept within {_MAX_ROUNDS} rounds; please report it")


def _cdf_walk(u: torch.Tensor, first_pmf: torch.Tensor, ratio: Callable[[torch.Tensor], torch.Tensor],
              cap: torch.Tensor) -> torch.Tensor:
    """Inversion by one uniform: the least ``k`` with ``u <= F(k)``, walking the pmf by
    ``pmf(k + 1) = pmf(k) * ratio(k)``, at most ``cap`` (float64 tensors)."""
    k = torch.zeros_like(u)
    pmf = first_pmf.clone()
    cdf = pmf.clone()
    active = (u > cdf) & (k < cap)
    while bool(active.any()):
        pmf = torch.where(active, pmf * ratio(k), pmf)
        k = torch.where(active, k + 1, k)
        cdf = torch.where(active, cdf + pmf, cdf)
        active = active & (u > cdf) & (k < cap)
    return k


# --- poisson: Knuth's region by inversion, PTRS (Hormann 1993) from rate 10, as ATen -------


def _ptrs_round(uniforms: list[torch.Tensor], lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u_, v = uniforms
    slam, loglam = lam.sqrt(), lam.log()
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    invalpha = 1.1239 + 1.1328 / (b - 3.4)
    vr = 0.9277 - 3.6224 / (b - 2)
    u = u_ - 0.5
    us = 0.5 - u.abs()
    k = torch.floor((2 * a / us + b) * u + lam + 0.43)
    quick = (us >= 0.07) & (v <= vr)
    bad = (k < 0) | ((us < 0.013) & (v > us))
    test = (v.log() + invalpha.log() - (a / (us * us) + b).log()) <= (-lam + k * loglam - torch.lgamma(k + 1))
    return quick | (~bad & test), k


def poisson_values(draws: Draws, lam: torch.Tensor) -> torch.Tensor:
    """Poisson counts of rates ``lam`` (float64, shaped like the result)."""
    flat = lam.reshape(-1)
    out = torch.zeros_like(flat)
    small = (flat > 0) & (flat < 10)
    if bool(small.any()):
        idx = small.nonzero().view(-1)
        u = draws.all(0).view(-1)[idx] if idx.numel() == flat.numel() else draws.at(0, idx)
        rate = flat[idx]
        out[idx] = _cdf_walk(u, torch.exp(-rate), lambda k: rate / (k + 1), torch.full_like(rate, math.inf))
    big = flat >= 10
    if bool(big.any()):
        out = torch.where(big, rejection(draws, 1, 2, big, _ptrs_round, flat), out)
    return out.view(lam.shape)


# --- binomial: inversion below count * p = 10, BTRS (Hormann 1993) above, as ATen ----------


def _stirling_tail(k: torch.Tensor) -> torch.Tensor:
    """``log(k!) - (k + 1/2) log(k + 1) + (k + 1) - log(sqrt(2 pi))`` (ATen's table below 10)."""
    table = torch.tensor([
        0.08106146679532726, 0.04134069595540929, 0.02767792568499834, 0.02079067210376509,
        0.01664469118982119, 0.01387612882307075, 0.01189670994589177, 0.01041126526197209,
        0.009255462182712733, 0.008330563433362871,
    ], dtype=torch.float64, device=k.device)
    kp1 = k + 1
    kp1sq = kp1 * kp1
    series = (1.0 / 12 - (1.0 / 360 - 1.0 / 1260 / kp1sq) / kp1sq) / kp1
    return torch.where(k <= 9, table[k.clamp(0, 9).long()], series)


def _btrs_round(uniforms: list[torch.Tensor], n: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u_, v = uniforms
    stddev = (n * p * (1 - p)).sqrt()
    b = 1.15 + 2.53 * stddev
    a = -0.0873 + 0.0248 * b + 0.01 * p
    c = n * p + 0.5
    v_r = 0.92 - 4.2 / b
    r = p / (1 - p)
    alpha = (2.83 + 5.1 / b) * stddev
    m = torch.floor((n + 1) * p)
    u = u_ - 0.5
    us = 0.5 - u.abs()
    k = torch.floor((2 * a / us + b) * u + c)
    bad = (k < 0) | (k > n)
    quick = (us >= 0.07) & (v <= v_r)
    lv = (v * alpha / (a / (us * us) + b)).log()
    upper = (
        (m + 0.5) * ((m + 1) / (r * (n - m + 1))).log()
        + (n + 1) * ((n - m + 1) / (n - k + 1)).log()
        + (k + 0.5) * (r * (n - k + 1) / (k + 1)).log()
        + _stirling_tail(m) + _stirling_tail(n - m) - _stirling_tail(k) - _stirling_tail(n - k)
    )
    return ~bad & (quick | (lv <= upper)), k


def binomial_values(draws: Draws, count: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """Binomial counts of ``count`` trials with success probability ``prob`` (float64)."""
    n, p = count.reshape(-1), prob.reshape(-1)
    flip = p > 0.5
    q = torch.where(flip, 1 - p, p)  # sample the rarer outcome, as ATen does
    out = torch.zeros_like(n)
    live = (n > 0) & (p > 0) & (p < 1)
    small = live & (n * q < 10)
    if bool(small.any()):
        idx = small.nonzero().view(-1)
        u = draws.all(0).view(-1)[idx] if idx.numel() == n.numel() else draws.at(0, idx)
        ni, qi = n[idx], q[idx]
        out[idx] = _cdf_walk(u, torch.exp(ni * torch.log1p(-qi)), lambda k: (ni - k) / (k + 1) * qi / (1 - qi), ni)
    big = live & ~small
    if bool(big.any()):
        out = torch.where(big, rejection(draws, 1, 2, big, _btrs_round, n, q), out)
    out = torch.where(flip & live, n - out, out)
    return torch.where(live, out, torch.where((p >= 1) & (n > 0), n, torch.zeros_like(n))).view(count.shape)


# --- gamma: Marsaglia-Tsang, boosted below alpha 1, as ATen -------------------------------


def _gamma_round(uniforms: list[torch.Tensor], d: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u1, u2, u3 = uniforms
    x = (-2 * u1.log()).sqrt() * torch.cos(2 * math.pi * u2)
    y = 1 + c * x
    v = y * y * y
    xx = x * x
    accept = (y > 0) & ((u3 < 1 - 0.0331 * xx * xx) | (u3.log() < 0.5 * xx + d * (1 - v + v.clamp(min=1e-300).log())))
    return accept, d * v


def gamma_values(draws: Draws, alpha: torch.Tensor) -> torch.Tensor:
    """Standard gamma samples of shapes ``alpha`` (float64): draw 0 boosts ``alpha < 1``
    (``* u ** (1 / alpha)``), rounds of three uniforms from draw 1 (a Box-Muller normal and
    the acceptance uniform)."""
    a = alpha.reshape(-1)
    boost = a < 1
    scale = torch.ones_like(a)
    if bool(boost.any()):
        scale = torch.where(boost, draws.all(0).view(-1).pow(1 / a.clamp(min=1e-300)), scale)
    shape = torch.where(boost, a + 1, a)
    d = shape - 1.0 / 3
    c = 1 / (9 * d).sqrt()
    live = a > 0
    values = rejection(draws, 1, 3, live, _gamma_round, d, c) * scale
    return torch.where(live, values, torch.zeros_like(values)).view(alpha.shape)
