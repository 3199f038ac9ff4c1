"""Dynamo's and AOTAutograd's private APIs compile_rng reads: the backend's factories and
partitioner, the graphs' input sources, compile ids and graph breaks, the frames a
compiled graph runs from, and Dynamo's undocumented fields
(:data:`UNDOCUMENTED_FIELDS`).

Two temporary patches live here, beside what they patch: :func:`autograd_cache_keys`,
lasting only for the backend's own compile, and :func:`compiles_with`, for a block. Dynamo and AOTAutograd are imported inside the
functions: importing compile_rng stays light.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

__all__ = [
    "UNDOCUMENTED_FIELDS",
    "GraphBreak",
    "aot_autograd",
    "autograd_cache_keys",
    "autograd_cache_off",
    "compile_failures",
    "compiled_frame",
    "compiling_scopes",
    "copy_dynamo_input_sources",
    "default_partition",
    "donated_buffers",
    "disable_dynamo",
    "eager_contextmanager",
    "frame_hook_getter",
    "dynamo_module_call",
    "dynamo_module_path",
    "dynamo_module_source",
    "graph_break",
    "graph_compile_id",
    "is_from_local",
    "is_resume_frame",
    "is_to_local",
    "mark_sourceless_input",
    "never_traced",
    "traced_code_name",
]

#: Dynamo's undocumented fields with public-looking names: only this module reads them.
#: ``dynamo_compile_id`` (``gm.meta``) and ``compile_subgraph_reason`` (an attribute) are
#: set by Dynamo on the graphs it hands a backend (2.13.0, 2.15.0).
UNDOCUMENTED_FIELDS: tuple[str, ...] = ("dynamo_compile_id", "compile_subgraph_reason")


# Functions Dynamo must graph-break on (they read values or the state, or communicate).
# torch._disable_dynamo imports Dynamo at the first call, not at decoration: importing
# compile_rng stays light. torch uses it for torch.manual_seed.
disable_dynamo = torch._disable_dynamo


def never_traced(code: Any) -> None:
    """Frames running ``code`` are never compiled by Dynamo's frame hook (what they call
    may be: call that through :data:`disable_dynamo`). A kernel torch's dispatcher calls from
    the eager code between a compiled function's graphs would otherwise be compiled there;
    ``disable_dynamo`` around the whole kernel costs ~1.5 us a call, paid by every random
    op (``torch._dynamo.eval_frame.skip_code``, private; 2.11.0-2.15.0). Imports Dynamo."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


def frame_hook_getter() -> Any:
    """A C function returning Dynamo's frame hook on this thread, None where it is off: the
    C++ random-op kernels call it to know whether Python they call would be compiled
    (``torch._C._dynamo.eval_frame.get_eval_frame_callback``, private; 2.11.0-2.15.0)."""
    return torch._C._dynamo.eval_frame.get_eval_frame_callback


class _EagerContext:
    """A context manager whose ``__enter__``/``__exit__`` (and all they call) run with Dynamo off."""

    __slots__ = ("_cm",)

    def __init__(self, cm: Any) -> None:
        self._cm = cm

    @disable_dynamo
    def __enter__(self) -> Any:
        return self._cm.__enter__()

    @disable_dynamo
    def __exit__(self, *exc: Any) -> Any:
        return self._cm.__exit__(*exc)


def eager_contextmanager(fn: Any) -> Any:
    """``contextlib.contextmanager`` whose body Dynamo never compiles. ``disable_dynamo``
    over a ``@contextmanager`` function covers only making the generator: its body runs
    later, in ``__enter__``, where Dynamo's frame hook compiles what it calls (and folds
    ``torch.distributed.get_rank()`` into constants, unguarded: one process acting as
    several ranks then gave every rank the first one's shard, seen on torch 2.11; 2.13
    ran the body eagerly only because tracing it failed)."""
    cm = contextlib.contextmanager(fn)

    @functools.wraps(fn)
    def make(*args: Any, **kwargs: Any) -> Any:
        return _EagerContext(cm(*args, **kwargs))

    return disable_dynamo(make)


def is_to_local(node: fx.Node) -> bool:
    """Whether ``node`` of a Dynamo graph is a DTensor's ``to_local()``: a ``call_method``
    (2.12-2.15), or in torch 2.11 a ``call_function`` of the closure Dynamo names
    ``prim_to_local`` (``torch/_dynamo/variables/tensor.py``, ``method_to_local``): a form
    not recognised would leave a TP rank's local piece drawn as a replica."""
    if node.op == "call_method":
        return node.target == "to_local"
    return node.op == "call_function" and getattr(node.target, "__name__", None) == "prim_to_local"


