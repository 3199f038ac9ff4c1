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
import ctypes
import functools
import importlib
import sys
import types
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
from torch.utils._python_dispatch import _pop_mode, _push_mode
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
    "has_internal_overlap",
    "insert_dispatch_mode",
    "is_run_with_rng_state",
    "op_arguments",
    "op_name",
    "pop_dispatch_mode_temporarily",
    "quiet_fake_tensor_failures",
    "random_op_overloads",
    "remove_dispatch_mode",
    "rng_state_replay_codes",
    "checkpoint_recompute_codes",
    "set_thread_object",
    "thread_object",
    "unregister_library",
    "storage_weak_ref",
    "torch_release",
    "traced_graph",
    "tree_leaves",
    "tree_map",
    "trunc_normal_redraws",
    "has_backend_kernel",
    "decomposes",
    "higher_order_op_defaults",
    "numbered_dispatch_key",
    "below_python_key",
    "PYTHON_KERNEL_KEY",
    "backend_key",
    "cxx11_abi",
    "dispatch_key",
    "schema_default",
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


def schema_default(argument: Any) -> Any:
    """An op schema argument's default as Python code passes it: the schema keeps a
    ``ScalarType`` default as its enum's int (``randint``'s ``dtype=long`` is ``4``, which
    as a ``Tensor.to`` argument is a device index). aten ops take that int for a dtype
    (undocumented; 2.11.0-2.15.0), so the dtype is read off an empty meta tensor."""
    value = argument.default_value
    if argument.name == "dtype" and isinstance(value, int) and not isinstance(value, bool):
        return torch.ops.aten.empty.memory_format([0], dtype=value, device="meta").dtype
    return value


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


def insert_dispatch_mode(mode: TorchDispatchMode, depth: int) -> None:
    """Enter ``mode`` at ``depth`` of the dispatch-mode stack, under the modes entered
    since (``_push_mode``/``_pop_mode``, private; 2.11.0-2.15.0): a mode a step needs
    only once the step is running must still outlive the modes the step's code entered
    after the step began (selective activation checkpointing's)."""
    above = [_pop_mode() for _ in range(max(len(dispatch_mode_stack()) - depth, 0))]
    _push_mode(mode)
    for other in reversed(above):
        _push_mode(other)


def remove_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch-mode stack wherever it is (the modes above stay)."""
    above = []
    while dispatch_mode_stack():
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        _push_mode(other)


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded view): torch refuses an
    in-place random op there before it draws, so the stream must refuse it before it
    reserves counters. ``torch._debug_has_internal_overlap`` (2.11.0-2.15.0: 0 no, 1
    yes, 2 too hard to tell, which torch's kernels then accept) is ATen's own test."""
    return torch._debug_has_internal_overlap(t) == 1


# --- dispatch: compile_rng's kernels for torch's random ops ------------------------------
# (compile_rng.eager.random_kernels). torch.library's impl/get_kernel are public; listing
# the dispatcher's ops, asking where an op has a kernel, the thread state the autograd
# engine hands its device threads and a library's removal have no public form.

#: The backend keys compile_rng draws random ops on (its kernel replaces torch's there on
#: torch 2.11 and 2.12, or without a C++ compiler): every dense device, as a dispatch mode
#: sees every device (Meta is left alone: tracing sees stock shapes).
BACKEND_KEYS = (
    "CPU", "CUDA", "HIP", "XPU", "MPS", "HPU", "MTIA", "MAIA", "IPU", "VE", "XLA", "Lazy",
    "PrivateUse1", "PrivateUse2", "PrivateUse3",
)


