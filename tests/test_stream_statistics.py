"""Statistical sanity on 1M samples (fixed seeds: deterministic, but a broken
transform or a correlated stream fails these bounds)."""

import math

import pytest
import torch

from compile_rng import ops

# statistics of compile_rng's own kernels: the same on every torch version
pytestmark = pytest.mark.torch_independent

N = 1 << 20


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    x, _ = samples.double().sort()
    f = cdf(x)
    n = x.numel()
    upper = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    lower = f - torch.arange(0, n, dtype=torch.float64) / n
    return float(torch.maximum(upper, lower).max())


KS_CRITICAL = 1.95 / math.sqrt(N)  # alpha = 0.001


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_moments_and_ks(dtype):
    u = ops.uniform(ops.make_key(2024, 0), 0, [N], [1], 0.0, 1.0, dtype).double()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert abs(float(u.var()) - 1 / 12) < 5e-4
    assert ks_statistic(u, lambda x: x) < KS_CRITICAL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_moments_and_ks(dtype):
    z = ops.normal(ops.make_key(2024, 12345), 0, [N], [1], 0.0, 1.0, dtype).double()
    assert abs(float(z.mean())) < 5 / math.sqrt(N)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / N)
    assert ks_statistic(z, torch.special.ndtr) < KS_CRITICAL
    # cos and sin lanes of one block must be uncorrelated
    pairs = z.view(-1, 4)
    corr = torch.corrcoef(torch.stack([pairs[:, 0], pairs[:, 1]]))[0, 1]
    assert abs(float(corr)) < 5 / math.sqrt(N / 4)


def test_exponential_ks():
    e = ops.exponential(ops.make_key(7, 0), 0, [N], [1], 2.0, torch.float32)
    assert ks_statistic(e, lambda x: 1 - torch.exp(-2.0 * x)) < KS_CRITICAL


def test_bernoulli_rate():
    b = ops.bernoulli(ops.make_key(9, 0), 0, [N], [1], 0.3, torch.float32)
    assert abs(float(b.mean()) - 0.3) < 5 * math.sqrt(0.3 * 0.7 / N)


def test_randint_uniform_over_range():
    r = ops.randint(ops.make_key(9, 0), 0, [N], [1], -3, 7, torch.int64)
    counts = torch.bincount(r + 3, minlength=10).double()
    chi2 = float(((counts - N / 10) ** 2 / (N / 10)).sum())
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
