"""torch's core private APIs compile_rng reads: the dispatcher (dispatch modes, op
schemas, higher-order ops), tracing (fake and proxy modes), pytree, the symbolic-shape
functions and the autograd engine. The other homes build on it.

Each item says why compile_rng needs it; all were checked on torch 2.13.0 and 2.15.0
(:mod:`compile_rng._torch` says what private means and lists the boundary's exceptions).
Nothing heavy is imported here at module import: sympy's functions come in through the
lazy names of :data:`_LAZY`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

# --- dispatch: compile_rng's own dispatch modes ----------------------------------------
# TorchDispatchMode and the mode-stack helpers are torch.utils._python_dispatch's (no
# public home in 2.13-2.15); the proxy mode tells a traced graph from eager execution.
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as current_dispatch_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as dispatch_mode_stack
from torch.utils._python_dispatch import _pop_mode_temporarily as pop_dispatch_mode_temporarily
from torch.utils._pytree import tree_leaves, tree_map  # the leaves of an op's (args, kwargs); map over them

__all__ = [  # and the lazy names of _LAZY, added below
    "OpOverload",
    "TorchDispatchMode",
    "current_dispatch_mode",
    "detect_fake_mode",
    "dispatch_mode_stack",
    "get_proxy_mode",
    "higher_order_op_name",
    "in_backward",
    "is_run_with_rng_state",
    "op_arguments",
    "op_name",
    "pop_dispatch_mode_temporarily",
    "quiet_fake_tensor_failures",
    "storage_weak_ref",
    "torch_release",
    "traced_graph",
    "tree_leaves",
    "tree_map",
    "trunc_normal_redraws",
]


# The type of an aten op overload (``aten.rand.default``), for annotations.
OpOverload = torch._ops.OpOverload


def detect_fake_mode(inputs: Any = None) -> Any:
    """The active FakeTensorMode (of ``inputs``), or None: are we tracing?"""
    return torch._guards.detect_fake_mode(inputs)


def traced_graph() -> fx.Graph:
    """The graph the active proxy tracer records (the tracker annotates its nodes)."""
    return get_proxy_mode().tracer.graph


def op_name(op: OpOverload) -> str:
    """``aten.foo.bar`` -> ``foo`` (tables of op families are keyed by it)."""
    return op._opname


def op_arguments(op: OpOverload) -> list:
    """The schema's arguments, with ``alias_info`` telling which ones an op writes."""
    return op._schema.arguments


def storage_weak_ref(storage: torch.UntypedStorage) -> Any:
    """A weak reference to a storage (``expired()`` once freed): per-name streams must
    not mistake a recycled address for a freed tensor."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(storage)


@contextlib.contextmanager
def quiet_fake_tensor_failures() -> Iterator[None]:
    """FakeTensorMode logs a traceback for every op whose meta kernel raises
    (``torch/_subclasses/fake_tensor.py``, 2.13-2.15) before re-raising it; where a
    failure is an expected answer (a sharding rule that does not fit), not a bug,
    that log is noise."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (activation
    checkpointing recomputes forwards there). ``torch._C._current_graph_task_id`` is -1
    outside one (private, no public form; 2.13.0, 2.15.0)."""
    return torch._C._current_graph_task_id() != -1


def higher_order_op_name(func: Any) -> str | None:
    """The name of a higher-order operator (``torch._ops.HigherOrderOperator``, private;
    2.13.0, 2.15.0), None for anything else."""
    return func.name() if isinstance(func, torch._ops.HigherOrderOperator) else None


def is_run_with_rng_state(func: Any) -> bool:
    """Whether ``func`` is ``run_with_rng_state(rng_state, op, *args)``: the HOP with which
    AOTAutograd's partitioner wraps a random-tagged op of a checkpointed region, so that
    its recomputation replays torch's generator state (``torch._prims.rng_prims``, private;
    2.13.0, 2.15.0)."""
    return higher_order_op_name(func) == "run_with_rng_state"


def trunc_normal_redraws() -> bool:
    """Whether torch's ``nn.init.trunc_normal_`` is the redraw loop that
    :mod:`compile_rng.eager.trunc_normal` reproduces (``_no_grad_trunc_normal_``: 2.12 to
    2.15). torch 2.11's draws once (``uniform_``, then ``erfinv_``), which compile_rng's
    stream serves as it is, so there compile_rng leaves it stock: replacing it would
    change the values of plain tensors."""
    import inspect

    try:
        return "while" in inspect.getsource(torch.nn.init._no_grad_trunc_normal_)
    except (OSError, TypeError):  # a torch installed without its sources: 2.12 brought the loop
        return torch_release(torch.__version__) >= (2, 12)


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.11.0+cu130"`` -> ``(2, 11)``);
    ``(0, 0)`` for one that does not start with them."""
    import re

    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def lazy_attributes(module: str, table: dict[str, tuple[str, str | None, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``table``'s names on first use and keeps
    them in ``module``: ``name -> (module, attribute or None for the module itself, why)``."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        module_name, attribute, _why = table[name]
        value = importlib.import_module(module_name)
        if attribute is not None:
            value = getattr(value, attribute)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


# --- names imported on first use ---------------------------------------------------------

# name -> (module, attribute or None for the module itself, why)
_LAZY: dict[str, tuple[str, str | None, str]] = {
    "FloorDiv": ("torch.utils._sympy.functions", "FloorDiv", "the SymInt expressions of offsets and sizes"),
    "CeilDiv": ("torch.utils._sympy.functions", "CeilDiv", "the SymInt expressions of offsets and sizes"),
    "Mod": ("torch.utils._sympy.functions", "Mod", "the SymInt expressions of offsets and sizes"),
    "PythonMod": ("torch.utils._sympy.functions", "PythonMod", "the SymInt expressions of offsets and sizes"),
}
__all__ += list(_LAZY)
__getattr__ = lazy_attributes(__name__, _LAZY)
