"""Which aten random ops compile_rng replaces, and by what.

One rule per functional aten overload maps a call to the functional ops of
:mod:`compile_rng.ops` (plus plain aten arithmetic for derived distributions). The
rules are written against :class:`RandomCall`, so the same table serves the graph pass
(``compile_rng.passes.functionalize_rng``, rewriting FX nodes) and the DTensor tracker
(:mod:`compile_rng.eager.tracker`, replacing the local op of a DTensor at dispatch time).
In-place ops map to their functional overload through :data:`INPLACE`.
"""

from __future__ import annotations

import functools
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_rng import ops as _ops  # noqa: F401  (registers torch.ops.compile_rng)
from compile_rng._torch.core_internals import OpOverload, op_arguments, op_name, schema_default

aten = torch.ops.aten
cr = torch.ops.compile_rng
prims = torch.ops.prims


def normalized_arguments(op: OpOverload, args: tuple, kwargs: dict) -> dict:
    """``op``'s arguments by name (positional ones too, absent ones at their schema
    defaults), as its schema names them; the eager modes and the graph pass read random
    ops' arguments through this one view. An eager random op in a step pays for it on
    every call, so the schema is read once per op (torch.fx's ``normalize_function``
    binds the same way through ``inspect``, at several times the cost)."""
    names, defaults = _schema_of(op)
    if len(args) > len(names):
        raise TypeError(f"{op} takes {len(names)} arguments, got {len(args)} positional ones")
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


_schemas: dict[Any, tuple[tuple[str, ...], dict[str, Any]]] = {}


def _schema_of(op: OpOverload) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(argument names in order, their defaults)`` of ``op``'s schema (None where an
    argument has no default; ``self`` named ``input``, as torch.fx names it)."""
    found = _schemas.get(op)
    if found is None:
        arguments = op_arguments(op)
        names = tuple("input" if a.name == "self" else a.name for a in arguments)
        found = names, {n: schema_default(a) if a.has_default_value() else None for n, a in zip(names, arguments)}
        _schemas[op] = found
    return found


class RandomCall(ABC):
    """One random op call being replaced, with the counter layout it was assigned.

    ``emit`` calls a functional op with this call's key and offset prepended; ``apply``
    calls any other op (arithmetic on the result). Both return whatever the context
    works with: FX nodes in the graph pass, tensors at dispatch time.
    """

    op: OpOverload  # the functional overload
    dtype: torch.dtype  # output dtype
    device: torch.device | None  # output device (None where only the arguments are checked)
    kw: dict  # the op's arguments by name (:func:`normalized_arguments`)

    def arg(self, name: str, default: Any = None) -> Any:
        """Argument ``name``, or ``default`` where it is absent or None."""
        value = self.kw.get(name)
        return default if value is None else value

    @abstractmethod
    def size(self) -> list:
        """The output's shape (ints, SymInts or nodes)."""

    @abstractmethod
    def strides(self) -> list:
        """Counter strides, one per output dim."""

    @abstractmethod
    def emit(self, target: OpOverload, *args: Any) -> Any: ...

    @abstractmethod
    def apply(self, target: Callable, *args: Any) -> Any: ...

    def fail(self, why: str, fix: str) -> None:
        raise RandomArgumentError(f"compile_rng: {self.op}: {why}; {fix}")


class RandomArgumentError(RuntimeError):
    """Arguments a random op refuses. The conditions are torch's own (a RuntimeError there
    too); eager code raises torch's exception itself where torch has one for the call."""


def _values_known(value: Any) -> bool:
    """Whether ``value`` is a tensor with values here (eager), not a traced one or a node."""
    return type(value) is torch.Tensor and value.numel() > 0


def _probability(call: RandomCall, name: str) -> float:
    p = float(call.arg(name))
    if not is_probability(p):
        call.fail(f"{name}={p} is not a probability", "pass a value in [0, 1]")
    return p


def is_probability(p: float) -> bool:
    """Whether torch accepts ``p`` as a probability: in [0, 1], not NaN."""
    return 0.0 <= p <= 1.0


def _floating(call: RandomCall, t: Any, what: str) -> None:
    """Refuse a tensor argument ``t`` that is not floating point (ATen's kernels dispatch
    on it: torch's own error is raised where it refuses it)."""
    if isinstance(t, torch.Tensor) and not t.dtype.is_floating_point:
        call.fail(f"{what} of dtype {t.dtype}", f"pass {what} as a floating-point tensor")


