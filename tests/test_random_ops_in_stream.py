"""Every random op torch has, inside a stream: what torch accepts, refuses and returns.

Inside a stream compile_rng replaces torch's random ops. These tests pin that, for each
op, the stream accepts and refuses exactly what torch does (torch's own exception, its
type and message: the reference is stock torch run on the same call; a refused call
leaves the stream where it was), returns torch's
dtype, layout and memory format, writes ``out=`` as torch does, and draws the ops torch
has no counter-based form for in compile_rng (``randperm``, ``multinomial``,
``poisson``, ``binomial``, ``_standard_gamma``, ``_sample_dirichlet``): their values are
documented functions of the counters (checked against an independent composition of the
stream's own ops), their distributions pass chi-square / KS tests, their rows in a step
do not depend on how the batch is split, and compiled graphs draw the eager values.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import reference as ref
import torch
from helpers import f32, ulp_distance

import compile_rng
from compile_rng import ops
from compile_rng.eager.dispatch_modes import eager_stream
from compile_rng.launch import spawn


def _outcome(fn):
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is compared, whatever it is
        return type(e), str(e)
    return "ok", tuple(result.shape), result.dtype, result.stride()


REFUSED = {
    "cauchy sigma=0": lambda: torch.empty(3).cauchy_(0, 0),
    "uniform range past float32": lambda: torch.empty(3).uniform_(-3e38, 3e38),
    "uniform to=inf": lambda: torch.empty(3).uniform_(0, math.inf),
    "uniform from > to": lambda: torch.empty(3).uniform_(3, 2),
    "normal std < 0": lambda: torch.empty(3).normal_(0, -1),
    "normal tensor std < 0": lambda: torch.normal(torch.zeros(3), -torch.ones(3)),
    "normal tensor mean, std < 0": lambda: torch.normal(torch.zeros(3), -1.0),
    "normal tensor mean, std nan": lambda: torch.normal(torch.zeros(3), math.nan),
    "normal tensor mean, std < 0, out": lambda: torch.normal(torch.zeros(3), -1.0, out=torch.empty(3)),
    "normal std tensor with nan": lambda: torch.normal(0.0, torch.tensor([1.0, math.nan])),
    "exponential lambd < 0": lambda: torch.empty(3).exponential_(-1),
    "log_normal std = 0": lambda: torch.empty(3).log_normal_(0, 0),
    "geometric p = 1": lambda: torch.empty(3).geometric_(1),
    "bernoulli p = 2": lambda: torch.empty(3).bernoulli_(2.0),
    "bernoulli tensor p = 2": lambda: torch.bernoulli(torch.full((3,), 2.0)),
    "random_ int8 to 1000": lambda: torch.empty(3, dtype=torch.int8).random_(0, 1000),
    "randint empty range": lambda: torch.randint(3, 3, (2,)),
    "rand int64": lambda: torch.rand(3, dtype=torch.int64),
    "randn int64": lambda: torch.randn(3, dtype=torch.int64),
    "multinomial without replacement, too many": lambda: torch.multinomial(torch.ones(2, 3), 4),
    "multinomial negative weight": lambda: torch.multinomial(torch.tensor([1.0, -1.0]), 1),
    "poisson negative rate": lambda: torch.poisson(torch.tensor([-1.0])),
    "rrelu float16 on CPU": lambda: torch.nn.functional.rrelu(torch.ones(3, dtype=torch.float16), training=True),
    "rrelu lower > upper": lambda: torch.nn.functional.rrelu(torch.ones(3), 0.5, 0.1, training=True),
    "rrelu_with_noise noise shape": lambda: torch.ops.aten.rrelu_with_noise(torch.ones(4, 3), torch.zeros(3),
                                                                            0.1, 0.3, True),
    "rrelu_with_noise noise dtype": lambda: torch.ops.aten.rrelu_with_noise(
        torch.ones(4, 3), torch.zeros(4, 3, dtype=torch.float64), 0.1, 0.3, True),
    "rrelu_with_noise int64": lambda: torch.ops.aten.rrelu_with_noise(
        torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 0.1, 0.3, True),
    # what torch's kernels refuse by dtype, shape or memory before they draw
    "bernoulli int64 p": lambda: torch.bernoulli(torch.ones(3, dtype=torch.int64)),
    "bernoulli_ tensor p = 2": lambda: torch.empty(3).bernoulli_(torch.tensor([0.5, 2.0, 0.1])),
    "bernoulli_ tensor p of another shape": lambda: torch.empty(3).bernoulli_(torch.full((4,), 0.5)),
    "poisson int64 rates": lambda: torch.poisson(torch.ones(2, dtype=torch.int64)),
    "randperm bool": lambda: torch.randperm(2, dtype=torch.bool),
    "geometric_ bool": lambda: torch.empty(3, dtype=torch.bool).geometric_(0.5),
    "native_dropout int64": lambda: torch.native_dropout(torch.ones(3, dtype=torch.int64), 0.5, True),
    "multinomial more samples than categories": lambda: torch.multinomial(torch.ones(0), 1),
    "normal mean and std do not broadcast": lambda: torch.normal(torch.zeros(3), torch.ones(4)),
    "uniform_ on an expanded tensor": lambda: torch.ones(1).expand(3).uniform_(),
    "random_ on an expanded tensor": lambda: torch.ones(1).expand(3).random_(0, 5),
    "normal out int64": lambda: torch.normal(torch.zeros(3), 1.0, out=torch.empty(3, dtype=torch.int64)),
    "multinomial out float32": lambda: torch.multinomial(torch.tensor([1.0, 2.0]), 1, out=torch.empty(1)),
    "rand_like int64, empty": lambda: torch.rand_like(torch.ones(0, 5, dtype=torch.int64)),
}

ACCEPTED = {
    "randint default dtype": lambda: torch.randint(3, (2, 1)),
    "randint int64 named": lambda: torch.randint(3, (2, 1), dtype=torch.int64),
    "random_ float32": lambda: torch.empty(2, 3).random_(),
    "random_ float16": lambda: torch.empty(2, 3, dtype=torch.float16).random_(),
    "rand complex64": lambda: torch.rand(2, 3, dtype=torch.complex64),
    "randn complex128": lambda: torch.randn(2, 3, dtype=torch.complex128),
    "rand_like channels_last": lambda: torch.rand_like(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)),
    "randn_like channels_last": lambda: torch.randn_like(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)),
    "randint_like channels_last": lambda: torch.randint_like(
        torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last), 9),
    "rand out float64": lambda: torch.rand(4, 2, out=torch.empty(0, dtype=torch.float64)),
    "randn out": lambda: torch.randn(4, 2, out=torch.empty(8)),
    "normal Tensor_float out": lambda: torch.normal(torch.zeros(4), 1.0, out=torch.empty(4)),
    "normal Tensor_float out float64": lambda: torch.normal(torch.zeros(4), 1.0, out=torch.empty(4, dtype=torch.float64)),
    "bernoulli out": lambda: torch.bernoulli(torch.full((4,), 0.5), out=torch.empty(4)),
    "randint generator=None": lambda: torch.ops.aten.randint.generator(5, [4], generator=None),
    "native_dropout train=False": lambda: torch.ops.aten.native_dropout(torch.ones(4), 0.5, False)[1],
    "randperm out": lambda: torch.randperm(5, out=torch.empty(0, dtype=torch.int64)),
    "randperm int32": lambda: torch.randperm(7, dtype=torch.int32),
    "multinomial 1-d": lambda: torch.multinomial(torch.tensor([0.2, 0.0, 0.8]), 2),
    "poisson": lambda: torch.poisson(torch.tensor([0.5, 30.0])),
    "binomial": lambda: torch.binomial(torch.tensor([10.0, 100.0]), torch.tensor([0.5, 0.9])),
    "gamma": lambda: torch._standard_gamma(torch.tensor([0.3, 4.0])),
    "dirichlet": lambda: torch._sample_dirichlet(torch.tensor([[0.3, 4.0, 1.0]])),
    "rrelu bfloat16": lambda: torch.nn.functional.rrelu(torch.ones(3, dtype=torch.bfloat16), training=True),
    "bernoulli complex64, empty": lambda: torch.bernoulli(torch.ones(0, 3, dtype=torch.complex64)),
    "rrelu_with_noise strided noise": lambda: torch.ops.aten.rrelu_with_noise(torch.ones(4, 3), torch.zeros(3, 4).t(),
                                                                              0.1, 0.3, True),
}


@pytest.mark.parametrize("case", list(REFUSED) + list(ACCEPTED))
def test_the_stream_accepts_and_refuses_what_torch_does(case):
    """Outcome in the stream == stock torch's: the same exception (type and message), or
    a result of the same shape, dtype and strides."""
    fn = {**REFUSED, **ACCEPTED}[case]
    stock = _outcome(fn)
    compile_rng.manual_seed(0)
    with eager_stream():
        mine = _outcome(fn)
    assert mine == stock
    assert (stock[0] == "ok") == (case in ACCEPTED)
    if case in REFUSED:  # as torch's generator: a refused call draws nothing
        assert compile_rng.get_state() == (0, 0)


def test_complex_draws_are_the_real_views_draws():
    """torch draws a complex tensor as its real view (normal_ with std / sqrt(2) each part):
    counters run over that ``(*size, 2)`` view."""
    compile_rng.manual_seed(5)
    with eager_stream():
        u = torch.rand(2, 3, dtype=torch.complex64)
        z = torch.randn(2, 3, dtype=torch.complex128)
    want_u = ops.uniform(ops.make_key(5, 0), 0, [2, 3, 2], [6, 2, 1], 0.0, 1.0, torch.float32)
    want_z = ops.normal(ops.make_key(5, 12), 0, [2, 3, 2], [6, 2, 1], 0.0, 1 / math.sqrt(2), torch.float64)
    assert torch.equal(torch.view_as_real(u), want_u) and torch.equal(torch.view_as_real(z), want_z)


def test_like_draws_keep_the_memory_format_and_the_contiguous_values():
    x = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    compile_rng.manual_seed(1)
    with eager_stream():
        got = torch.rand_like(x)
    compile_rng.manual_seed(1)
    with eager_stream():
        want = torch.rand(2, 3, 4, 5)
    assert got.is_contiguous(memory_format=torch.channels_last) and torch.equal(got, want)


def test_out_overloads_write_the_functional_values():
    compile_rng.manual_seed(2)
    with eager_stream():
        out = torch.empty(0, dtype=torch.float64)
        returned = torch.rand(3, 4, out=out)
    compile_rng.manual_seed(2)
    with eager_stream():
        want = torch.rand(3, 4, dtype=torch.float64)
    assert returned is out and torch.equal(out, want)


def test_out_draws_in_a_step_leave_torchs_generator_alone():
    """Asking torch whether it accepts an ``out=`` tensor runs its op on one element: only
    for an ``out=`` of another dtype, with a generator of its own where the op takes one.
    A step's ``out=`` draws leave torch's generator where it was (and on CUDA, where it is
    the stream, must)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with compile_rng.step(4):
        torch.rand(4, 2, out=torch.empty(8, dtype=torch.float64))
        torch.normal(torch.zeros(4), 1.0, out=torch.empty(4))
        torch.normal(torch.zeros(4), 1.0, out=torch.empty(4, dtype=torch.float64))
        torch.bernoulli(torch.full((4,), 0.5), out=torch.empty(4, dtype=torch.float64))
        torch.multinomial(torch.ones(4, 3), 2, out=torch.empty(4, 2, dtype=torch.int64))
    assert torch.equal(torch.get_rng_state(), before)


