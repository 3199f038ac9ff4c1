"""One word per idea: ``layout=`` for the counter layout everywhere, ``streams="fqn"`` for
per-name streams. The old spellings (``mode=`` on init/explain/backend/compile,
``compile_rng.mode``, ``init(key=)``) keep working for one release with a
DeprecationWarning, and mean exactly what the new ones do."""

import warnings

import pytest
import torch

import compile_rng
from compile_rng.semantics.layouts import current_layout


def _no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return fn(*args, **kwargs)


def test_layout_selects_the_eager_layout_and_mode_is_its_old_spelling():
    with _no_warning(compile_rng.layout, "invariant"):
        assert current_layout() == "invariant"
    assert current_layout() == "tracker"
    with pytest.warns(DeprecationWarning, match=r"spell it compile_rng.layout\(...\)"):
        selector = compile_rng.mode("invariant")
    with selector:
        assert current_layout() == "invariant"
    with pytest.raises(ValueError, match="layout must be one of"), compile_rng.layout("sharded"):
        pass


def test_init_layout_and_the_old_mode_keyword():
    new = _no_warning(compile_rng.init, lambda t: t.uniform_(), layout="invariant")
    with pytest.warns(DeprecationWarning, match="spell it layout='invariant'"):
        old = compile_rng.init(lambda t: t.uniform_(), mode="invariant")
    assert new.backend.config.layout == old.backend.config.layout == "invariant"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        compile_rng.init(lambda t: t, layout="invariant", mode="tracker")


def _fqn_init_values(**spelling):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    compile_rng.init(lambda m: [p.normal_() for p in m.parameters()], layout="invariant", seed=7, **spelling)(model)
    return [p.detach().clone() for p in model.parameters()]


def test_streams_fqn_and_the_old_key_keyword_draw_the_same_per_name_streams():
    new = _no_warning(_fqn_init_values, streams="fqn")
    with pytest.warns(DeprecationWarning, match="spell it streams='fqn'"):
        old = _fqn_init_values(key="fqn")
    program_order = _fqn_init_values()
    assert all(torch.equal(a, b) for a, b in zip(new, old))
    # per-name streams are not the program-order stream (the keyword did something)
    assert not all(torch.equal(a, b) for a, b in zip(new, program_order))
    with pytest.raises(ValueError, match="streams must be None or 'fqn'"):
        compile_rng.init(lambda m: m, streams="order")


def test_explain_layout_and_the_old_mode_keyword():
    def step(x):
        return torch.rand(5) + x

    new = _no_warning(compile_rng.explain, step, torch.ones(5), layout="invariant")
    with pytest.warns(DeprecationWarning, match="spell it layout='invariant'"):
        old = compile_rng.explain(step, torch.ones(5), mode="invariant")
    assert [r.layout for r in new.ops] == [r.layout for r in old.ops] == ["invariant"]