def is_from_local(node: fx.Node) -> bool:
    """Whether ``node`` of a Dynamo graph is ``DTensor.from_local``: the function itself
    (2.12-2.15), or in torch 2.11 a closure Dynamo names ``prim from_local``
    (``torch/_dynamo/variables/torch.py``)."""
    from torch.distributed.tensor import DTensor

    return node.op == "call_function" and (
        node.target is DTensor.from_local or getattr(node.target, "__name__", None) == "prim from_local")


def compile_failures() -> tuple[type[BaseException], ...]:
    """What Dynamo raises when a function does not compile (``@compile_rng.init`` then
    runs it eagerly on the stream)."""
    import torch._dynamo.exc as exc

    return (exc.TorchDynamoException, exc.FailOnRecompileLimitHit)


def autograd_cache_off() -> Any:
    """A context without AOTAutograd's cache: a hit there skips tracing and the joint
    pass, for compiles that need the pass to run (verify's meshes, explain, dumps, a hit
    with no plan filed). Inductor's FX-graph cache (keyed on the rewritten graph) stays on."""
    import torch._functorch.config

    return torch._functorch.config.patch(enable_autograd_cache=False)


def donated_buffers() -> bool:
    """AOTAutograd's ``donated_buffer`` setting: whether a compiled backward may reuse its
    saved tensors' memory (then it runs only once per forward). Users turn it off for
    ``retain_graph`` backwards - a zero-bubble pipeline schedule's input-then-weight halves.
    torch 2.13-2.15 check it only at run time, and a cached artifact compiled with it on
    still overwrites its saved tensors: compile_rng keys its compiles on it (checked on
    2.13.0: a zero-bubble step's weight gradients 6e-6 off without the key)."""
    import torch._functorch.config

    return bool(torch._functorch.config.donated_buffer)


@contextlib.contextmanager
def autograd_cache_keys(context: str) -> Iterator[list[str]]:
    """AOTAutograd's cache keys inside the block, with ``context`` mixed in, recorded in
    order (the first is the compile's own). A hit there hands back the compiled graph
    without tracing it, so the joint pass does not run: the backend files each graph's
    plan under the key of the compile that ran the pass, and finds it again on a hit.
    ``context`` is what of this process the traced graph depends on besides what torch's
    key hashes (:func:`compile_rng.compiled.plan_store.process_context`); the lookup and the save
    both use the key returned here. ``AOTAutogradCache.try_load`` calls the module's
    ``autograd_cache_key`` (2.13, 2.15); the patch lasts for the block, which runs under
    Dynamo's compile lock, so no other compile's key is touched."""
    import hashlib

    import torch._functorch._aot_autograd.autograd_cache as module

    keys: list[str] = []
    found = module.autograd_cache_key

    def keyed(*args: Any, **kwargs: Any) -> Any:
        key, debug_lines = found(*args, **kwargs)
        if context:
            key = f"{key}-{hashlib.blake2b(context.encode(), digest_size=8).hexdigest()}"
        keys.append(key)
        return key, debug_lines

    module.autograd_cache_key = keyed
    try:
        yield keys
    finally:
        module.autograd_cache_key = found