def _out_calls() -> dict:
    """Each random op's out= form into tensors of other dtypes and shapes: the shape it
    draws, empty, another shape, another size."""
    calls = {
        "rand": lambda out: torch.rand(4, out=out), "randn": lambda out: torch.randn(4, out=out),
        "randint": lambda out: torch.randint(0, 5, (4,), out=out),
        "normal(T, T)": lambda out: torch.normal(torch.zeros(4), torch.ones(4), out=out),
        "normal(T, f)": lambda out: torch.normal(torch.zeros(4), 2.0, out=out),
        "normal(f, T)": lambda out: torch.normal(1.0, torch.ones(4), out=out),
        "normal(f, f)": lambda out: torch.normal(1.0, 2.0, (4,), out=out),
        "bernoulli": lambda out: torch.bernoulli(torch.full((4,), 0.5), out=out),
        "randperm": lambda out: torch.randperm(4, out=out),
        "multinomial": lambda out: torch.multinomial(torch.ones(3), 2, out=out),
        "poisson": lambda out: torch.ops.aten.poisson.out(torch.ones(4), out=out),
        "native_dropout": lambda out: torch.ops.aten.native_dropout.out(
            torch.ones(4), 0.5, True, out0=out, out1=torch.empty(out.shape, dtype=torch.bool)),
    }
    return {(name, dtype, shape): fn for name, fn in calls.items()
            for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int64)
            for shape in ((4,), (0,), (2, 2), (5,))}


