"""compile_rng.torch_internals is the one module that reads private torch APIs: every
item resolves on the installed torch (CI runs this on 2.13.0 and 2.15.0), and no other
module names a private ``torch`` path."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest
import torch

from compile_rng import torch_internals

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("name", sorted(torch_internals._LAZY))
def test_every_lazy_name_resolves(name):
    assert getattr(torch_internals, name) is not None


def test_every_function_and_name_exists():
    for name in torch_internals.__all__:
        assert hasattr(torch_internals, name), name
    assert torch_internals.rng_tracker() is torch_internals.dtensor_random()._rng_tracker
    assert isinstance(torch_internals.dtensor_op_handlers(), dict)
    assert isinstance(torch_internals.compile_failures(), tuple)
    assert torch_internals.op_name(torch.ops.aten.rand.default) == "rand"


def _private_torch_paths(source: str) -> list[str]:
    """Dotted names in code (not strings or comments) that start at ``torch`` and pass
    through a ``_private`` part, including ``from torch.x._y import ...``."""
    found, dotted, expect_name = [], [], True
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and expect_name:
            dotted.append(tok.string)
            expect_name = False
        elif tok.type == tokenize.OP and tok.string == "." and dotted:
            expect_name = True
        else:
            if dotted[:1] == ["torch"] and any(p.startswith("_") and not p.startswith("__") for p in dotted[1:]):
                found.append(".".join(dotted))
            dotted, expect_name = ([tok.string], False) if tok.type == tokenize.NAME else ([], True)
    return found


def test_no_other_module_names_a_private_torch_path():
    offenders = {}
    for path in sorted([*(ROOT / "compile_rng").glob("*.py"), *(ROOT / "passes").glob("*.py")]):
        if path.name == "torch_internals.py":
            continue
        found = _private_torch_paths(path.read_text())
        if found:
            offenders[path.name] = found
    assert offenders == {}


def test_the_scan_finds_what_it_should():
    code = "import torch\nfrom torch.utils._pytree import tree_leaves\nx = torch._guards.detect_fake_mode()\n"
    code += "y = 'torch._dynamo in a string'  # torch._inductor in a comment\nz = torch.nn.init.normal_\n"
    assert _private_torch_paths(code) == ["torch.utils._pytree", "torch._guards.detect_fake_mode"]
