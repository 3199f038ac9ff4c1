"""The short path of the common eager draws (``compile_rng/eager/short_draws.py``) draws
what the general path draws: the same values, the same stream position after, the same
recorded counters, the same errors - draw by draw, in every kind of stream and layout a
step has. Each scenario runs twice from the same seed, with the short path and with it
switched off; the scenarios the short path serves are checked to have been served (else
the comparison would be vacuous), those it must not serve to have not been.

The in-place fills (``bernoulli_``, ``uniform_``, ``normal_``: dropout's, rand's, randn's)
have a lane in the C++ kernel in front of the short path (``csrc/random_op_kernels.cpp``),
which takes its counters from ``short_draws.lane_counter``:
the comparisons of the short path switch it off; the lane is compared the same way with
everything switched off, and counted through ``lane_counter`` where it must (or must not) serve.

The short path is also checked on its own against the independent scalar reference
(``reference.py``: the single-device stream at global row-major counters), in one process
at a rank's rows and on real gloo ranks."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from collections.abc import Callable

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import compile_rng
from compile_rng import ops as cr_ops
from compile_rng.eager import dispatch_modes, draw_counters, short_draws
from compile_rng.eager.dispatch_modes import eager_stream
from compile_rng.launch import spawn
from compile_rng.stream import state


def _fills(x: torch.Tensor) -> list[torch.Tensor]:
    """The served calls, several arguments each, on a contiguous float32 tensor, the
    integer draws of its shape: every integer width, a span of 2**32, ``randint``'s forms
    (a float ``randint_like`` is drawn by the Python kernel, through torch's kernel), and
    bernoulli, dropout and rand in the other float dtypes (a bfloat16 model's masks), normals
    in bfloat16 and float16, exponentials."""
    ints = [torch.zeros(x.shape, dtype=dtype) for dtype in (torch.int64, torch.int16, torch.uint8, torch.int8)]
    return [
        x.to(torch.bfloat16).bernoulli_(0.3), x.to(torch.float16).bernoulli_(0.0), x.double().bernoulli_(1.0),
        x.double().bernoulli_(0.7), F.dropout(x.to(torch.bfloat16), 0.3), F.dropout(x.to(torch.float16), 0.5),
        F.dropout(x.double(), 0.1), x.to(torch.bfloat16).normal_(), x.to(torch.float16).normal_(2, 0.5),
        torch.randn_like(x.to(torch.bfloat16)), torch.randn(x.shape, dtype=torch.float16),
        torch.rand_like(x.to(torch.bfloat16)), x.to(torch.float16).uniform_(), torch.rand(x.shape, dtype=torch.float64),
        x.double().uniform_(0, 1), x.clone().exponential_(), x.clone().exponential_(2.5),
        x.to(torch.bfloat16).exponential_(0.5), x.double().exponential_(),
        torch.randint(0, 9, x.shape), torch.randint(3, x.shape, dtype=torch.int32), torch.randint_like(x, 5),
        torch.randint_like(x, -4, 4, dtype=torch.int64), ints[0].random_(-5, 2**32 - 5),
        ints[1].random_(-100, 100), ints[2].random_(0, 256), ints[3].random_(-128, 128),
        x.clone().bernoulli_(0.0), x.clone().bernoulli_(0.1), x.clone().bernoulli_(), x.clone().bernoulli_(1.0),
        x.clone().bernoulli_(1), x.clone().uniform_(), x.clone().uniform_(-2, 2), x.clone().uniform_(3.0, 3.0),
        x.clone().uniform_(-2.0, 0.25), F.dropout(x, 0.3), F.dropout(x, 0.5),
        x.clone().normal_(), x.clone().normal_(2, 0.5), x.clone().normal_(-1.0, 0.0),
        torch.rand(x.shape), torch.rand(*x.shape, dtype=torch.float32, device="cpu"), torch.randn(x.shape),
        torch.rand_like(x), torch.randn_like(x), torch.randn_like(x.double(), dtype=torch.float32),
        torch.rand_like(x, memory_format=torch.contiguous_format),
    ]


def _whole_step() -> list[torch.Tensor]:
    with compile_rng.step(8):
        return _fills(torch.ones(8, 16))


def _second_half() -> list[torch.Tensor]:
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
        return _fills(torch.ones(4, 3, 5))


def _microbatches() -> list[torch.Tensor]:
    out = []
    with compile_rng.step(8) as step:
        for _ in range(2):
            with step.microbatch(4):
                out += _fills(torch.ones(4, 16))
    return out


def _named() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Linear(16, 16), nn.Dropout(0.4))
    with compile_rng.step(8, names=model):  # a draw in a named step is in a module's forward
        return [model(torch.ones(8, 16)), model(torch.zeros(8, 16))]


def _replica_stream() -> list[torch.Tensor]:
    with eager_stream():  # a compiled call's or an init function's eager code: no rows
        return _fills(torch.ones(3, 7))


def _checkpointed_backward_after_the_step() -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
        loss = checkpoint(lambda t: F.dropout(lin(t), 0.3), x, use_reentrant=False).square().sum()
    loss.backward()
    return [x.grad]


# served: each of these draws only calls the short path serves
SERVED = {
    "whole step": _whole_step, "rows 4-7 of 8": _second_half, "microbatches": _microbatches,
    "step with names": _named, "replica stream": _replica_stream,
    "checkpoint recomputed after the step": _checkpointed_backward_after_the_step,
}


def _not_served_layouts() -> list[torch.Tensor]:
    out = []
    with compile_rng.step(8):
        x = torch.ones(16, 8).t()  # dim 0 is the batch, but not contiguous
        out += [x.clone().bernoulli_(0.5), x.bernoulli_(0.5), x.to(torch.bfloat16).bernoulli_(0.5)]
        # their values depend on the dtype: the lane serves these fills in float32 only
        out += [torch.ones(8, 4, dtype=torch.bfloat16).uniform_(0.0, 2.0), torch.ones(8, 4, dtype=torch.float64).normal_(),
                torch.ones(8, 4, dtype=torch.float16).uniform_(-1.0, 1.0)]
        weight = nn.Parameter(torch.ones(8, 4))
        with torch.no_grad():
            out += [weight.uniform_().detach().clone()]
        out += [torch.ones(8, 4).uniform_(-0.1, 0.1)]  # 0.1 is no float32
        out += [torch.ones(8, 4).bernoulli_(torch.full((8, 4), 0.3))]
        out += [torch.empty(8, 4, dtype=torch.float64).uniform_(0.5, 1.0), torch.randn(8, 4, dtype=torch.float64),
                torch.randn_like(torch.ones(4, 8).t()), torch.rand_like(torch.ones(4, 8).t()),
                torch.ones(4, 8).t().normal_()]
        out += [torch.empty(torch.randn(8, 4, device="meta").shape)[:0]]
        ints = torch.zeros(8, 4, dtype=torch.int64)
        out += [ints.clone().random_(0, 2**32 + 1), ints.clone().random_(), ints.clone().random_(7),
                torch.zeros(4, 8, dtype=torch.int32).t().random_(0, 5), torch.zeros(8, 4, dtype=torch.bool).random_(0, 2),
                torch.zeros(8, 4).random_(0, 9), torch.randint(0, 9, (8, 4), dtype=torch.float64),
                torch.randint_like(torch.ones(4, 8, dtype=torch.int64).t(), 5)]
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8, batch_dim=1):  # sequence-major: strided counters
        out += [torch.ones(5, 4, 3).bernoulli_(0.5)]
    with compile_rng.step(8, batch_dim=1):  # the whole batch too: a batch row's counters are consecutive
        out += [torch.ones(5, 8, 3).bernoulli_(0.5)]
    with compile_rng.step(8, rows=[1, 3, 5, 7, 9, 11, 13, 15], global_batch=16):  # interleaved rows
        out += [torch.ones(8, 4).bernoulli_(0.5)]
    return out


def _run(scenario: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], tuple, list[tuple]]:
    compile_rng.manual_seed(1234)
    with draw_counters.recorded_counters() as log:
        values = scenario()
    counters = [(tuple(c.key.tolist()), c.offset, c.strides, c.size) for c in log]
    return values, state.get_state("cpu"), counters


def _both_ways(scenario, monkeypatch) -> tuple[tuple, tuple, int]:
    """(short path's run, general path's run, draws the short path served). Each run also
    holds the CPU kernel's calls, argument by argument (the tensors' addresses aside)."""
    served, calls = [], []

    def recorded(kernel, short):
        def call(op, numel, seed, base, **kw):
            served.extend([1] if short else [])
            calls.append((op, numel, seed % 2**64, base % 2**64,
                          sorted((k, v) for k, v in kw.items() if v is not None and not isinstance(v, torch.Tensor))))
            return kernel(op, numel, seed, base, **kw)
        return call

    def recorded_normal(kernel, short):
        def call(seed, base, size, strides, mean, std, out=None):
            served.extend([1] if short else [])
            calls.append(("normal", seed % 2**64, base % 2**64, list(size), list(strides), mean, std))
            return kernel(seed, base, size, strides, mean, std, out=out)
        return call

    _lane_off(monkeypatch)  # the C++ lane: its own test
    monkeypatch.setattr(short_draws, "fast_f32", recorded(short_draws.fast_f32, True))
    monkeypatch.setattr(cr_ops, "fast_f32", recorded(cr_ops.fast_f32, False))
    monkeypatch.setattr(short_draws, "normal_f32", recorded_normal(short_draws.normal_f32, True))
    monkeypatch.setattr(cr_ops, "normal_f32", recorded_normal(cr_ops.normal_f32, False))
    short = (*_run(scenario), list(calls))
    calls.clear()
    monkeypatch.setattr(dispatch_modes, "short_draw", lambda *a: short_draws.NOT_SERVED)
    general = (*_run(scenario), list(calls))
    return short, general, len(served)


def _assert_same(short: tuple, general: tuple) -> None:
    (values, position, counters, calls), (want, want_position, want_counters, want_calls) = short, general
    assert len(values) == len(want)
    for got, expected in zip(values, want):
        assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
        assert torch.equal(got, expected)
    assert position == want_position
    assert counters == want_counters
    assert calls == want_calls  # the same kernel calls: the same counters, thresholds and bounds


@pytest.mark.parametrize("name", list(SERVED))
def test_the_short_path_draws_what_the_general_path_draws(name, monkeypatch):
    short, general, served = _both_ways(SERVED[name], monkeypatch)
    assert served > 0, "the short path served nothing: the comparison says nothing"
    _assert_same(short, general)


def _lane_off(monkeypatch) -> None:
    """Switch the C++ lane off: its fills and the factories it runs through torch's kernels."""
    monkeypatch.setattr(short_draws, "lane_counter", lambda *call: None)
    monkeypatch.setattr(short_draws, "lane_through_torch", lambda: False)


def _counting(monkeypatch, served: list, kernels: tuple[str, ...] = (), through_torch: list | None = None) -> None:
    """Count in ``served`` the draws the C++ lane serves (``lane_counter`` reserved their
    counters) and the calls of ``short_draws``' ``kernels``; in ``through_torch`` the
    factories the lane runs through torch's kernels."""
    lane, through = short_draws.lane_counter, short_draws.lane_through_torch

    def counted(*call):
        got = lane(*call)
        served.extend([] if got is None else [1])
        return got

    def counted_through() -> bool:
        yes = through()
        if through_torch is not None and yes:
            through_torch.append(1)
        return yes

    monkeypatch.setattr(short_draws, "lane_counter", counted)
    monkeypatch.setattr(short_draws, "lane_through_torch", counted_through)
    for name in kernels:
        kernel = getattr(short_draws, name)
        monkeypatch.setattr(short_draws, name, lambda *a, _k=kernel, **k: served.append(1) or _k(*a, **k))


def _lane_and_general(scenario, monkeypatch, through_torch: list | None = None) -> tuple[tuple, tuple, int]:
    """(a run with the C++ lane on, one on the general path only, draws the lane served);
    ``through_torch`` counts the factories the lane ran through torch's kernels."""
    served: list = []
    _counting(monkeypatch, served, through_torch=through_torch)
    lane = _run(scenario)
    _lane_off(monkeypatch)
    monkeypatch.setattr(dispatch_modes, "short_draw", lambda *a: short_draws.NOT_SERVED)
    return lane, _run(scenario), len(served)


# the scenarios whose draws include rand, randn, randint and their *_like (the lane's
# factories): 15 of them in each _fills call
FACTORIES = {"whole step": 15, "rows 4-7 of 8": 15, "microbatches": 30, "replica stream": 15}


@pytest.mark.parametrize("name", list(SERVED))
def test_the_c_lane_draws_what_the_general_path_draws(name, monkeypatch):
    """The fills on the C++ kernel's lane, and rand, randn and their ``*_like`` through
    torch's kernels into it: the general path's values (each op's own rule), stream
    position and recorded counters, in every kind of step (names, microbatches, a rank's
    rows, a checkpoint recomputed in the backward after the step)."""
    through: list = []
    lane, general, served = _lane_and_general(SERVED[name], monkeypatch, through)
    assert served > 0, "the lane served nothing: the comparison says nothing"
    assert len(through) == FACTORIES.get(name, 0)  # each factory ran through torch's kernel
    _assert_same((*lane, []), (*general, []))


def test_the_c_lane_serves_integers_and_other_float_dtypes(monkeypatch):
    """Each integer draw of :func:`_fills` but the float ``randint_like``, each bernoulli,
    dropout and rand in bfloat16, float16 and float64, each normal in bfloat16 and float16, and
    each exponential,
    takes the lane (the comparisons above would pass vacuously were they all left to the
    Python kernel)."""
    served, lane = [], short_draws.lane_counter

    def counted(op, size, *numbers):
        got = lane(op, size, *numbers)
        dtype = numbers[-1] if numbers and isinstance(numbers[-1], torch.dtype) else torch.float32
        served.extend([] if got is None else [(short_draws.LANE_OPS[op], dtype)])
        return got

    monkeypatch.setattr(short_draws, "lane_counter", counted)
    _whole_step()
    assert sum(op == getattr(torch.ops.aten.random_, "from") for op, _ in served) == 7
    bernoulli = torch.ops.aten.bernoulli_.float
    assert [served.count((bernoulli, d)) for d in (torch.bfloat16, torch.float16, torch.float64)] == [2, 2, 3]
    normal = torch.ops.aten.normal_.default
    assert [served.count((normal, d)) for d in (torch.bfloat16, torch.float16)] == [2, 2]
    uniform = torch.ops.aten.uniform_.default
    assert [served.count((uniform, d)) for d in (torch.bfloat16, torch.float16, torch.float64)] == [1, 1, 2]
    exponential = torch.ops.aten.exponential_.default
    assert [served.count((exponential, d)) for d in (torch.float32, torch.bfloat16, torch.float64)] == [2, 1, 1]


def _gpt2_bfloat16() -> list[torch.Tensor]:
    """A transformers GPT-2 (nobody here wrote it) in bfloat16 with every dropout live, a
    forward and backward in a step: its loss and every gradient."""
    model = copy.deepcopy(_gpt2())
    ids = torch.arange(48).remainder(100).reshape(4, 12)
    with compile_rng.step(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


@functools.cache
def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16,
                                     resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, bos_token_id=99, eos_token_id=99)
    return transformers.GPT2LMHeadModel(config).to(torch.bfloat16).train()  # both runs copy it


def test_the_c_lane_draws_a_bfloat16_gpt2s_masks_as_the_general_path(monkeypatch):
    """transformers' GPT-2 in bfloat16: its dropouts (bfloat16 activations, float32 where it
    upcasts) take the lane, and the loss, every gradient, the stream position and the
    recorded counters are the general path's, bitwise."""
    _gpt2()  # built once, before either run's seed
    lane, general, served = _lane_and_general(_gpt2_bfloat16, monkeypatch)
    assert served >= 5, served  # the embeddings, and each block's attention output and MLP
    _assert_same((*lane, []), (*general, []))


def _lane_declines() -> list[torch.Tensor]:
    """Dropouts the lane leaves to the Python kernel: under torch's modules that say the
    batch dim (their frames are on the stack)."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=False)
    lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.5)
    with compile_rng.step(4):
        x = torch.ones(4, 3, 8)
        out = [attention(x, x, x)[0], attention(x, x, x, need_weights=False)[0]]
    with compile_rng.step(3):
        out += [layer(torch.ones(5, 3, 8)), lstm(torch.ones(5, 3, 8))[0]]
    return out


def test_the_c_lane_declines_what_it_does_not_serve(monkeypatch):
    """Not-served layouts and every :func:`_lane_declines` case: the lane reserves nothing
    (the Python kernel serves them), and the values are the general path's."""
    for scenario in (_not_served_layouts, _lane_declines):
        lane, general, served = _lane_and_general(scenario, monkeypatch)
        assert served == 0, scenario.__name__
        _assert_same((*lane, []), (*general, []))
        monkeypatch.undo()


def test_other_layouts_dtypes_and_arguments_take_the_general_path(monkeypatch):
    """Not contiguous, float64 or bfloat16 (the short path in Python serves float32 only), a
    Parameter, a bound float32 cannot hold, tensor
    ``p``, meta, sequence-major and interleaved rows: not served (nothing reserved
    first), same values."""
    short, general, served = _both_ways(_not_served_layouts, monkeypatch)
    assert served == 0
    _assert_same(short, general)


def test_generator_and_refused_arguments_take_the_general_path(monkeypatch):
    """``generator=`` draws torch's values from it; arguments torch refuses raise torch's
    own error, whichever path is on."""
    def scenario():
        with compile_rng.step(4):
            g = torch.Generator().manual_seed(7)
            drawn = [torch.ones(4, 4).bernoulli_(0.5, generator=g), torch.ones(4, 4).uniform_(generator=g)]
            drawn += [torch.randn(4, 4, generator=g), torch.rand(4, 4, generator=g)]
            drawn += [torch.randint(0, 9, (4, 4), generator=g), torch.zeros(4, dtype=torch.int64).random_(0, 9, generator=g)]
            for bad in (lambda t: t.bernoulli_(1.5), lambda t: t.bernoulli_(float("nan")),
                        lambda t: t.uniform_(2.0, 1.0), lambda t: t.uniform_(-3e38, 3e38),
                        lambda t: t.normal_(0.0, -1.0), lambda t: t.normal_(0.0, float("nan")),
                        lambda t: t.exponential_(-1.0), lambda t: t.exponential_(0.0),
                        lambda t: torch.rand(-1, 4), lambda t: torch.randint(5, 3, (4,)),
                        lambda t: t.long().random_(3, 3), lambda t: t.to(torch.int8).random_(0, 300),
                        lambda t: torch.randint(0, 9, (-1,))):
                with pytest.raises(RuntimeError) as refused:
                    bad(torch.ones(4, 4))
                drawn.append(torch.tensor([len(str(refused.value))]))  # the same message both ways
            return drawn

    short, general, served = _both_ways(scenario, monkeypatch)
    assert served == 0
    g = torch.Generator().manual_seed(7)
    assert torch.equal(short[0][0], torch.ones(4, 4).bernoulli_(0.5, generator=g))  # torch's values
    _assert_same(short, general)
    monkeypatch.undo()
    lane, general, served = _lane_and_general(scenario, monkeypatch)  # the C++ lane likewise
    assert served == 0
    _assert_same((*lane, []), (*general, []))


def test_a_draw_under_a_users_dispatch_mode(monkeypatch):
    """A user's mode sees the op first; what it runs reaches the kernel with the mode off
    (served there), and the values are the general path's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    def scenario():
        with compile_rng.step(4), Seen():
            return [torch.ones(4, 4).bernoulli_(0.5), F.dropout(torch.ones(4, 4), 0.5)]

    short, general, served = _both_ways(scenario, monkeypatch)
    assert served == 2 and torch.ops.aten.bernoulli_.float in seen
    _assert_same(short, general)
    monkeypatch.undo()
    lane, general, served = _lane_and_general(scenario, monkeypatch)  # the C++ lane likewise
    assert served == 2
    _assert_same((*lane, []), (*general, []))


def _tensor_arguments() -> list[torch.Tensor]:
    """bernoulli with tensor ``p`` (its elements 0 and 1 too) and normal with a tensor mean,
    std or both, at a rank's rows, in microbatches and in a replica stream; and what the
    short path leaves to the general path: an element that is no probability or a negative
    std (torch's error), shapes that broadcast, float64."""
    p = torch.linspace(0, 1, 4 * 3 * 5).view(4, 3, 5)
    out = []
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
        out += [torch.bernoulli(p), torch.normal(p, p * 2), torch.normal(p, 0.5), torch.normal(-1.0, p)]
    with compile_rng.step(8) as step:
        for _ in range(2):
            with step.microbatch(4):
                out += [torch.bernoulli(p), torch.normal(p - 0.5, p)]
    with eager_stream():
        out += [torch.bernoulli(p[0]), torch.normal(p[0], p[0])]
    with compile_rng.step(4):
        for bad in (lambda: torch.bernoulli(p + 0.5), lambda: torch.normal(p, p - 0.5),
                    lambda: torch.normal(p, float("nan"))):
            with pytest.raises(RuntimeError) as refused:
                bad()
            out.append(torch.tensor([len(str(refused.value))]))  # the same message both ways
        out += [torch.normal(p, p[:1]), torch.bernoulli(p.double()), torch.normal(p.double(), 1.0)]
    return out


def test_tensor_arguments_take_the_short_path_with_the_general_paths_values(monkeypatch):
    """bernoulli(p) and normal(mean, std) with tensors: the short path serves the 10 plain
    calls (and nothing else) and draws the general path's values, stream position and
    counters."""
    served: list = []
    reserve = short_draws._reserve
    monkeypatch.setattr(short_draws, "_reserve", lambda func, *a, **k: served.append(func) or reserve(func, *a, **k))
    short, general, _ = _both_ways(_tensor_arguments, monkeypatch)
    assert [f.name() for f in served] == (
        ["aten::bernoulli", "aten::normal.Tensor_Tensor", "aten::normal.Tensor_float", "aten::normal.float_Tensor"]
        + ["aten::bernoulli", "aten::normal.Tensor_Tensor"] * 2 + ["aten::bernoulli", "aten::normal.Tensor_Tensor"]
    )
    _assert_same(short, general)


SEED, GLOBAL, ROW = 29, 8, (3, 5)  # a global batch of 8 rows of 3x5 elements


def _draws(rows: int) -> list[torch.Tensor]:
    """Dropout's bernoulli_, rand, randn, randint, a bfloat16 bernoulli_, randn and rand, and
    exponential_ on ``rows`` rows, each at its rows of the step's global batch."""
    return [torch.empty(rows, *ROW).bernoulli_(0.3), torch.rand(rows, *ROW), torch.randn(rows, *ROW),
            torch.randint(-3, 2**32 - 3, (rows, *ROW)), torch.empty(rows, *ROW, dtype=torch.bfloat16).bernoulli_(0.6),
            torch.randn(rows, *ROW, dtype=torch.bfloat16), torch.rand(rows, *ROW, dtype=torch.bfloat16),
            torch.empty(rows, *ROW).exponential_(2.0)]


def _expected(first_row: int, rows: int) -> list[torch.Tensor]:
    """The reference's values of :func:`_draws` at global rows ``[first_row, first_row + rows)``."""
    inner = ROW[0] * ROW[1]
    advance = GLOBAL * inner  # a multiple of 4: each draw starts where the last ended
    counters = [first_row * inner + i for i in range(rows * inner)]
    shape = (rows, *ROW)
    keep = torch.tensor([float(ref.keep_bernoulli(SEED, n, 0.3)) for n in counters]).view(shape)
    uniform = torch.tensor([ref.uniform01(SEED, advance + n, "float32") for n in counters]).view(shape)
    normal = torch.tensor([ref.normal_std(SEED, 2 * advance + n) for n in counters], dtype=torch.float64).view(shape)
    integers = torch.tensor([ref.randint(SEED, 3 * advance + n, -3, 2**32 - 3) for n in counters]).view(shape)
    keep16 = torch.tensor([float(ref.keep_bernoulli(SEED, 4 * advance + n, 0.6)) for n in counters])
    normal16 = torch.tensor([ref.normal_std(SEED, 5 * advance + n) for n in counters], dtype=torch.float64)
    uniform16 = torch.tensor([ref.uniform01(SEED, 6 * advance + n, "bfloat16") for n in counters])
    exponential = torch.tensor([ref.exponential(SEED, 7 * advance + n, 2.0) for n in counters], dtype=torch.float64)
    return [keep, uniform, normal, integers, keep16.to(torch.bfloat16).view(shape), normal16.view(shape),
            uniform16.to(torch.bfloat16).view(shape), exponential.view(shape)]


def _assert_reference(drawn: list[torch.Tensor], first_row: int) -> None:
    keep, uniform, normal, integers, keep16, normal16, uniform16, exponential = _expected(first_row, drawn[0].shape[0])
    assert torch.equal(drawn[0], keep) and torch.equal(drawn[1], uniform) and torch.equal(drawn[3], integers)
    assert drawn[4].dtype == torch.bfloat16 and torch.equal(drawn[4], keep16)
    assert drawn[6].dtype == torch.bfloat16 and torch.equal(drawn[6], uniform16)  # exact in bfloat16
    # float32 arithmetic against float64 math: (W + 1) rounded to float32, then log's few ulp
    assert torch.allclose(drawn[7].double(), exponential, rtol=2e-6, atol=1e-6)
    # a bfloat16 normal: the float32 one rounded, within half of bfloat16's ulp of the math
    assert drawn[5].dtype == torch.bfloat16 and torch.allclose(drawn[5].double(), normal16, rtol=2**-8, atol=2**-8)
    # the float32 Box-Muller kernel against float64 math: its conformance bound, a few ulp
    assert torch.allclose(drawn[2].double(), normal, rtol=2e-6, atol=2e-6)


def test_the_short_path_draws_the_references_values_at_a_ranks_rows(monkeypatch):
    served: list = []
    _counting(monkeypatch, served, ("fast_f32", "normal_f32", "integers"))
    compile_rng.manual_seed(SEED)
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=GLOBAL):
        drawn = _draws(4)
        p = torch.linspace(0, 1, 4 * ROW[0] * ROW[1]).view(4, *ROW)
        drawn += [torch.bernoulli(p), torch.normal(p, p * 2)]
    assert len(served) == 10
    _assert_reference(drawn[:-2], first_row=4)
    # the two tensor-argument draws after the eight: rows 4-7 of theirs
    inner = ROW[0] * ROW[1]
    counters = [8 * GLOBAL * inner + 4 * inner + i for i in range(4 * inner)]
    keep = [float(ref.keep_bernoulli(SEED, n, q)) for n, q in zip(counters, p.flatten().tolist())]
    assert torch.equal(drawn[-2], torch.tensor(keep).view(p.shape))
    normal = torch.tensor([ref.normal_std(SEED, GLOBAL * inner + n) for n in counters], dtype=torch.float64)
    assert torch.allclose(drawn[-1].double(), normal.view(p.shape) * p.double() * 2 + p.double(), rtol=4e-6, atol=4e-6)


def _gloo_body(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    served: list = []
    _counting(pytest.MonkeyPatch(), served, ("fast_f32", "normal_f32"))  # this process ends with the body
    compile_rng.manual_seed(SEED)
    with compile_rng.step(4, data_parallel=dist.group.WORLD):
        drawn = _draws(4)
    gathered = [None] * world
    dist.all_gather_object(gathered, (drawn, len(served), compile_rng.get_state()))
    if rank == 0:
        torch.save(gathered, out)


@pytest.mark.slow
def test_real_ranks_on_the_short_path_draw_the_one_process_batch(tmp_path):
    """Two gloo ranks of 4 rows each: each rank's draws (on the short path) are its rows of
    the reference's global batch, and the stream ends where one process's does."""
    out = str(tmp_path / "ranks.pt")
    spawn(_gloo_body, 2, out)
    gathered = torch.load(out)
    compile_rng.manual_seed(SEED)
    with compile_rng.step(GLOBAL):
        whole = _draws(GLOBAL)
    for rank, (drawn, served, position) in enumerate(gathered):
        assert served == 8
        assert position == compile_rng.get_state()
        _assert_reference(drawn, first_row=4 * rank)
        assert all(torch.equal(d, w[4 * rank:4 * rank + 4]) for d, w in zip(drawn, whole))


_CLEARED_MID_DRAW = """
import gc
import torch
import torch.nn.functional as F
import compile_rng
from compile_rng import installation
from compile_rng.eager import native_kernels

def draws(arm=lambda: None):
    compile_rng.manual_seed(5)
    with compile_rng.step(4):
        arm()
        return F.dropout(torch.ones(4, 8), 0.5), torch.empty(4, 8).uniform_(), torch.rand(4, 8), torch.randn(4, 8)

want = draws()
native = native_kernels.load()
armed = []

def clear(phase, info):
    if armed and phase == "start":
        armed.clear()
        native.clear_lane()

gc.callbacks.append(clear)
threshold = gc.get_threshold()
allocations = 0
while not armed:  # until the draws end before the collection: every allocation has had one
    allocations += 1
    installation._set_lane(native)
    got = draws(lambda: (gc.collect(), gc.set_threshold(allocations), armed.append(allocations)))
    gc.set_threshold(*threshold)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), allocations
print(allocations)
"""


def test_a_lane_cleared_mid_draw_keeps_the_draw_whole():
    """``uninstall()`` on another thread clears the lane whenever this thread's draw lets go
    of the GIL - in any Python call, a garbage collection's callbacks included. Here a
    collection's callback clears it at each GC-tracked allocation of four draws in turn
    (Python 3.11 collects at the allocation): every draw completes with the stream's values
    (the C++ kernel took its own references to the lane's objects; it dereferenced a
    cleared pointer before, a segmentation fault at the 6th and 7th)."""
    run = subprocess.run([sys.executable, "-c", _CLEARED_MID_DRAW], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert int(run.stdout) > 8  # the draws' allocations, each a point a collection cleared the lane