def _into_new_out(fn, shape: tuple, dtype: torch.dtype):
    return fn(torch.empty(shape, dtype=dtype))


@pytest.mark.parametrize("name", sorted({name for name, _, _ in _out_calls()}))
def test_out_tensors_of_other_dtypes_and_shapes_give_stocks_outcome(name):
    """Stock's outcome for every out= form, dtype and shape (its result's structure or its
    error); a refused call leaves the stream where it was, and torch's own generator moves
    only where stock's does (torch's checks of the output run after its draw for some)."""
    differs = []
    for (op, dtype, shape), fn in _out_calls().items():
        if op != name:
            continue
        call = functools.partial(_into_new_out, fn, shape, dtype)
        torch.manual_seed(0)
        stock = _outcome(call)
        stock_moved = not torch.equal(torch.default_generator.get_state(), torch.manual_seed(0).get_state())
        compile_rng.manual_seed(0)
        torch.manual_seed(0)
        with eager_stream():
            mine = _outcome(call)
        position = compile_rng.get_state()
        moved = not torch.equal(torch.default_generator.get_state(), torch.manual_seed(0).get_state())
        if mine != stock or (moved and not stock_moved) or (stock[0] != "ok" and position != (0, 0)):
            differs.append((dtype, shape, stock, mine, moved, position))
    assert not differs, differs[:3]


