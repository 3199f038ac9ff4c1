"""What importing compile_rng changes in torch: install(), uninstall(), and the deferred
DTensor and Dynamo items (compile_rng/installation.py), each in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import compile_rng
import compile_rng._torch.core_internals
from compile_rng import installation


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_pulls_in_neither_dynamo_nor_dtensor():
    assert _fresh(
        """
        import sys, torch
        import compile_rng
        heavy = [m for m in ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "depyf") if m in sys.modules]
        print(heavy, getattr(torch.manual_seed, "_compile_rng_hook", False))
        """
    ).split() == ["[]", "True"]


_CHECK_INSTALLED = """
    import torch.distributed.tensor._random as dtensor_random
    from compile_rng.eager import tracker
    assert dtensor_random._rng_tracker is tracker.TRACKER
    assert dtensor_random.is_rng_supported_mesh(type("M", (), {"device_type": "cpu"})())
    print("installed")
"""


@pytest.mark.parametrize(
    "first",
    [
        "import compile_rng; import torch.distributed.tensor",
        "import compile_rng; import compile_rng.eager.tracker",
        "import torch.distributed.tensor; import compile_rng",
        "import compile_rng.eager.tracker",
        "import compile_rng; compile_rng.uninstall(); import torch.distributed.tensor; compile_rng.install()",
    ],
    ids=["dtensor-after", "tracker-module-after", "dtensor-before", "tracker-module-first", "reinstalled"],
)
def test_dtensor_items_are_installed_in_any_import_order(first):
    assert _fresh(first + "\n" + textwrap.dedent(_CHECK_INSTALLED)).strip() == "installed"


@pytest.mark.skipif(not compile_rng._torch.core_internals.trunc_normal_redraws(),
                    reason="torch 2.11's trunc_normal_ draws once: compile_rng leaves it stock, and Dynamo captures it")
def test_compiled_caller_graph_breaks_on_trunc_normal_captured_before_dynamo():
    # `from torch.nn.init import trunc_normal_` before Dynamo exists, then compiled: Dynamo
    # must not inline it (it reads values and the state); it runs eagerly on the stream.
    out = _fresh(
        """
        import torch
        import compile_rng
        from torch.nn.init import trunc_normal_
        import torch._dynamo
        from torch._dynamo.utils import counters
        def init(w):
            return trunc_normal_(w * 1, std=0.02)
        torch.manual_seed(3)
        a = compile_rng.compile(init, inner="aot_eager")(torch.empty(64, 64))
        state_a = compile_rng.get_state()
        breaks = [k for k in counters["graph_break"] if "disable" in k or "skip" in k.lower()]
        torch.manual_seed(3)
        b = compile_rng.init(init, compile=False)(torch.empty(64, 64))
        print(torch.equal(a, b), state_a == compile_rng.get_state(), state_a != (3, 0), bool(breaks))
        """
    )
    assert out.split() == ["True", "True", "True", "True"]


def test_uninstall_gives_torch_back_and_install_restores():
    import torch.distributed.tensor._random as dtensor_random

    from compile_rng.eager import tracker

    compile_rng.uninstall()
    try:
        assert not installation.installed() and not tracker.installed()
        assert not getattr(torch.random.manual_seed, "_compile_rng_hook", False)
        assert not getattr(torch.manual_seed, "_compile_rng_hook", False)
        assert torch.nn.init.trunc_normal_ is compile_rng.eager.trunc_normal._TORCH_TRUNC_NORMAL
        assert dtensor_random._rng_tracker is not tracker.TRACKER
        assert not dtensor_random.is_rng_supported_mesh(type("M", (), {"device_type": "cpu"})())
        before = compile_rng.get_state()
        torch.manual_seed(5)  # torch's own: compile_rng's stream stays where it was
        assert compile_rng.get_state() == before
        compile_rng.uninstall()  # idempotent
    finally:
        compile_rng.install()
    assert getattr(torch.random.manual_seed, "_compile_rng_hook", False)
    # compile_rng's trunc_normal_ where torch's is the redraw loop (2.12+); 2.11's stays stock
    ours = compile_rng._torch.core_internals.trunc_normal_redraws()
    assert (torch.nn.init.trunc_normal_ is compile_rng.eager.trunc_normal.trunc_normal_) == ours
    assert tracker.installed() and dtensor_random._rng_tracker is tracker.TRACKER
    torch.manual_seed(5)
    assert compile_rng.get_state() == (5, 0)


def _compile_rng_module_hooks() -> list[tuple[str, int]]:
    """``(table, handle id)`` of each global forward hook compile_rng has registered with torch."""
    from torch.nn.modules import module as nn_module

    tables = {"pre-hooks": nn_module._global_forward_pre_hooks, "hooks": nn_module._global_forward_hooks}
    ours = [(name, key) for name, table in tables.items() for key, hook in table.items()
            if hook.__module__.startswith("compile_rng")]
    # an always_call hook has its id in a third table too
    return ours + [("always called", key) for _, key in ours if key in nn_module._global_forward_hooks_always_called]


def test_uninstall_removes_the_module_hooks_a_named_step_installed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    with compile_rng.step(2, names=model):
        model(torch.ones(2, 4))
    assert [table for table, _ in _compile_rng_module_hooks()] == ["pre-hooks", "hooks", "always called"]
    compile_rng.uninstall()
    try:
        assert _compile_rng_module_hooks() == []  # no Python hook on every module call of stock torch
        with pytest.raises(RuntimeError, match="uninstalled"), compile_rng.step(2, names=model):
            pass
        assert _compile_rng_module_hooks() == []
    finally:
        compile_rng.install()
    assert _compile_rng_module_hooks() == []  # installed again at the next step with names, once
    for _ in range(2):
        with compile_rng.step(2, names=model):
            model(torch.ones(2, 4))
    assert [table for table, _ in _compile_rng_module_hooks()] == ["pre-hooks", "hooks", "always called"]


def test_an_unsupported_torch_is_refused_before_anything_changes():
    """Outside the checked releases (2.11-2.15) importing compile_rng raises ImportError
    naming the range, and torch stays stock (a release whose private modules differ could
    break torch's own imports, as 2.11 did before compile_rng handled its layout)."""
    assert _fresh(
        """
        import torch
        from torch.torch_version import TorchVersion
        stock = torch.manual_seed
        torch.__version__ = TorchVersion("2.10.0+cu128")
        try:
            import compile_rng
        except ImportError as e:
            print("refused:", "2.11 to 2.15" in str(e) and "2.10.0+cu128" in str(e))
        import torch.distributed.fsdp, torch.distributed.tensor
        print("stock:", torch.manual_seed is stock)
        """
    ).split() == ["refused:", "True", "stock:", "True"]
    for version in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0"):
        installation.check_torch_version(version)
    for version in ("2.10.2", "2.16.0", "3.0.0"):
        with pytest.raises(ImportError, match="compile_rng supports torch 2.11 to 2.15"):
            installation.check_torch_version(version)