@functools.cache
def random_op_overloads() -> tuple[OpOverload, ...]:
    """Every aten overload tagged ``nondeterministic_seeded`` (``torch._C._dispatch_get_all_op_names``;
    2.11.0-2.15.0): ~150, listed once per process (~12 ms: aten's operators are all
    registered when torch is imported)."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, qualified = name.partition("::")
        if namespace != "aten":
            continue
        base, _, overload = qualified.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags:
            found.append(op)
    return tuple(found)


#: The dispatch key compile_rng's Python random-op kernels are registered at under the C++
#: ones (:mod:`compile_rng.eager.native_kernels`), which call them by it: torch's
#: ``TESTING_ONLY_GenericMode``, which no tensor carries and only torch's own C++ tests
#: include in a thread's state, so no dispatch reaches it. (Not ``CustomRNGKeyId``, which a
#: custom RNG extension's generators dispatch to.)
PYTHON_KERNEL_KEY = "TESTING_ONLY_GenericMode"


def backend_key(keyset: Any) -> Any:
    """The backend key a kernel registered ``with_keyset`` was called for
    (``DispatchKeySet.highestPriorityTypeId``; 2.11.0-2.15.0). ``PythonDispatcher`` is left
    out: torch keeps it in every keyset below a key, for its Python dispatcher when on."""
    return keyset.remove(torch._C.DispatchKey.PythonDispatcher).highestPriorityTypeId()


def cxx11_abi() -> bool:
    """Whether torch was built with the C++11 ABI, which compile_rng's C++ kernels must
    match (``torch._C._GLIBCXX_USE_CXX11_ABI``; 2.11.0-2.15.0). Their source
    (``compile_rng/eager/csrc/random_op_kernels.cpp``) uses torch's C++ API, two private
    parts of it named there."""
    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def dispatch_key(name: str) -> Any:
    """The ``torch._C.DispatchKey`` called ``name``."""
    return getattr(torch._C.DispatchKey, name)


def has_backend_kernel(op: OpOverload, key: str) -> bool:
    """Whether ``op`` has a kernel of its own at backend ``key`` (a backend or
    CompositeExplicitAutograd registration), not a CompositeImplicitAutograd
    decomposition, which must keep running above autograd
    (``torch._C._dispatch_has_computed_kernel_for_dispatch_key``; 2.11.0-2.15.0)."""
    return torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key) and not decomposes(op)


def higher_order_op_defaults() -> tuple[list, list]:
    """The dispatch keys every higher-order operator (``torch.cond``, checkpoint's, flex
    attention's) made from now on passes by (``torch._ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS``),
    and the ones made so far (``_higher_order_ops``), each with ``fallthrough(key)``: a HOP
    reads the thread's included keys and raises at one it has no Python kernel for
    (2.11.0-2.15.0)."""
    from torch import _ops

    return _ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS, list(_ops._higher_order_ops.values())


def numbered_dispatch_key(number: int) -> Any:
    """The ``torch._C.DispatchKey`` numbered ``number``, also one the Python enum has no
    name for (``Fake``; pybind11's enum takes any number; 2.11.0-2.15.0)."""
    return torch._C.DispatchKey(number)


def below_python_key(number: int) -> bool:
    """Whether dispatch key number ``number`` runs after the Python key (a dispatch mode's
    or a tensor subclass's), whose inner ops exclude every key above it: ``Fake`` does on
    torch 2.13-2.15, not on 2.11 and 2.12 (the enum's order is the keys' priority)."""
    return number < int(torch._C.DispatchKey.Python)


def decomposes(op: OpOverload) -> bool:
    """Whether ``op`` is a CompositeImplicitAutograd decomposition, which runs above
    autograd, into other ops (``torch._C._dispatch_has_kernel_for_dispatch_key``; 2.11.0-2.15.0)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


class _Cell:
    """A thread's object for torch 2.11 and 2.12, stashed once per thread and changed in
    place: neither can remove a key, so the stash holds a cell for the thread's life. The
    autograd engine then hands its device threads the caller's cell."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


_CAN_REMOVE = hasattr(torch._C, "_remove_obj_from_tls")  # torch 2.13+


def thread_object(key: str) -> Any:
    """The object :func:`set_thread_object` put under ``key`` for this thread, or None.
    The autograd engine runs a backward under the thread state of the thread that called
    it, these objects included: a CUDA backward's device thread sees the caller's
    (``torch._C._get_obj_in_tls``; 2.11.0-2.15.0)."""
    if not torch._C._is_key_in_tls(key):
        return None
    stored = torch._C._get_obj_in_tls(key)
    return stored.value if type(stored) is _Cell else stored


def set_thread_object(key: str, value: Any) -> None:
    """Put ``value`` under ``key`` for this thread (None: take it away)."""
    if _CAN_REMOVE:
        if value is not None:
            torch._C._stash_obj_in_tls(key, value)
        elif torch._C._is_key_in_tls(key):
            # an object left in a thread's state is freed at thread exit, which needs the
            # GIL there (torch's autograd/graph.py removes its own for that reason)
            torch._C._remove_obj_from_tls(key)
        return
    if not torch._C._is_key_in_tls(key):
        cell = _Cell()
        if torch_release(torch.__version__) < (2, 12):
            # torch 2.11's stash takes no reference of its own, yet gives one up when the
            # thread exits (a crash: an object freed twice): the reference is handed to it
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(cell))
        torch._C._stash_obj_in_tls(key, cell)
    torch._C._get_obj_in_tls(key).value = value


def unregister_library(library: torch.library.Library) -> None:
    """Remove every kernel ``library`` registered (``Library._destroy``; 2.11.0-2.15.0:
    torch removes them only when the object is collected)."""
    library._destroy()


def rng_state_replay_codes() -> tuple:
    """The code objects of the eager implementations of ``run_and_save_rng_state``,
    ``run_with_rng_state`` and ``graphsafe_run_with_rng_state`` (``torch._prims.rng_prims``'
    ``HigherOrderOperator.py_kernels``; 2.11.0-2.15.0): a random op that runs under one
    of them is one a graph compiled by another backend replays from torch's generator."""
    import torch._prims.rng_prims  # noqa: F401  (registers the operators)

    codes = []
    for name in ("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state"):
        operator = getattr(torch.ops.higher_order, name, None)
        for kernel in getattr(operator, "py_kernels", {}).values():
            code = getattr(kernel, "__code__", None)
            if code is not None:
                codes.append(code)
    return tuple(codes)


def checkpoint_recompute_codes() -> tuple:
    """The code objects of ``torch.utils.checkpoint``'s recomputation of a forward: the
    reentrant ``CheckpointFunction.backward`` and the ``recompute_fn`` the non-reentrant
    generator defines (in ``_checkpoint_without_reentrant_generator`` up to 2.14, in its
    ``_impl`` in 2.15: looked for in every function of the module; private, no public way
    to tell a recomputation from other backward code). A draw under one of them that no
    saved RNG state replays is recomputed with ``preserve_rng_state=False``."""
    from torch.utils import checkpoint

    codes = [checkpoint.CheckpointFunction.backward.__code__]
    for function in vars(checkpoint).values():
        if isinstance(function, types.FunctionType) and function.__module__ == checkpoint.__name__:
            codes += [c for c in function.__code__.co_consts
                      if isinstance(c, types.CodeType) and c.co_name == "recompute_fn"]
    return tuple(codes)  # a release without recompute_fn fails the non-reentrant refusal's test


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
