"""torch's own clients of its random ops, inside compile_rng's eager stream: every
``torch.distributions`` distribution's ``sample``/``rsample`` and ``torch.func.vmap``'s
randomness modes give stock torch's outcome (errors, shapes, dtypes; the samples in the
distribution's support), with compile_rng's values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import distributions as D

import compile_rng
from compile_rng.eager.dispatch_modes import eager_stream

P = torch.tensor([0.2, 0.5, 0.3])
A = torch.tensor([0.5, 2.0, 7.0])
COV = torch.tensor([[2.0, 0.3], [0.3, 1.0]])

DISTRIBUTIONS = {
    "Bernoulli": lambda: D.Bernoulli(probs=P),
    "Beta": lambda: D.Beta(A, A.flip(0)),
    "Binomial": lambda: D.Binomial(torch.tensor([5.0, 40.0, 900.0]), P),
    "Categorical": lambda: D.Categorical(probs=P),
    "Cauchy": lambda: D.Cauchy(A, A),
    "Chi2": lambda: D.Chi2(A),
    "ContinuousBernoulli": lambda: D.ContinuousBernoulli(probs=P),
    "Dirichlet": lambda: D.Dirichlet(A),
    "Exponential": lambda: D.Exponential(A),
    "FisherSnedecor": lambda: D.FisherSnedecor(A, A + 1),
    "Gamma": lambda: D.Gamma(A, A + 1),
    "Geometric": lambda: D.Geometric(probs=P),
    "Gumbel": lambda: D.Gumbel(A, A),
    "HalfCauchy": lambda: D.HalfCauchy(A),
    "HalfNormal": lambda: D.HalfNormal(A),
    "InverseGamma": lambda: D.InverseGamma(A, A + 1),
    "Kumaraswamy": lambda: D.Kumaraswamy(A, A + 1),
    "Laplace": lambda: D.Laplace(A, A),
    "LKJCholesky": lambda: D.LKJCholesky(3, 0.5),
    "LogNormal": lambda: D.LogNormal(A, A),
    "LogisticNormal": lambda: D.LogisticNormal(A, A),
    "LowRankMultivariateNormal": lambda: D.LowRankMultivariateNormal(torch.zeros(2), torch.ones(2, 1), torch.ones(2)),
    "Multinomial": lambda: D.Multinomial(10, probs=P),
    "MultivariateNormal": lambda: D.MultivariateNormal(torch.zeros(2), COV),
    "NegativeBinomial": lambda: D.NegativeBinomial(A, probs=P),
    "Normal": lambda: D.Normal(A, A),
    "OneHotCategorical": lambda: D.OneHotCategorical(probs=P),
    "Pareto": lambda: D.Pareto(A, A),
    "Poisson": lambda: D.Poisson(A * 10),
    "RelaxedBernoulli": lambda: D.RelaxedBernoulli(torch.tensor(0.5), probs=P),
    "RelaxedOneHotCategorical": lambda: D.RelaxedOneHotCategorical(torch.tensor(0.5), probs=P),
    "StudentT": lambda: D.StudentT(A),
    "Uniform": lambda: D.Uniform(A, A + 1),
    "VonMises": lambda: D.VonMises(A, A),
    "Weibull": lambda: D.Weibull(A, A),
    "Wishart": lambda: D.Wishart(torch.tensor(4.0), COV),
}


def _draws(dist):
    out = [dist.sample((64,))]
    if dist.has_rsample:
        out.append(dist.rsample((64,)))
    return out


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_distributions_sample_in_their_support(name):
    make = DISTRIBUTIONS[name]
    stock = _draws(make())
    compile_rng.manual_seed(3)
    with eager_stream():
        dist = make()
        mine = _draws(dist)
        before = compile_rng.get_state()
        again = _draws(dist)
    assert [(s.shape, s.dtype) for s in mine] == [(s.shape, s.dtype) for s in stock]
    for sample in mine:
        assert bool(dist.support.check(sample).all()), name
    assert compile_rng.get_state() != before  # drawn from the stream
    assert not all(torch.equal(a, b) for a, b in zip(mine, again))


def _vmapped(fn, randomness):
    x = torch.ones(4, 3)
    try:
        result = torch.func.vmap(fn, randomness=randomness)(x)
    except Exception as e:  # noqa: BLE001 - the outcome is compared
        return (type(e), str(e)), None
    return ("ok", tuple(result.shape), result.dtype), result


VMAPPED = {
    "rand_like": lambda t: torch.rand_like(t),
    "randn": lambda t: t + torch.randn(3),
    "dropout": lambda t: F.dropout(t, 0.5),
    "bernoulli_": lambda t: t.clone().bernoulli_(0.5),
    "normal_": lambda t: t.clone().normal_(),
    "randint": lambda t: t + torch.randint(0, 9, (3,)),
}


@pytest.mark.parametrize("randomness", ["error", "same", "different"])
@pytest.mark.parametrize("op", sorted(VMAPPED))
def test_vmap_randomness_modes(op, randomness):
    """``vmap``'s randomness: ``error`` raises torch's error, ``same`` draws one sample for
    the whole batch, ``different`` one per batch entry - as stock, from the stream."""
    fn = VMAPPED[op]
    stock, _ = _vmapped(fn, randomness)
    compile_rng.manual_seed(2)
    with eager_stream():
        mine, values = _vmapped(fn, randomness)
    assert mine == stock
    if values is not None:
        rows_equal = all(torch.equal(values[0], row) for row in values[1:])
        assert rows_equal == (randomness == "same")
