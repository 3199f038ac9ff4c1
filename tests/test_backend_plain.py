"""backend="compile_rng" on plain tensors: values at the tracker counters, the state
advance, no stateful random op left in the graph, and the same bits from aot_eager
and Inductor."""

import reference as ref
import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4
from helpers import ref_tensor

import compile_rng

SEED = 0xDEADBEEF12345678
X = torch.randn(4, 7)


def program(x):
    a = torch.rand(3, 5)
    b = torch.randn_like(x)
    c = F.dropout(x, 0.3)
    d = torch.bernoulli(torch.full_like(x, 0.25))
    e = torch.empty(2, 3, dtype=torch.float64).uniform_(-1, 1)
    f = torch.randint(0, 10, (6,))
    return a, b, c, d, e, f


# numel of each op above, in program order: rand(3, 5); randn_like, dropout and
# bernoulli over x's (4, 7); uniform_ on (2, 3); randint of (6,)
NUMELS = [3 * 5, X.numel(), X.numel(), X.numel(), 2 * 3, 6]
# contract §2: op k advances by ceil4(numel_k) and starts at the sum of the earlier advances
ADVANCES = [ceil4(n) for n in NUMELS]
OFFSETS = [sum(ADVANCES[:k]) for k in range(len(ADVANCES))]  # 0, 16, 44, 72, 100, 108
TOTAL = sum(ADVANCES)  # 116


def expected(base: int) -> list:
    c = lambda k, n: [base + OFFSETS[k] + i for i in range(n)]  # noqa: E731
    a = ref_tensor([ref.uniform01(SEED, n, "float32") for n in c(0, NUMELS[0])], torch.float32).view(3, 5)
    b = torch.tensor([ref.normal_std(SEED, n) for n in c(1, NUMELS[1])], dtype=torch.float64).view(4, 7)
    keep = torch.tensor([ref.keep_bernoulli(SEED, n, 0.7) for n in c(2, NUMELS[2])]).view(4, 7)
    drop = X * keep.float().div_(0.7)
    d = torch.tensor([float(ref.keep_bernoulli(SEED, n, 0.25)) for n in c(3, NUMELS[3])]).view(4, 7)
    e = torch.tensor([ref.uniform01(SEED, n, "float64") * 2 - 1 for n in c(4, NUMELS[4])],
                     dtype=torch.float64).view(2, 3)
    f = torch.tensor([ref.randint(SEED, n, 0, 10) for n in c(5, NUMELS[5])])
    return [a, b, drop, d, e, f]


def check_against_reference(out, base):
    want = expected(base)
    assert torch.equal(out[0], want[0])
    assert (out[1].double() - want[1]).abs().max() < 2e-4
    assert torch.equal(out[2], want[2])
    assert torch.equal(out[3], want[3])
    assert torch.equal(out[4], want[4])
    assert torch.equal(out[5], want[5])


@pytest.fixture(scope="module", params=["aot_eager", "inductor"])
def compiled(request):
    torch._dynamo.reset()
    be = compile_rng.backend(inner=request.param)
    return be, torch.compile(program, backend=be, fullgraph=True)


def test_values_follow_the_stream_and_state_advances(compiled):
    _, fn = compiled
    compile_rng.manual_seed(SEED)
    first = fn(X)
    assert compile_rng.get_state() == (SEED, TOTAL)
    check_against_reference(first, 0)
    second = fn(X)
    assert compile_rng.get_state() == (SEED, 2 * TOTAL)
    check_against_reference(second, TOTAL)


def test_torch_manual_seed_habit_replays(compiled):
    _, fn = compiled
    torch.manual_seed(SEED)
    a = fn(X)
    torch.manual_seed(SEED)
    b = fn(X)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_no_stateful_random_op_left(compiled):
    be, fn = compiled
    fn(X)
    (plan,) = be.plans
    assert [op.original for op in plan.ops] == [
        "aten.rand.default", "aten.randn_like.default", "aten.native_dropout.default",
        "aten.bernoulli.default", "aten.uniform.default", "aten.randint.low",
    ]
    assert [int(op.offset) for op in plan.ops] == OFFSETS
    assert int(plan.total_advance) == TOTAL
    code = plan.graphs[-1]
    assert "compile_rng.uniform" in code and "compile_rng.dropout" in code
    for stateful in ("aten.rand.", "aten.randn", "native_dropout", "aten.bernoulli", "aten.uniform", "aten.randint"):
        assert stateful not in code


def test_registered_backend_name():
    torch._dynamo.reset()
    compile_rng.manual_seed(SEED)
    out = torch.compile(lambda: torch.rand(3, 5), backend="compile_rng")()
    assert torch.equal(out, expected(0)[0])
    assert compile_rng.get_state() == (SEED, ceil4(3 * 5))  # 16: the one rand(3, 5)