# --- samplers: documented functions of the counters ----------------------------------


def test_randperm_sorts_the_counters_random_bits():
    compile_rng.manual_seed(3)
    with eager_stream():
        perm = torch.randperm(50)
    keys = ops.random_bits(ops.make_key(3, 0), 0, [50], [1])
    assert torch.equal(perm, torch.sort(keys, stable=True).indices)


def test_multinomial_is_the_race_or_the_inverse_cdf_of_the_stream():
    probs = torch.tensor([[0.1, 0.0, 0.5, 0.4], [1.0, 2.0, 3.0, 4.0]])
    compile_rng.manual_seed(4)
    with eager_stream():
        race = torch.multinomial(probs, 3)
        drawn = torch.multinomial(probs, 6, replacement=True)
    q = ops.exponential(ops.make_key(4, 0), 0, [2, 4], [4, 1], 1.0, torch.float64)
    assert torch.equal(race, torch.topk(probs / q, 3).indices)
    u = ops.uniform(ops.make_key(4, 8), 0, [2, 6], [6, 1], 0.0, 1.0, torch.float64)
    cdf = probs.double().cumsum(-1)
    assert torch.equal(drawn, torch.searchsorted(cdf, u * cdf[:, -1:], right=True))


def test_rejection_samplers_take_rounds_at_the_elements_counters():
    """Draw ``j`` of element ``n`` is counter ``n`` under ``seed ^ C_j``: the rounds after
    the first (explicit counters, torch ops) give the kernel's values at those counters."""
    from compile_rng.ops.samplers import Draws, draw_constant

    key = ops.make_key(2**63 + 5, 2**64 - 6)  # the counters wrap
    draws = Draws(key, 3, [3, 5], [7, 1], ops.random_bits)
    for j in (0, 1, 4):
        assert torch.equal(draws.at(j, torch.arange(15)), draws.all(j).view(-1))
    bits = ops.random_bits(ops.make_key((2**63 + 5) ^ (draw_constant(4) % 2**64), 2**64 - 6), 3, [3, 5], [7, 1])
    assert torch.equal(draws.all(4), ((bits >> 11) & (2**53 - 1)).double().add(0.5).mul(2.0**-53))


N = 1 << 18


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.torch_independent  # the samplers' statistics: compile_rng's own kernels
def test_randperm_is_uniform_over_permutations():
    import itertools

    index = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = torch.zeros(24)
    compile_rng.manual_seed(6)
    with eager_stream():
        for _ in range(4800):
            counts[index[tuple(torch.randperm(4).tolist())]] += 1
    assert _chi2(counts, torch.full((24,), 200.0)) < 49.7  # 23 degrees of freedom, p = 0.001


@pytest.mark.torch_independent  # the samplers' statistics: compile_rng's own kernels
def test_multinomial_frequencies():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    compile_rng.manual_seed(7)
    with eager_stream():
        drawn = torch.multinomial(p, N, replacement=True)
        pairs = torch.multinomial(p.expand(N, 4), 2)
    assert _chi2(torch.bincount(drawn, minlength=4), p.double() * N) < 16.3  # 3 dof, p = 0.001
    # without replacement: the first pick ~ p, the second ~ p_j / (1 - p_i)
    joint = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).view(4, 4)
    expected = p.double()[:, None] * p.double()[None, :] / (1 - p.double()[:, None]) * N
    expected.fill_diagonal_(0)
    off = ~torch.eye(4, dtype=torch.bool)
    assert int(joint.diagonal().sum()) == 0
    assert _chi2(joint[off], expected[off]) < 32.9  # 11 dof, p = 0.001


