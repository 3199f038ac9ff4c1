"""PyTorch's own tests of its random ops, run inside compile_rng's eager stream.

The measure is torch's OpInfo database (``torch.testing._internal.common_methods_invocations``,
shipped with the torch release under test, the same inputs PyTorch's ``test_ops.py``
runs): every OpInfo whose op is random (its aten family carries the
``nondeterministic_seeded`` tag, or is one of the dropouts built on them) is called on each
of its sample inputs, for every dtype torch lists for the CPU, by its function, method and
in-place variants, stock and inside the stream. The outcome must be stock's: the same
exception (type and message) or a result of the same structure, shapes, dtypes and strides.
Its error inputs (``test_ops.py``'s ``test_errors``) must raise the error and message torch
declares for them. Values are not compared: inside a stream they are compile_rng's by design.

PyTorch's test files themselves (``test_torch.py``, ``test_tensor_creation_ops.py``,
``test_distributions.py``, functorch's ``test_vmap.py``) are not in the wheel; the
distributions and ``vmap`` randomness are checked in ``tests/test_torch_clients_in_stream.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import compile_rng
from compile_rng._torch.core_internals import op_name, random_op_overloads
from compile_rng.eager.dispatch_modes import eager_stream

pytest.importorskip("expecttest")  # torch.testing._internal's own dependency

# composites of the random ops (CompositeImplicit: they reach the stream as native_dropout,
# bernoulli_ or rrelu_with_noise); every other family comes from the tag
_COMPOSITES = {"nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
               "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu"}

# (OpInfo, variant, dtype, sample index) -> why its outcome differs by design; none today
BY_DESIGN: dict[tuple, str] = {}

#: every dtype a CPU tensor may have (torch's OpInfo dtype tests sweep these)
ALL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


@functools.cache
def random_opinfos() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    families = {op_name(op) for op in random_op_overloads()}
    return [o for o in op_db if o.name in _COMPOSITES or o.aten_name in families or o.name in families]


def _structure(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.stride() if value.layout == torch.strided else None
    if isinstance(value, (tuple, list)):
        return tuple(_structure(v) for v in value)
    return type(value)


def _outcome(fn, sample):
    try:
        result = fn(sample.input, *sample.args, **sample.kwargs)
    except Exception as e:  # noqa: BLE001 - the outcome is compared, whatever it is
        return type(e), str(e)
    return "ok", _structure(result)


def _clone(sample):
    """The sample with its tensors copied: an in-place variant must not touch the next run's."""
    def copy(v):
        return v.clone() if isinstance(v, torch.Tensor) else v

    return type(sample)(copy(sample.input), args=tuple(copy(a) for a in sample.args),
                        kwargs={k: copy(v) for k, v in sample.kwargs.items()})


def test_the_database_has_the_random_ops():
    names = {o.name for o in random_opinfos()}
    assert {"bernoulli", "multinomial", "uniform", "normal", "randint", "rand_like", "nn.functional.dropout",
            "nn.functional.rrelu"} <= names


def _full_name(info) -> str:
    return info.name + ("." + info.variant_test_name if info.variant_test_name else "")


def _by_design(name: str, dtype: torch.dtype, mine: tuple) -> bool:
    """Outcomes that differ from stock's by design: a complex normal with a tensor mean or
    std is refused with compile_rng's error (its real view is drawn instead)."""
    return name.startswith("normal") and dtype.is_complex and "complex values are drawn by" in str(mine)


def _samples(info, dtype: torch.dtype) -> list:
    """The OpInfo's sample inputs in ``dtype``; none where its generator cannot make one in
    a dtype torch does not list for the op (torch's own dtype test skips those too)."""
    try:
        return list(info.sample_inputs("cpu", dtype))
    except Exception:  # noqa: BLE001 - the generator's, not the op's: nothing to compare
        if dtype in info.supported_dtypes("cpu"):
            raise
        return []


def _differences(name: str, dtypes: Callable[[Any], Any]) -> list:
    """Each call of OpInfo ``name``'s sample inputs, for the dtypes ``dtypes(info)``, by each
    variant, whose outcome in the stream is not stock's - or which torch refuses and the
    stream moved for (a refused call draws nothing)."""
    differs = []
    for info in random_opinfos():
        if _full_name(info) != name:
            continue
        variants = {"function": info.op, "method": info.method_variant, "inplace": info.inplace_variant}
        for dtype in sorted(dtypes(info), key=str):
            for index, sample in enumerate(_samples(info, dtype)):
                for variant, fn in variants.items():
                    if fn is None:
                        continue
                    stock = _outcome(fn, _clone(sample))
                    compile_rng.manual_seed(0)
                    with eager_stream():
                        mine = _outcome(fn, _clone(sample))
                    where = (name, variant, str(dtype), index)
                    if mine != stock and where not in BY_DESIGN and not _by_design(name, dtype, mine):
                        differs.append((where, stock, mine))
                    elif stock[0] != "ok" and compile_rng.get_state() != (0, 0):
                        differs.append((where, stock, "drew", compile_rng.get_state()))
    return differs


@pytest.mark.parametrize("name", sorted({_full_name(o) for o in random_opinfos()}))
def test_sample_inputs_give_stocks_outcome(name):
    differs = _differences(name, lambda info: info.supported_dtypes("cpu"))
    assert not differs, differs[:5]


@pytest.mark.parametrize("name", sorted({_full_name(o) for o in random_opinfos()}))
def test_dtypes_torch_does_not_list_give_stocks_outcome(name):
    """The sample inputs in every dtype torch does not list for the op on CPU (its own
    ``test_dtypes`` calls them so, to check they raise): torch's error or, where its kernel
    has nothing to do (an empty tensor), its result."""
    differs = _differences(name, lambda info: set(ALL_DTYPES) - set(info.supported_dtypes("cpu")))
    assert not differs, differs[:5]


@pytest.mark.parametrize("name", sorted({o.name for o in random_opinfos() if o.error_inputs_func is not None}))
def test_error_inputs_raise_torchs_error(name):
    import re

    for info in random_opinfos():
        if info.name != name or info.error_inputs_func is None:
            continue
        for error in info.error_inputs("cpu"):
            sample = error.sample_input
            with eager_stream(), pytest.raises(error.error_type) as raised:
                info.op(sample.input, *sample.args, **sample.kwargs)
            assert re.search(error.error_regex, str(raised.value)), (name, error.error_regex, str(raised.value))