@contextlib.contextmanager
def compiles_with(backend: Any) -> Iterator[None]:
    """``torch.compile`` calls made inside the block with torch's default backend (a
    library's own compile of its step) compile with ``backend`` instead; every other
    argument is passed on. A temporary patch of ``torch.compile`` (a public attribute,
    looked up at call time by callers such as torchao's optimizers; 2.11.0-2.15.0) for the
    block, on every thread; torch's again at exit."""
    stock = torch.compile

    @functools.wraps(stock)
    def compile_with_backend(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend", "inductor") == "inductor":
            kwargs["backend"] = backend
        return stock(*args, **kwargs)

    torch.compile = compile_with_backend
    try:
        yield
    finally:
        torch.compile = stock


def aot_autograd(**kwargs: Any) -> Any:
    """Dynamo's AOTAutograd backend factory (the aot_eager path, with our partition)."""
    from torch._dynamo.backends.common import aot_autograd as factory

    return factory(**kwargs)


def default_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """AOTAutograd's default partitioner, run after the pass rewrote the joint graph."""
    from torch._functorch.partitioners import default_partition as partition

    return partition(joint, joint_inputs, **kwargs)


def copy_dynamo_input_sources(old: fx.GraphModule, new: fx.GraphModule, env: dict) -> None:
    """Dynamo's input sources onto a copied graph: AOTAutograd maps inputs to user
    sources through them (``_dynamo_source``, ``_param_name_to_source``)."""
    for before, after in env.items():
        if before.op == "placeholder" and hasattr(before, "_dynamo_source"):
            after._dynamo_source = before._dynamo_source
    if hasattr(old, "_param_name_to_source"):
        new._param_name_to_source = old._param_name_to_source


def mark_sourceless_input(node: fx.Node) -> None:
    """An added graph input with no user source (like DDPOptimizer's intermediates)."""
    node._dynamo_source = None


def traced_code_name() -> str | None:
    """The name of the function Dynamo is compiling (dump file names)."""
    ctx = torch._guards.TracingContext.try_get()
    codes = getattr(ctx, "traced_code", None) or []
    return codes[0].co_name if codes else None


def graph_compile_id(gm: fx.GraphModule) -> str:
    """The compile id of a graph Dynamo hands a backend (``"0"`` for another graph), for
    file names: ``gm.meta["dynamo_compile_id"]``, which Dynamo sets and does not document
    (checked on torch 2.13.0 and 2.15.0)."""
    return str(gm.meta.get("dynamo_compile_id", "0"))


@dataclass(frozen=True)
class GraphBreak:
    """Where and why Dynamo split a function before the graph it hands a backend."""

    reason: str  # the first line of Dynamo's reason
    frame: traceback.FrameSummary | None  # the user's line that broke the graph


def graph_break(gm: fx.GraphModule) -> GraphBreak | None:
    """The graph break that ended ``gm`` (None: it ends at a return, or is not Dynamo's).
    Dynamo sets ``gm.compile_subgraph_reason``, an undocumented ``GraphCompileReason``
    (``reason``, ``user_stack``, ``graph_break``), on the graphs it hands a backend
    (checked on torch 2.13.0 and 2.15.0); the backend warns at the user's line."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return None
    return GraphBreak(reason.reason.splitlines()[0], reason.user_stack[-1] if reason.user_stack else None)


def dynamo_module_path(path: str) -> str:
    """The dotted module path (``layers.0.attn``) of a Dynamo ``nn_module_stack`` entry's
    path: Dynamo spells it from the root module's source (``L['self']``) and its
    ``_modules['layers']`` lookups, an undocumented format (2.13.0, 2.15.0)."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    # a module's children are reached as ``._modules['x']`` or, inside a wrapper's forward
    # (checkpoint_wrapper), ``.__dict__['_modules']['x']``
    return re.sub(r"(?:^|\.)(?:__dict__\['_modules'\]|_modules)\['([^']*)'\]", r".\1", path).lstrip(".")


_SOURCE_ROOT = re.compile(r"^([LG])\['([^']*)'\]")


def dynamo_module_source(path: str) -> tuple[str, str, str] | None:
    """``(scope, name, dotted path)`` of a Dynamo ``nn_module_stack`` entry's path:
    ``L['self'].layers.0.attn`` -> ``("L", "self", "layers.0.attn")`` - the compiled frame's
    local (``L``) or global (``G``) the module is reached from, and the path below it
    (undocumented format, 2.13.0, 2.15.0); None for a path of another form."""
    match = _SOURCE_ROOT.match(path)
    if match is None:
        return None
    return match.group(1), match.group(2), dynamo_module_path(path[match.end():])


def dynamo_module_call(key: str) -> int:
    """Which call of its module an ``nn_module_stack`` entry is, within one graph: Dynamo
    keys a module's first call by its id and the later ones ``id@1``, ``id@2``, ...
    (undocumented, 2.13.0, 2.15.0)."""
    _, _, call = key.partition("@")
    return int(call) if call.isdigit() else 0


def compiled_frame(skip: tuple[str, ...]) -> Any:
    """The frame of the user's code that called a backend's compiled graph: the first
    frame up the stack whose file is neither in ``torch/_dynamo`` (Dynamo's wrappers
    around the graph) nor one of ``skip`` (the backend's own files). Dynamo runs the
    graph from the transformed bytecode of the frame it compiled, so that frame's locals
    are the ones its module paths start from (2.13.0, 2.15.0)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None and (
        f"torch{os.sep}_dynamo{os.sep}" in frame.f_code.co_filename or frame.f_code.co_filename in skip
    ):
        frame = frame.f_back
    return frame


def compiling_scopes() -> tuple[dict, dict] | None:
    """``(locals, globals)`` of the frame Dynamo is compiling, read while a backend compiles
    its graph: the paths in the graph's ``nn_module_stack`` start there. Dynamo's
    ``InstructionTranslator.current_tx()`` is set for the whole of its trace, the backend's
    compile included (2.11.0, 2.13.0, 2.15.0); None where it cannot be read."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return dict(tx.f_locals), dict(tx.f_globals)
    except Exception:  # noqa: BLE001  (no trace, or another API: the callers fall back)
        return None


def is_resume_frame(frame: Any) -> bool:
    """Whether ``frame`` runs one of Dynamo's resume functions: the rest of a function
    after a graph break, still in the call that broke (Dynamo names them
    ``torch_dynamo_resume_in_<function>_at_<line>``, 2.13.0, 2.15.0)."""
    return "torch_dynamo_resume_in" in frame.f_code.co_name