def _ks(samples: torch.Tensor, cdf) -> float:
    x, _ = samples.double().sort()
    f = cdf(x)
    n = x.numel()
    grid = torch.arange(0, n + 1, dtype=torch.float64) / n
    return float(torch.maximum(grid[1:] - f, f - grid[:-1]).max())


@pytest.mark.torch_independent  # the samplers' statistics: compile_rng's own kernels
@pytest.mark.parametrize("alpha", [0.3, 1.0, 4.5])
def test_gamma_ks(alpha):
    compile_rng.manual_seed(8)
    with eager_stream():
        g = torch._standard_gamma(torch.full((N,), alpha, dtype=torch.float64))
    assert _ks(g, lambda x: torch.special.gammainc(torch.tensor(alpha, dtype=torch.float64), x)) < 1.95 / math.sqrt(N)


def _discrete_chi2(values: torch.Tensor, pmf: torch.Tensor) -> tuple[float, int]:
    """Chi-square of integer ``values`` against ``pmf`` (over ``0, 1, ...``) on the bins
    expecting at least 20, each tail pooled into one bin; with its degrees of freedom."""
    n = values.numel()
    kept = (pmf * n >= 20).nonzero().view(-1)
    first, last = int(kept.min()), int(kept.max())
    bins = values.long().clamp(first - 1, last + 1) - (first - 1)
    counts = torch.bincount(bins, minlength=last - first + 3).double()
    inner = pmf[first: last + 1]
    expected = torch.cat([pmf[:first].sum().view(1), inner, (1 - pmf[: last + 1].sum()).clamp(min=0).view(1)]) * n
    used = expected >= 20
    return _chi2(counts[used], expected[used]), int(used.sum()) - 1


def _critical(df: int) -> float:
    """The chi-square critical value at p = 0.001 (Wilson-Hilferty; within 1% from 3 dof)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.torch_independent  # the samplers' statistics: compile_rng's own kernels
@pytest.mark.parametrize("rate", [0.5, 4.0, 9.9, 10.0, 37.5, 400.0])
def test_poisson_frequencies(rate):
    compile_rng.manual_seed(9)
    with eager_stream():
        k = torch.poisson(torch.full((N,), rate, dtype=torch.float64))
    support = torch.arange(0, int(rate + 12 * math.sqrt(rate) + 20), dtype=torch.float64)
    pmf = torch.exp(support * math.log(rate) - rate - torch.lgamma(support + 1))
    chi2, df = _discrete_chi2(k, pmf)
    assert chi2 < _critical(df)


@pytest.mark.torch_independent  # the samplers' statistics: compile_rng's own kernels
@pytest.mark.parametrize(("count", "prob"), [(10, 0.3), (40, 0.2), (1000, 0.05), (1000, 0.5), (200, 0.93)])
def test_binomial_frequencies(count, prob):
    compile_rng.manual_seed(10)
    with eager_stream():
        k = torch.binomial(torch.full((N,), float(count), dtype=torch.float64), torch.full((N,), prob, dtype=torch.float64))
    support = torch.arange(0, count + 1, dtype=torch.float64)
    log_pmf = (torch.lgamma(torch.tensor(count + 1.0, dtype=torch.float64)) - torch.lgamma(support + 1) - torch.lgamma(count - support + 1)
               + support * math.log(prob) + (count - support) * math.log1p(-prob))
    chi2, df = _discrete_chi2(k, log_pmf.exp())
    assert chi2 < _critical(df)


@pytest.mark.torch_independent  # the samplers' statistics: compile_rng's own kernels
def test_dirichlet_moments():
    alpha = torch.tensor([0.4, 1.0, 3.0], dtype=torch.float64)
    compile_rng.manual_seed(11)
    with eager_stream():
        x = torch._sample_dirichlet(alpha.expand(N, 3).contiguous())
    total = float(alpha.sum())
    mean = alpha / total
    var = alpha * (total - alpha) / (total**2 * (total + 1))
    assert torch.allclose(x.sum(-1), torch.ones(N, dtype=torch.float64))
    assert ((x.mean(0) - mean).abs() < 5 * (var / N).sqrt()).all()
    assert ((x.var(0) - var).abs() < 0.05 * var).all()


# --- the same rows whatever the split, eager and compiled -----------------------------

SAMPLERS = {
    "multinomial": lambda b: torch.multinomial(torch.arange(1.0, 6.0).expand(b, 5), 3),
    "multinomial with replacement": lambda b: torch.multinomial(torch.arange(1.0, 6.0).expand(b, 5), 7, True),
    "poisson": lambda b: torch.poisson(torch.tensor([0.5, 3.0, 12.0, 90.0]).expand(b, 4).contiguous()),
    "binomial": lambda b: torch.binomial(torch.tensor([5.0, 60.0, 900.0]).expand(b, 3).contiguous(),
                                         torch.tensor([0.4, 0.7, 0.2]).expand(b, 3).contiguous()),
    "gamma": lambda b: torch._standard_gamma(torch.tensor([0.2, 1.5, 8.0]).expand(b, 3).contiguous()),
    "dirichlet": lambda b: torch._sample_dirichlet(torch.tensor([0.2, 1.5, 8.0]).expand(b, 3).contiguous()),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_ranks_rows_are_the_one_process_rows(name):
    """Data-parallel ranks holding 4, 2 or 1 of 8 rows draw the one process's rows."""
    fn = SAMPLERS[name]
    compile_rng.manual_seed(12)
    with compile_rng.step(8):
        whole = fn(8)
    for world in (2, 4, 8):
        local = 8 // world
        parts = []
        for rank in range(world):
            compile_rng.manual_seed(12)
            rows = list(range(rank * local, (rank + 1) * local))
            with compile_rng.step(local, rows=rows, global_batch=8):
                parts.append(fn(local))
        assert torch.equal(torch.cat(parts), whole), world


