"""The audit of every aten op torch tags ``nondeterministic_seeded`` (README table):
each family is rewritten, decomposed into rewritten ops, not random for the arguments
that switch its dropout off, or refused with an error that names the op and the fix.
A family this table does not know (a newer torch) fails the first test."""

import functools

import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4

import compile_rng
from compile_rng.semantics.random_ops import INPLACE, RULES, draws, unsupported

aten = torch.ops.aten

REWRITTEN = {
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "uniform", "uniform_", "normal",
    "normal_", "bernoulli", "bernoulli_", "exponential", "exponential_", "log_normal", "log_normal_", "cauchy",
    "cauchy_", "geometric", "geometric_", "native_dropout", "normal_functional", "random", "random_",
}
# CompositeImplicit ops (and rrelu's noise, which the backend decomposes): what reaches
# the pass is native_dropout / bernoulli_ / uniform.
DECOMPOSED = {
    "dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout", "feature_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "rrelu", "rrelu_", "rrelu_with_noise", "rrelu_with_noise_",
    "rrelu_with_noise_functional", "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
}
ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps",
    "_flash_attention_forward", "_efficient_attention_forward", "_flash_attention_forward_no_dropout_inplace",
    "_cudnn_attention_forward", "_cudnn_attention_backward", "_triton_scaled_dot_attention", "_fill_mem_eff_dropout_mask_",
}
RNN = {"lstm", "gru", "rnn_tanh", "rnn_relu", "_cudnn_rnn", "miopen_rnn", "_lstm_mps", "_cudnn_init_dropout_state"}
# Samplers drawn by counter-based forms of their own (tests/test_random_ops_in_stream.py).
SAMPLED = {"poisson", "_standard_gamma", "multinomial", "randperm", "binomial", "_sample_dirichlet"}
# A CUDA-only fused dropout: an error naming the op.
REFUSED = {"_fused_dropout"}
# Tagged but never random (left alone whatever the arguments).
NOT_RANDOM = {"_fused_sdp_choice", "_nested_tensor_softmax_with_shape", "_cudnn_attention_forward_no_dropout_inplace"}


@functools.cache
def tagged_families() -> dict[str, list]:
    """Every aten overload with the tag, by family (from the full schema registry: the
    ``torch.ops.aten`` namespace lists only the packets accessed so far)."""
    families: dict[str, list] = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name = schema.name[len("aten::"):]
        op = getattr(getattr(aten, name), schema.overload_name or "default")
        if torch.Tag.nondeterministic_seeded in op.tags:
            families.setdefault(name, []).append(op)
    return families


def family(name: str) -> list:
    """The tagged overloads of ``name``; a family this torch does not have (the table
    also covers other torch versions) skips the case instead of passing on no ops."""
    ops = tagged_families().get(name)
    if not ops:
        pytest.skip(f"torch {torch.__version__} has no nondeterministic_seeded aten.{name}")
    return ops


def test_every_tagged_family_is_audited():
    families = tagged_families()
    audited = REWRITTEN | DECOMPOSED | ATTENTION | RNN | SAMPLED | REFUSED | NOT_RANDOM
    assert set(families) <= audited, sorted(set(families) - audited)
    assert len(families) >= 70  # torch 2.11 (2.13: 71, with _flash_attention_forward_no_dropout_inplace)


@pytest.mark.parametrize("name", sorted(REWRITTEN))
def test_rewritten_families_have_rules_for_their_functional_overloads(name):
    ops = [op for op in family(name) if not op._overloadname.endswith(("out", "generator"))]
    ops = [op for op in ops if "generator" not in op._overloadname and op._overloadname != "Tensor"
           or op in RULES]
    assert ops and all(op in RULES or op in INPLACE for op in ops), (name, ops)