def _float_dtype(call: RandomCall) -> torch.dtype:
    from compile_rng.stream import FLOAT_DTYPES

    if call.dtype not in FLOAT_DTYPES:
        call.fail(f"dtype {call.dtype} has no continuous distribution", "use a floating-point tensor")
    return call.dtype


def _uniform(call: RandomCall) -> Any:
    low, high = float(call.arg("from", 0.0)), float(call.arg("to", 1.0))
    dtype = _float_dtype(call)
    fault = uniform_fault(low, high, dtype)
    if fault is not None:
        call.fail(*fault)
    return call.emit(cr.uniform.default, call.size(), call.strides(), low, high, dtype)


def uniform_fault(low: float, high: float, dtype: torch.dtype) -> tuple[str, str] | None:
    """Why torch refuses ``uniform_(low, high)`` on a floating ``dtype`` (what, and the
    fix), or None where it accepts it."""
    limit = torch.finfo(dtype).max
    for name, bound in (("from", low), ("to", high)):
        if not -limit <= bound <= limit:  # ATen: out of the dtype's bounds (NaN too)
            return f"{name}={bound} is out of bounds for {dtype}", "pass finite bounds the dtype holds"
    if not low <= high:
        return f"from={low} > to={high}", "pass from <= to"
    if not high - low <= limit:
        return f"to - from = {high - low} exceeds the largest {dtype}", "narrow the range"
    return None


def _standard_normal(call: RandomCall, mean: float = 0.0, std: float = 1.0) -> Any:
    return call.emit(cr.normal.default, call.size(), call.strides(), mean, std, _float_dtype(call))


def _normal(call: RandomCall) -> Any:
    mean, std = call.arg("mean", 0.0), call.arg("std", 1.0)
    if isinstance(std, (int, float)):  # ATen refuses a negative or NaN std with a tensor mean too
        if not std >= 0:
            call.fail(f"std={std} is negative", "pass std >= 0")
    elif _values_known(std) and not bool(std.min() >= 0):  # ATen: every element, NaN refused
        call.fail("an element of std is negative", "pass std >= 0")
    if isinstance(mean, (int, float)) and isinstance(std, (int, float)):
        return _standard_normal(call, float(mean), float(std))
    # tensor mean and/or std: z * std + mean, broadcast like aten.normal
    z = _standard_normal(call)
    return call.apply(aten.add.Tensor, call.apply(aten.mul.Tensor, z, std), mean)


def _exponential(call: RandomCall, dtype: torch.dtype | None = None, lambd: float | None = None) -> Any:
    lambd = float(call.arg("lambd", 1.0)) if lambd is None else lambd
    if not lambd > 0:
        call.fail(f"lambd={lambd} is not positive", "pass lambd > 0")
    dtype = dtype or _float_dtype(call)
    return call.emit(cr.exponential.default, call.size(), call.strides(), lambd, dtype)


def _log_normal(call: RandomCall) -> Any:
    if not float(call.arg("std", 1.0)) > 0:
        call.fail(f"std={call.arg('std', 1.0)} is not positive", "pass std > 0")
    return call.apply(aten.exp.default, _normal(call))


def _cauchy(call: RandomCall) -> Any:
    median, sigma = float(call.arg("median", 0.0)), float(call.arg("sigma", 1.0))
    if not sigma > 0:
        call.fail(f"sigma={sigma} is not positive", "pass sigma > 0")
    u = call.emit(cr.uniform.default, call.size(), call.strides(), -0.5, 0.5, _float_dtype(call))
    tan = call.apply(aten.tan.default, call.apply(aten.mul.Tensor, u, math.pi))
    return call.apply(aten.add.Tensor, call.apply(aten.mul.Tensor, tan, sigma), median)


def _geometric(call: RandomCall) -> Any:
    # ceil of an exponential with rate -ln(1 - p) is geometric on {1, 2, ...}
    p = float(call.arg("p"))
    if not 0.0 < p < 1.0:  # ATen's bounds, NaN refused
        call.fail(f"p={p} is not in (0, 1)", "pass p in (0, 1)")
    if call.dtype == torch.bool:  # ATen's kernel has no bool form
        call.fail("a bool tensor", "draw into an integer or floating-point tensor")
    e = _exponential(call, torch.float64, -math.log1p(-p))
    return call.apply(prims.convert_element_type.default, call.apply(aten.ceil.default, e), call.dtype)