@pytest.mark.parametrize("inner", [None, "aot_eager", "inductor"])
def test_a_range_wider_than_2_63_is_refused_before_it_draws(inner):
    """torch draws ``randint`` over any int64 range; the contract's integers span at most
    2**63 values. A compiled graph once drew such a range as negative values only, and
    the eager stream raised after reserving: both refuse it now, saying why, and the
    stream does not move."""
    def program(x):
        return torch.randint(-2**63, 2**63 - 1, (8,)) + x

    fn = program if inner is None else torch.compile(program, backend=compile_rng.backend(inner=inner))
    torch._dynamo.reset()
    compile_rng.manual_seed(5)
    with pytest.raises(Exception, match="wider than 2\\*\\*63"):
        with compile_rng.step(8):
            fn(torch.zeros(8, dtype=torch.int64))
    assert compile_rng.get_state() == (5, 0)


def test_randperm_in_a_step_is_a_replica():
    """A permutation has no rows: every rank draws the one process's."""
    perms = []
    for rows in ({}, {"rows": [0, 1], "global_batch": 4}, {"rows": [2, 3], "global_batch": 4}):
        compile_rng.manual_seed(13)
        with compile_rng.step(len(rows.get("rows", range(4))), **rows):
            perms.append(torch.randperm(4))
    assert torch.equal(perms[0], perms[1]) and torch.equal(perms[0], perms[2])