@pytest.mark.parametrize("fn", [
    lambda x: F.dropout(x, 0.3, training=True),
    lambda x: F.alpha_dropout(x, 0.3, training=True),
    lambda x: F.rrelu(x, training=True),
], ids=["dropout", "alpha_dropout", "rrelu"])
def test_decomposed_families_land_on_the_stream(fn):
    torch._dynamo.reset()
    be = compile_rng.backend(inner="aot_eager")
    x = torch.randn(4, 8) - 0.5
    compile_rng.manual_seed(3)
    first = torch.compile(fn, backend=be)(x)
    assert compile_rng.get_state() == (3, ceil4(x.numel()))  # one stream draw over x's elements
    compile_rng.manual_seed(3)
    assert torch.equal(torch.compile(fn, backend=be)(x), first)
    assert all("compile_rng" in op.replacement for plan in be.plans for op in plan.ops)


@pytest.mark.parametrize("name", sorted(ATTENTION | RNN))
def test_fused_kernels_are_random_only_with_their_dropout(name):
    for op in family(name):
        arguments = {a.name for a in op._schema.arguments}
        switch = {"dropout_p", "dropout", "train", "training"} & arguments
        assert switch, op
        off = {"dropout_p": 0.0} if "dropout_p" in switch else {"dropout": 0.0}
        assert not draws(op, off)
        if "train" in switch:
            assert not draws(op, {"dropout": 0.5, "train": False})
        on = {"dropout_p": 0.1} if "dropout_p" in switch else {"dropout": 0.1, "train": True}
        assert draws(op, on)
        message = str(unsupported(op))
        assert str(op) in message and ("math backend" in message or "nn.Dropout" in message), message


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_families_name_the_op_and_the_fix(name):
    for op in family(name):
        message = str(unsupported(op))
        assert str(op) in message and ("F.dropout" in message or "out of the compiled region" in message)


@pytest.mark.parametrize("name", sorted(NOT_RANDOM))
def test_tagged_helpers_that_never_draw(name):
    for op in family(name):
        assert not draws(op, {"dropout_p": 0.5})


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_every_overload_of_a_sampled_family_draws_by_a_rule(name):
    """The functional op, its ``out=`` and ``generator=`` overloads: each reaches a rule."""
    from compile_rng.semantics.random_ops import functional_form

    for op in family(name):
        assert functional_form(op) is not None, op


def _value(argument):
    kind = str(argument.type)
    if "Tensor" in kind:
        return torch.ones(2, 3)
    return [2, 3] if "[]" in kind else 0.25 if "float" in kind else True if "bool" in kind else 1


@pytest.mark.parametrize("op", sorted(set(RULES) | set(INPLACE), key=str), ids=str)
def test_arguments_are_named_as_torch_fx_names_them(op):
    """compile_rng's own binder of random ops' arguments (read once per op, for speed)
    against torch.fx's ``normalize_function``, for every count of positional arguments; a
    ``dtype`` default is the dtype the schema names, not the enum's int fx gives (``randint``'s
    ``4`` is a device index to ``Tensor.to``)."""
    from torch.fx.operator_schemas import normalize_function

    from compile_rng.semantics.random_ops import normalized_arguments

    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    required = sum(not a.has_default_value() for a in positional)
    keywords = {a.name: _value(a) for a in op._schema.arguments if a.kwarg_only and "Generator" not in str(a.type)
                and a.name not in ("out", "dtype", "layout", "device", "pin_memory", "memory_format")}
    for count in range(required, len(positional) + 1):
        args = tuple(_value(a) for a in positional[:count])
        expected = dict(normalize_function(op, args, keywords, normalize_to_only_use_kwargs=True).kwargs)
        got = normalized_arguments(op, args, keywords)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            if name == "dtype" and type(value) is int:  # fx keeps the schema's ScalarType int (4: long)
                value = torch.empty(0, dtype={4: torch.int64, 6: torch.float32}[value]).dtype
            assert got[name] is value or (type(got[name]) is type(value) and got[name] == value), name