def _bernoulli_p(call: RandomCall) -> Any:
    return call.emit(cr.bernoulli.default, call.size(), call.strides(), _probability(call, "p"), call.dtype)


def _bernoulli_tensor(call: RandomCall) -> Any:
    p = call.arg("p", None)
    if p is None:  # aten.bernoulli.default: the input holds the probabilities
        p = call.arg("input")
    _floating(call, p, "probabilities")
    if _values_known(p) and not bool(((p >= 0) & (p <= 1)).all()):  # ATen checks every element
        call.fail("an element of p is not a probability", "pass p in [0, 1]")
    if call.arg("p", None) is not None:
        if _values_known(p) and not _expands(p.shape, call.size()):
            call.fail(f"p of shape {tuple(p.shape)} does not expand to {tuple(call.size())}", "pass p of a shape that does")
        p = call.apply(aten.expand.default, p, call.size())
    return call.emit(cr.bernoulli_tensor.default, p, call.strides(), call.dtype)


def _expands(shape: Sequence[int], size: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` expands to ``size`` (``Tensor.expand``'s rule)."""
    return len(shape) <= len(size) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(size)))


def _filled(call: RandomCall, value: Any, dtype: torch.dtype) -> Any:
    """A contiguous tensor of the output's shape holding ``value``, from ops Inductor lowers
    as they are (it decomposes full_like, zeros_like and ones_like before a pass sees them)."""
    scalar = call.apply(aten.scalar_tensor.default, value, dtype=dtype, device=call.device)
    return call.apply(aten.clone.default, call.apply(aten.expand.default, scalar, call.size()),
                      memory_format=torch.contiguous_format)


def _dropout(call: RandomCall) -> Any:
    """dropout's ``(output, mask)``; where :func:`draws_nothing` says so, values from the
    arguments alone (a tuple of tensors, not a draw's output)."""
    x = call.arg("input")
    _floating(call, x, "the input")
    if draws_nothing(call.op, call.kw):
        if call.arg("train", True) is False or call.arg("p") == 0:  # the input (a copy), a mask of ones
            return call.apply(aten.clone.default, x), _filled(call, True, torch.bool)
        return _filled(call, 0, call.dtype), _filled(call, False, torch.bool)  # p = 1: zeros, a mask of zeros
    return call.emit(cr.dropout.default, x, call.strides(), _probability(call, "p"))


def draws_nothing(op: OpOverload, kw: dict) -> bool:
    """Whether random op ``op``'s rule computes its values from the arguments ``kw`` alone:
    dropout out of training or at p = 0 or 1, where torch's decomposition (a compiled
    F.dropout's) and eager F.dropout's ``_dropout_impl`` draw nothing. Reserving counters
    there would move the stream under every later op in a graph but not in eager code."""
    return op_name(op) == "native_dropout" and (kw.get("train") is False or kw.get("p") in (0.0, 1.0))


def _rrelu(call: RandomCall) -> tuple[Any, Any]:
    """``(output, noise)`` of rrelu in training, as torch's decomposition computes it
    (Inductor's ``rrelu_with_noise_functional``, which a compiled graph draws by): a
    ``uniform(lower, upper)`` of the input's shape and dtype, the input times it where
    the input is not positive, and that uniform there (else 1) as the noise."""
    x, noise = call.arg("input"), call.arg("noise")
    lower, upper = float(call.arg("lower", 0.125)), float(call.arg("upper", 1.0 / 3.0))
    dtype = _float_dtype(call)
    fault = uniform_fault(lower, upper, dtype)
    if fault is not None:
        call.fail(*fault)
    # ATen's checks (2.11-2.15), which the rule would pass by: the noise it writes is the
    # input's shape and dtype (copy_ would broadcast or cast), and its CPU kernel has no float16
    if noise.shape != x.shape or noise.dtype != x.dtype:
        call.fail("the noise tensor is not of the input's shape and dtype", "pass a noise tensor like the input")
    if dtype == torch.float16 and x.device.type == "cpu":
        call.fail("rrelu has no float16 CPU kernel", "compute it in float32 or bfloat16")
    r = call.emit(cr.uniform.default, call.size(), call.strides(), lower, upper, dtype)
    not_positive = call.apply(aten.le.Scalar, x, 0)
    output = call.apply(aten.where.self, not_positive, call.apply(aten.mul.Tensor, x, r), x)
    return output, call.apply(aten.where.ScalarOther, not_positive, r, 1)


def _rrelu_with_noise(call: RandomCall) -> Any:
    # the noise argument is written in place (the op's schema: Tensor(b!) noise), as ATen does
    output, noise = _rrelu(call)
    call.apply(aten.copy_.default, call.arg("noise"), noise)
    return output


def _rrelu_with_noise_inplace(call: RandomCall) -> Any:
    # not an INPLACE entry: that writes a rule's first draw straight into the target, and
    # this rule's first draw is the noise, not the output
    return call.apply(aten.copy_.default, call.arg("input"), _rrelu_with_noise(call))


def _randint(call: RandomCall, low: int, high: int) -> Any:
    if not low < high:
        call.fail(f"empty range [{low}, {high})", "pass low < high")
    smallest, largest = integer_bounds(call.dtype)
    for name, bound in (("from", low), ("to - 1", high - 1)):
        if not smallest <= bound <= largest:  # ATen: every value the range holds fits the dtype
            call.fail(f"{name}={bound} is out of bounds for {call.dtype}", "pass a range the dtype holds")
    if high - low > 2**63:  # the contract's integers span at most 2**63 values
        call.fail(f"the range [{low}, {high}) is wider than 2**63, the widest the stream draws",
                  "draw two narrower ranges and combine them, or draw outside the stream")
    return call.emit(cr.randint.default, call.size(), call.strides(), int(low), int(high), call.dtype)


def _randint_args(call: RandomCall) -> Any:
    return _randint(call, call.arg("low", 0), call.arg("high"))


def integer_bounds(dtype: torch.dtype) -> tuple[int, int]:
    """The integers ``dtype`` holds exactly, as ATen's ``random_`` bounds them."""
    if dtype == torch.bool:
        return 0, 1
    if dtype.is_floating_point:
        digits = 1 - int(math.log2(torch.finfo(dtype).eps))
        return -(2**digits), 2**digits
    return torch.iinfo(dtype).min, torch.iinfo(dtype).max


def _random_default_high(dtype: torch.dtype) -> int:
    """``random_()``'s exclusive upper bound: every integer the dtype holds exactly - for a
    float dtype ``[0, 2**digits]``, ``digits`` its significand's bits (ATen's ``random_``)."""
    if dtype == torch.bool:
        return 2
    return integer_bounds(dtype)[1] + 1


def _random(call: RandomCall) -> Any:
    low = call.arg("from", 0)
    high = call.arg("to", None)
    return _randint(call, low, _random_default_high(call.dtype) if high is None else high)


def _randperm(call: RandomCall) -> Any:
    """A permutation of ``range(n)``: the positions of the counters' 64-bit values in
    ascending order (a stable sort: equal values, a 2**-64 event, keep their order)."""
    n = call.arg("n")  # a graph's symbolic size is checked by torch's own guards
    if isinstance(n, int) and n < 0:
        call.fail(f"n={n} is negative", "pass n >= 0")
    if call.dtype == torch.bool:  # ATen's kernel has no bool form
        call.fail("a bool permutation", "pass an integer or floating-point dtype")
    if isinstance(n, int) and call.dtype != torch.int64 and n > integer_bounds(call.dtype)[1] + 1:
        call.fail(f"n={n} is too large for {call.dtype}", "pass a wider dtype")
    keys = call.emit(cr.random_bits.default, call.size(), call.strides())
    order = call.apply(aten.sort.stable, keys, stable=True)
    return call.apply(prims.convert_element_type.default, call.apply(operator.getitem, order, 1), call.dtype)


def _check_distribution(call: RandomCall, probs: Any) -> None:
    """ATen's checks of a multinomial's probabilities (where their values are known)."""
    if not _values_known(probs):
        return
    if not bool(((probs >= 0) & probs.isfinite()).all()):
        call.fail("a probability is negative, inf or nan", "pass finite non-negative weights")
    if not bool((probs.sum(-1) > 0).all()):
        call.fail("a distribution sums to 0", "give every row a positive weight")


def _multinomial(call: RandomCall) -> Any:
    """``num_samples`` categories per row of weights. With replacement: the inverse CDF of
    one float64 uniform per sample (counters over the samples, ``(rows, num_samples)``).
    Without: ATen's own race, ``argtopk(p / q)`` with ``q`` exponential (counters over the
    weights, one per category), its samples in the order the race gives them."""
    probs, k = call.arg("input"), int(call.arg("num_samples"))
    if isinstance(probs, torch.Tensor) and (probs.dim() not in (1, 2) or not probs.dtype.is_floating_point):
        call.fail(f"weights of {probs.dim()} dims, {probs.dtype}", "pass floating-point weights of 1 or 2 dims")
    if k <= 0:
        call.fail(f"num_samples={k}", "sample at least one")
    _check_distribution(call, probs)
    if not call.arg("replacement", False):
        if isinstance(probs, torch.Tensor) and k > probs.shape[-1]:
            call.fail(f"{k} samples of {probs.shape[-1]} categories without replacement", "sample fewer")
        if _values_known(probs) and not bool(((probs > 0).sum(-1) >= k).all()):
            call.fail("fewer categories of positive weight than samples without replacement", "sample fewer")
        q = call.emit(cr.exponential.default, call.size(), call.strides(), 1.0, torch.float64)
        race = call.apply(aten.div.Tensor, probs, q)
        return call.apply(operator.getitem, call.apply(aten.topk.default, race, k), 1)
    u = call.emit(cr.uniform.default, call.size(), call.strides(), 0.0, 1.0, torch.float64)
    weights = call.apply(prims.convert_element_type.default, probs, torch.float64)
    cdf = call.apply(aten.cumsum.default, weights, -1)
    total = call.apply(aten.slice.Tensor, cdf, -1, -1)
    picks = call.apply(aten.searchsorted.Tensor, cdf, call.apply(aten.mul.Tensor, u, total), right=True)
    # the last category of positive weight where rounding leaves u * total at the top
    last = call.apply(aten.argmax.default, cdf, -1, True)
    return call.apply(aten.minimum.default, picks, last)


def _poisson(call: RandomCall) -> Any:
    rates = call.arg("input")
    _floating(call, rates, "rates")
    if _values_known(rates) and not bool((rates >= 0).all()):  # ATen: per element, NaN refused
        call.fail("a rate is negative or nan", "pass rates >= 0")
    return call.emit(cr.poisson.default, rates, call.strides())


def _binomial(call: RandomCall) -> Any:
    count, prob = call.arg("count"), call.arg("prob")
    return call.emit(cr.binomial.default, count, prob, call.strides())


def _standard_gamma(call: RandomCall) -> Any:
    return call.emit(cr.standard_gamma.default, call.arg("input"), call.strides())


def _sample_dirichlet(call: RandomCall) -> Any:
    return call.emit(cr.dirichlet.default, call.arg("input"), call.strides())


def counter_shape(op: OpOverload, kw: dict, output_shape: Any, shape_of: Callable[[Any], Any]) -> Any:
    """The shape whose counters ``op`` draws (its advance is ``ceil4`` of its numel): the
    output's, but a ``multinomial`` without replacement draws one per category (the
    shape of its weights, ``shape_of(kw["input"])``)."""
    if op_name(op) == "multinomial" and not kw.get("replacement"):
        return shape_of(kw["input"])
    return output_shape


RULES: dict[OpOverload, Callable[[RandomCall], Any]] = {
    aten.rand.default: _uniform,
    aten.rand_like.default: _uniform,
    aten.uniform.default: _uniform,
    aten.randn.default: _normal,
    aten.randn_like.default: _normal,
    aten.normal_functional.default: _normal,
    aten.normal.float_float: _normal,
    aten.normal.Tensor_float: _normal,
    aten.normal.float_Tensor: _normal,
    aten.normal.Tensor_Tensor: _normal,
    aten.exponential.default: _exponential,
    aten.log_normal.default: _log_normal,
    aten.cauchy.default: _cauchy,
    aten.geometric.default: _geometric,
    aten.bernoulli.p: _bernoulli_p,
    aten.bernoulli.default: _bernoulli_tensor,
    aten.bernoulli.Tensor: _bernoulli_tensor,
    aten.native_dropout.default: _dropout,
    aten.randint.default: _randint_args,
    aten.randint.low: _randint_args,
    aten.randint_like.default: _randint_args,
    aten.randint_like.low_dtype: _randint_args,
    aten.random.default: _random,
    getattr(aten.random, "from"): _random,
    aten.random.to: _random,
    aten.randperm.default: _randperm,
    aten.multinomial.default: _multinomial,
    aten.poisson.default: _poisson,
    aten.binomial.default: _binomial,
    aten._standard_gamma.default: _standard_gamma,
    aten._sample_dirichlet.default: _sample_dirichlet,
    aten.rrelu_with_noise_functional.default: _rrelu,
    aten.rrelu_with_noise.default: _rrelu_with_noise,
    aten.rrelu_with_noise_.default: _rrelu_with_noise_inplace,
}

#: Draws with no batch dim: a permutation is drawn whole, as a replica, in a step too (its
#: size is a count, not rows), eager and in a batched graph. A tuple: ``in`` compares by
#: identity, where a set would call OpOverload's Python ``__hash__`` on every draw.
DRAWN_WHOLE = (aten.randperm.default,)

#: Ops with a rule that a compiled graph does not draw by: its compiler decomposes them
#: first (torch's decomposition, whose values the rule computes); eager code draws by it.
DECOMPOSED_IN_GRAPHS = frozenset(
    {aten.rrelu_with_noise_functional.default, aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default}
)


def _unnamed(rule: Callable[[RandomCall], Any]) -> Callable[[RandomCall], Any]:
    """The rule of a named-tensor overload (``rand.names``, ``randn.names``: torch 2.11 and
    2.12): its unnamed form's where ``names`` is None, an error for a named tensor."""

    def rule_without_names(call: RandomCall) -> Any:
        if call.arg("names", None) is not None:
            call.fail("named tensors are not supported", "draw an unnamed tensor and name it afterwards (refine_names)")
        return rule(call)

    return rule_without_names


for _family, _rule in ((aten.rand, _uniform), (aten.randn, _normal)):
    if hasattr(_family, "names"):  # torch 2.11, 2.12
        RULES[_family.names] = _unnamed(_rule)

#: In-place random ops and the functional overload whose rule replaces them.
INPLACE: dict[OpOverload, OpOverload] = {
    aten.uniform_.default: aten.uniform.default,
    aten.normal_.default: aten.normal_functional.default,
    aten.exponential_.default: aten.exponential.default,
    aten.log_normal_.default: aten.log_normal.default,
    aten.cauchy_.default: aten.cauchy.default,
    aten.geometric_.default: aten.geometric.default,
    aten.bernoulli_.float: aten.bernoulli.p,
    aten.bernoulli_.Tensor: aten.bernoulli.Tensor,
    aten.random_.default: aten.random.default,
    getattr(aten.random_, "from"): getattr(aten.random, "from"),
    aten.random_.to: aten.random.to,
}


@dataclass(frozen=True)
class Form:
    """How an overload without a rule of its own draws: ``op``'s rule (a sibling in its
    family whose arguments are this overload's less ``generator=`` and its outputs), then
    the values written into the ``outs`` arguments (``rand.out``, ``native_dropout.out``)."""

    op: OpOverload
    outs: tuple[str, ...]


# arguments a factory's functional sibling has that its ``out=`` overload takes from ``out``
_FACTORY_ARGUMENTS = {"dtype", "layout", "device", "pin_memory", "memory_format"}
# families whose functional form has another name
_SIBLING_FAMILIES = {"normal": ("normal", "normal_functional")}


@functools.cache
def functional_form(op: OpOverload) -> Form | None:
    """The rule an overload of a random op family draws by (its own, or a sibling's and
    the outputs to write), None where the family has none (an in-place op: :data:`INPLACE`)."""
    if op in RULES:
        return Form(op, ())
    if not isinstance(op, OpOverload):
        return None
    arguments = op_arguments(op)
    outs = tuple(a.name for a in arguments if a.is_out)
    own = {_typed(a) for a in arguments if a.name not in {"generator", *outs}}
    for family in _SIBLING_FAMILIES.get(op_name(op), (op_name(op),)):
        packet = getattr(aten, family, None)
        for overload in packet.overloads() if packet is not None else ():
            sibling = getattr(packet, overload)
            if sibling in RULES:
                theirs = {_typed(a) for a in op_arguments(sibling) if a.name != "generator"}
                if own <= theirs and {n for n, _ in theirs - own} <= (_FACTORY_ARGUMENTS if outs else set()):
                    return Form(sibling, outs)
    return None


def _typed(argument: Any) -> tuple[str, str]:
    """``(name, type)`` of a schema argument; a bound of ``randint_like.Tensor`` (a 0-d
    tensor) counts as the int its sibling takes (the rule reads it with ``int()``)."""
    kind = str(argument.type)
    if argument.name in ("low", "high") and kind == "Tensor":
        kind = "int"
    return argument.name, kind


def is_random(op: object) -> bool:
    """Whether ``op`` is an aten overload that may draw from a generator."""
    return isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


# The ``nondeterministic_seeded`` tag says "may be random", not "is random for these
# arguments": a fused attention or RNN kernel draws only for its dropout, which these
# arguments switch off (SDPA at ``dropout_p=0``, an LSTM with ``dropout=0`` or ``train=False``).
_NO_DROPOUT = {"dropout_p": 0.0, "dropout": 0.0, "train": False, "training": False}
# Tagged, but never random: SDPA's backend choice, a nested-tensor softmax, and a cuDNN
# attention kernel without dropout (torch 2.15).
_NEVER_DRAWS = {"_fused_sdp_choice", "_nested_tensor_softmax_with_shape", "_cudnn_attention_forward_no_dropout_inplace"}


def draws(op: OpOverload, kw: dict) -> bool:
    """Whether a call of random-tagged ``op`` with normalized arguments ``kw`` draws."""
    if op_name(op) in _NEVER_DRAWS:
        return False
    return not any(name in kw and kw[name] == off for name, off in _NO_DROPOUT.items())


# Why a random op has no counter-based form here, and what to do instead, per op family;
# the default covers the samplers (poisson, gamma, multinomial, randperm, ...).
_FUSED_ATTENTION = (
    "a fused attention kernel draws its own dropout mask",
    "with dropout_p > 0 use the math backend (torch.nn.attention.sdpa_kernel(SDPBackend.MATH); "
    "CPU picks it by itself), whose dropout is rewritten; dropout_p=0 needs nothing",
)
_FUSED_RNN = (
    "the fused RNN kernel draws the dropout between its layers",
    "set dropout=0 and put nn.Dropout between single-layer RNN modules, or run it in eval mode",
)
_FIXES = {
    **dict.fromkeys(
        [
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
            "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps",
            "_flash_attention_forward", "_flash_attention_forward_no_dropout_inplace", "_efficient_attention_forward",
            "_cudnn_attention_forward", "_cudnn_attention_backward", "_triton_scaled_dot_attention",
            "_fill_mem_eff_dropout_mask_",
        ],
        _FUSED_ATTENTION,
    ),
    **dict.fromkeys(
        ["lstm", "gru", "rnn_tanh", "rnn_relu", "_cudnn_rnn", "miopen_rnn", "_lstm_mps", "_cudnn_init_dropout_state"],
        _FUSED_RNN,
    ),
    "_fused_dropout": ("the fused CUDA dropout kernel draws from the device generator", "call F.dropout, whose native_dropout is rewritten"),
}
_DEFAULT_FIX = (
    "it has no counter-based form",
    "move it out of the compiled region (torch.compiler.disable) or out of the DTensor program",
)


def foreign_seed_draw(op: OpOverload, kw: dict) -> bool:
    """Stock Inductor's generated code drawing its graph's seeds (``RandomSeeds``:
    ``aten.randint.low_out`` over the whole int64 range; torch 2.13-2.15)."""
    limits = torch.iinfo(torch.int64)
    return op_name(op) == "randint" and kw.get("low") == limits.min and kw.get("high") == limits.max


def unsupported(op: OpOverload, kw: dict | None = None) -> NotImplementedError:
    """The error for random op ``op`` (normalized arguments ``kw``) that compile_rng cannot draw."""
    if kw is not None and foreign_seed_draw(op, kw):
        return NotImplementedError(
            f"compile_rng: a graph compiled by another backend (stock Inductor: {op} over the whole int64 "
            "range is its seed draw) ran inside a compile_rng stream or layout block (compile_rng.step, "
            "compile_rng.compile, @compile_rng.init, compile_rng.layout): its random ops would draw torch's "
            "per-rank values, not compile_rng's. Compile it with torch.compile(..., backend='compile_rng') or "
            "compile_rng.compile(...); a library's own torch.compile calls (torchao's optimizers) inside "
            "`with compile_rng.library_compiles(layout=...)`; or run it outside the block"
        )
    why, fix = _FIXES.get(op_name(op), _DEFAULT_FIX)
    return NotImplementedError(f"compile_rng: random op {op}: {why}; {fix}")