def test_a_batched_graphs_permutation_is_the_eager_replica():
    """In a batched graph too a permutation of the microbatch's row count is a replica
    (eager code's): each microbatch draws the same one, a size other than the batch's is
    no error, and a dynamic size compiles (it once crashed on the symbolic n)."""
    def program(x):
        return torch.randperm(x.shape[0]), torch.randperm(6) + x.sum().long()

    outs = {}
    for name, fn in (("eager", program),
                     ("batched", torch.compile(program, backend=compile_rng.backend(layout="invariant", batched=True))),
                     ("dynamic", torch.compile(program, backend=compile_rng.backend(inner="aot_eager"), dynamic=True))):
        torch._dynamo.reset()
        compile_rng.manual_seed(13)
        with compile_rng.step(4) as step:
            parts = []
            for part in torch.zeros(4, 3).split(2):
                with step.microbatch(2):
                    parts.append(fn(part))
        outs[name] = (parts, compile_rng.get_state())
    eager_parts, eager_state = outs["eager"]
    assert torch.equal(eager_parts[0][0], eager_parts[1][0]) and eager_state == (13, 12)
    for name in ("batched", "dynamic"):
        parts, state = outs[name]
        assert state == eager_state, name
        for got, want in zip(parts, eager_parts):
            assert all(torch.equal(g, w) for g, w in zip(got, want)), name
    compile_rng.manual_seed(13)
    with eager_stream():  # the replicas are the stream's draws without rows
        whole = (torch.randperm(2), torch.randperm(6))
    assert torch.equal(eager_parts[0][0], whole[0]) and torch.equal(eager_parts[0][1], whole[1])


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_compiled_samplers_draw_the_eager_values(inner):
    def program(rates, probs, alpha):
        return (
            torch.poisson(rates), torch.multinomial(probs, 2), torch.multinomial(probs, 5, replacement=True),
            torch._standard_gamma(alpha), torch._sample_dirichlet(alpha), torch.randperm(9),
        )

    args = (torch.tensor([[0.5, 20.0], [3.0, 200.0]]), torch.tensor([[1.0, 0.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]]),
            torch.tensor([[0.3, 2.0, 5.0], [1.0, 1.0, 1.0]]))
    compile_rng.manual_seed(14)
    with eager_stream():
        want = program(*args)
    state = compile_rng.get_state()
    torch._dynamo.reset()
    compile_rng.manual_seed(14)
    got = torch.compile(program, backend=compile_rng.backend(inner=inner))(*args)
    assert compile_rng.get_state() == state
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _rrelu_reference(seed: int, x: torch.Tensor, lower: float, upper: float, first: int) -> tuple[torch.Tensor, ...]:
    """rrelu's output and noise from the reference stream: ``uniform(lower, upper)`` at
    element ``i``'s counter ``first + i`` (the contract's ``u * (upper - lower) + lower``
    in float32, each step rounded) where the input is not positive (else 1), times the input."""
    span, low = f32(upper - lower), f32(lower)
    noise = [f32(f32(ref.uniform01(seed, first + i, "float32") * span) + low) if v <= 0 else 1.0
             for i, v in enumerate(x.flatten().tolist())]
    out = [f32(v * r) for v, r in zip(x.flatten().tolist(), noise)]
    return torch.tensor(out).view(x.shape), torch.tensor(noise).view(x.shape)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_rrelu_in_a_step_draws_the_compiled_graphs_values(inner):
    """rrelu in training (torch's kernel draws a uniform per non-positive element from its
    generator) draws in an eager step what a compiled graph draws by torch's decomposition:
    ``uniform(lower, upper)`` over the input at its rows, the input times it where not
    positive, and that uniform as the noise the backward multiplies by - functional and in
    place, the reference's values at a rank's rows."""
    x = torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(2))
    rrelu = functools.partial(torch.nn.functional.rrelu, lower=0.1, upper=0.4, training=True)

    def eager(t: torch.Tensor, **step) -> tuple[torch.Tensor, ...]:
        compile_rng.manual_seed(31)
        t = t.clone().requires_grad_()
        with compile_rng.step(t.shape[0], **step):
            out = rrelu(t)
            in_place = rrelu(t.detach().clone(), inplace=True)
        out.backward(torch.ones_like(out))
        return out.detach(), in_place, t.grad, compile_rng.get_state()

    out, in_place, grad, position = eager(x)
    assert position == (31, 2 * x.numel())  # two draws over the batch's elements
    want, noise = _rrelu_reference(31, x, 0.1, 0.4, 0)
    assert torch.equal(out, want) and torch.equal(grad, noise)
    assert torch.equal(in_place, _rrelu_reference(31, x, 0.1, 0.4, x.numel())[0])
    assert bool((x <= 0).any() and (x > 0).any())  # both branches are exercised
    half = eager(x[4:], rows=[4, 5, 6, 7], global_batch=8)
    assert torch.equal(half[0], out[4:]) and torch.equal(half[1], in_place[4:])

    torch._dynamo.reset()
    compiled = torch.compile(lambda t: rrelu(t), backend=compile_rng.backend(inner=inner))
    compile_rng.manual_seed(31)
    leaf = x.clone().requires_grad_()
    with compile_rng.step(8):
        got = compiled(leaf)
    got.backward(torch.ones_like(got))
    assert torch.equal(got.detach(), out) and torch.equal(leaf.grad, grad)  # the graph's noise is the eager one


def _real_ranks_draws(local: int, rows: slice) -> list[torch.Tensor]:
    """The samplers, a permutation and rrelu (at the rank's rows of one input) in a step of
    ``local`` rows."""
    x = torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(2))[rows]
    drawn = [fn(local) for fn in SAMPLERS.values()]
    return [*drawn, torch.randperm(9), torch.nn.functional.rrelu(x, 0.1, 0.4, training=True)]