def test_inductor_equals_aot_eager_bitwise():
    torch._dynamo.reset()
    outs = []
    for inner in ("aot_eager", "inductor"):
        compile_rng.manual_seed(3)
        fn = torch.compile(lambda x: (torch.rand_like(x), F.dropout(x, 0.5)), backend=compile_rng.backend(inner=inner))
        outs.append(fn(X))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_dynamic_shapes_one_graph_symbolic_advance():
    torch._dynamo.reset()
    be = compile_rng.backend()
    fn = torch.compile(lambda x: torch.rand_like(x) + F.dropout(x, 0.5), backend=be, dynamic=True)
    compile_rng.manual_seed(11)
    base = 0
    for shape in [(4, 7), (5, 9), (3, 13)]:
        x = torch.ones(shape)
        out = fn(x)
        n = x.numel()
        adv = (n + 3) // 4 * 4
        u = ref_tensor([ref.uniform01(11, base + i, "float32") for i in range(n)], torch.float32)
        keep = torch.tensor([ref.keep_bernoulli(11, base + adv + i, 0.5) for i in range(n)]).float()
        assert torch.equal(out.flatten(), u + keep * 2.0)
        base += 2 * adv
        assert compile_rng.get_state() == (11, base)
    assert len(be.plans) == 1
    assert not be.plans[0].total_advance.is_Integer


def test_dropout_backward_uses_the_forward_mask():
    torch._dynamo.reset()

    def loss(x, w):
        return (F.dropout(x, 0.4) * w).sum()

    x = torch.randn(6, 10, requires_grad=True)
    w = torch.randn(6, 10, requires_grad=True)
    compile_rng.manual_seed(SEED)
    torch.compile(loss, backend=compile_rng.backend())(x, w).backward()
    keep = torch.tensor([ref.keep_bernoulli(SEED, i, 0.6) for i in range(x.numel())]).view(6, 10).float()
    scale = keep / 0.6
    assert torch.equal(w.grad, x.detach() * scale)
    assert torch.equal(x.grad, w.detach() * scale)


def test_unsupported_random_op_names_the_op():
    """A complex draw has no compiled form: refused, naming the op and the fix."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match="aten.randn.default draws a complex tensor.*view_as_complex"):
        torch.compile(lambda x: torch.randn(x.shape, dtype=torch.complex64) + x, backend=compile_rng.backend(inner="aot_eager"))(X)


def test_explicit_generator_runs_eagerly_from_that_generator():
    # Dynamo graph-breaks on a user generator: the op runs in eager, from the user's
    # generator, and compile_rng's stream is untouched (documented in the README).
    torch._dynamo.reset()
    be = compile_rng.backend(inner="aot_eager")
    fn = torch.compile(lambda x: torch.rand(3, generator=x) * 2, backend=be)
    got = fn(torch.Generator().manual_seed(5))
    assert torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(5)) * 2)
    assert compile_rng.get_state() == (0, 0)
    assert all(not plan.ops for plan in be.plans)


@pytest.mark.parametrize("kw", [{"layout": "nope"}, {"mode": "nope"}, {"inner": "nope"}])
def test_backend_arguments_are_checked(kw):
    with pytest.raises(ValueError, match="nope"):
        compile_rng.backend(**kw)


def test_torch_compile_mode_and_options_reach_inductor(monkeypatch):
    from compile_rng._torch import inductor_internals

    seen, user_pass_calls = [], []
    real = inductor_internals.inductor_compile
    monkeypatch.setattr(
        inductor_internals, "inductor_compile", lambda gm, inputs, patches, dec: seen.append(patches) or real(gm, inputs, patches, dec)
    )
    options = {"epilogue_fusion": False, "joint_custom_pre_pass": user_pass_calls.append}
    # torch.compile takes mode or options, not both
    for kw in ({"mode": "max-autotune-no-cudagraphs"}, {"options": options}):
        torch._dynamo.reset()
        compile_rng.manual_seed(SEED)
        check_against_reference(torch.compile(program, backend="compile_rng", **kw)(X), 0)
    by_mode, by_options = seen
    assert by_mode["max_autotune"] is True and by_mode["coordinate_descent_tuning"] is True
    assert by_options["epilogue_fusion"] is False
    assert "max_autotune" not in by_options
    assert len(user_pass_calls) == 1  # the user's joint pass runs after compile_rng's


def test_unknown_inductor_options_and_options_without_inductor_raise():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown Inductor option 'no_such_option'"):
        torch.compile(lambda: torch.rand(2), backend="compile_rng", options={"no_such_option": 1})()
    with pytest.raises(Exception, match="inner compiler is 'aot_eager'"):
        torch.compile(lambda: torch.rand(2), backend=compile_rng.backend(inner="aot_eager"), mode="max-autotune")()


def test_compile_takes_torch_compile_mode_and_the_old_layout_spelling_warns():
    torch._dynamo.reset()
    with pytest.warns(DeprecationWarning, match="spell it layout='invariant'"):
        old = compile_rng.compile(lambda: torch.rand(5) * 1, mode="invariant")
    with pytest.warns(DeprecationWarning, match="spell it layout='invariant'"):
        assert compile_rng.backend(mode="invariant").config.layout == "invariant"
    new = compile_rng.compile(lambda: torch.rand(5) * 1, layout="invariant", mode="max-autotune-no-cudagraphs")
    assert old.backend.config.layout == new.backend.config.layout == "invariant"
    outs = []
    for fn in (old, new):
        compile_rng.manual_seed(1)
        outs.append(fn())
    assert torch.equal(*outs) and torch.equal(outs[0], expected_uniform(1, 5))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        compile_rng.compile(lambda: 0, layout="invariant", mode="tracker")


def expected_uniform(seed: int, n: int) -> torch.Tensor:
    return ref_tensor([ref.uniform01(seed, c, "float32") for c in range(n)], torch.float32)