def _real_ranks_body(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    local = 8 // world
    compile_rng.manual_seed(12)
    with compile_rng.step(local, data_parallel=dist.group.WORLD):
        drawn = _real_ranks_draws(local, slice(rank * local, (rank + 1) * local))
    position = compile_rng.get_state()
    # a graph compiled without batched=True on the rank's rows would draw every rank alike
    unbatched = torch.compile(lambda t: torch.nn.functional.dropout(t, 0.5), backend=compile_rng.backend(inner="aot_eager"))
    try:
        with compile_rng.step(local, data_parallel=dist.group.WORLD):
            unbatched(torch.ones(local, 4))
        refused = ""
    except NotImplementedError as e:
        refused = str(e)
    gathered = [None] * world
    dist.all_gather_object(gathered, (drawn, position, refused, compile_rng.get_state()))
    if rank == 0:
        torch.save(gathered, out)


@pytest.mark.slow
def test_real_ranks_draw_the_one_process_rows(tmp_path):
    """Two gloo ranks of 4 rows each (their rows from the process group): each sampler's and
    rrelu's rows are the one process's rows of the 8, the permutation is one replica, and
    the stream ends where the one process's does. A graph compiled without batched=True is
    refused on a rank's rows, and the stream does not move."""
    out = str(tmp_path / "ranks.pt")
    spawn(_real_ranks_body, 2, out)
    gathered = torch.load(out)
    compile_rng.manual_seed(12)
    with compile_rng.step(8):
        whole = _real_ranks_draws(8, slice(None))
    for rank, (drawn, position, refused, after) in enumerate(gathered):
        assert position == after == compile_rng.get_state()
        assert re.search(r"aten\.native_dropout.*part of the step's global batch.*batched=True", refused, re.S), refused
        assert torch.equal(drawn[-2], whole[-2])  # randperm: no rows
        rowwise = drawn[:-2] + drawn[-1:]
        for got, want in zip(rowwise, whole[:-2] + whole[-1:], strict=True):
            assert torch.equal(got, want[4 * rank:4 * rank + 4])


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_dropout_at_p_0_and_1_draws_nothing_eager_or_compiled(inner):
    """Dropout in training at p = 1 (zeros, a mask of zeros) and p = 0 (the input, a mask of
    ones) draws nothing, as eager F.dropout and torch's decomposition of a compiled one do:
    the op after it draws at counter 0, eager and compiled, and the gradients agree. (A
    compiled p = 1 dropout once reserved its counters, moving every later draw.)"""
    def program(x):
        return (torch.nn.functional.dropout(x, 1.0), *torch.native_dropout(x, 1.0, True),
                *torch.native_dropout(x, 0.0, True), torch.rand_like(x))

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    want_rand = torch.tensor([ref.uniform01(41, i, "float32") for i in range(x.numel())]).view(x.shape)
    results = []
    for fn in (program, torch.compile(program, backend=compile_rng.backend(inner=inner))):
        torch._dynamo.reset()
        compile_rng.manual_seed(41)
        leaf = x.clone().requires_grad_()
        with compile_rng.step(4):
            out = fn(leaf)
            (out[0] + out[1] + out[3]).sum().backward()
        assert compile_rng.get_state() == (41, x.numel())  # rand_like's counters alone
        assert torch.equal(out[-1], want_rand)
        results.append((*(o.detach() for o in out), leaf.grad))
    eager, compiled = results
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(eager[1], torch.zeros_like(x)) and not eager[2].any()
    assert torch.equal(eager[3], x) and eager[4].all()
    # the out= overload (reached through torch.ops only) writes the same and reserves nothing
    compile_rng.manual_seed(41)
    outs = torch.full_like(x, 7.0), torch.ones_like(x, dtype=torch.bool)
    with compile_rng.step(4):
        torch.ops.aten.native_dropout.out(x, 1.0, True, out0=outs[0], out1=outs[1])
    assert compile_rng.get_state() == (41, 0) and torch.equal(outs[0], eager[1]) and not outs[1].any()


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_compiled_transcendental_draws_are_within_the_bound(inner):
    """exponential_, log_normal_ (exp of a normal) and cauchy_ (tan of a uniform) in float32
    compute their values from a draw by log, exp or tan: a compiled graph's (Inductor's own
    vectorized functions) are within the documented 2 ulp of eager's, at the same counters
    (the state agrees); the draws they start from are bitwise."""
    def program(x):
        # standard parameters: a median or mean would cancel digits and magnify the ulps
        return (torch.empty_like(x).exponential_(), torch.empty_like(x).log_normal_(),
                torch.empty_like(x).cauchy_(), torch.randn_like(x), torch.rand_like(x))

    x = torch.zeros(64, 256)
    results = []
    for fn in (program, torch.compile(program, backend=compile_rng.backend(inner=inner))):
        torch._dynamo.reset()
        compile_rng.manual_seed(43)
        with compile_rng.step(64):
            results.append((fn(x), compile_rng.get_state()))
    (eager, eager_state), (compiled, compiled_state) = results
    assert eager_state == compiled_state
    for name, a, b in zip(("exponential", "log_normal", "cauchy"), eager, compiled):
        assert ulp_distance(a, b) <= 2, name
    assert torch.equal(eager[3], compiled[3]) and torch.equal(eager[4], compiled[4])
