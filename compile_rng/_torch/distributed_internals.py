"""torch.distributed's private APIs compile_rng reads, DTensor aside: device meshes and
their coordinates, the fake and local-tensor process groups, distributed checkpoint's
parameter names, the one private stdlib function compile_rng calls
(:func:`exit_skipping_teardown`, for gloo ranks), and one temporary patch:
:func:`pipeline_chunks_wrapped` wraps a block's pipeline stages' per-microbatch methods.
Imported inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch

__all__ = [
    "checkpoint_module_name",
    "checkpoint_name",
    "exit_skipping_teardown",
    "fake_store",
    "local_tensor_mode_enabled",
    "mesh_coordinate_of_rank",
    "pipeline_chunks_wrapped",
    "register_device_mesh_ops",
    "symbolic_mesh_coordinate",
    "traced_mesh_coordinate_of_rank",
]


def register_device_mesh_ops() -> None:
    """Register ``torch.ops.device_mesh`` (the runtime mesh coordinate of a graph traced
    with ``compile_on_one_rank``). Tracing registers it; a graph loaded from the cache
    is not traced, and calling it would fail on an unregistered op."""
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed._ops.device_mesh")


def symbolic_mesh_coordinate(mesh: Any) -> list:
    """The mesh coordinate as runtime SymInts (``compile_on_one_rank``): one traced graph
    serves every rank."""
    with torch.distributed.config.patch(compile_on_one_rank=True):
        return [mesh._sym_get_coordinate(d) for d in range(mesh.ndim)]


def mesh_coordinate_of_rank(mesh: Any, rank: int) -> list | None:
    """``rank``'s coordinate in ``mesh``, computed as the runtime op does (a mesh object
    cached from another process-group incarnation must not leak its coordinate). A
    ``FakeScriptObject`` stands for the mesh it holds (``real_obj``): AOTAutograd traces a
    mesh as one (``torch._library``, private; 2.13.0), and on 2.13.0 one reached an eager
    draw's layout once a graph with tensor-parallel code inside a checkpointed region had
    compiled in the process."""
    from torch._library.fake_class_registry import FakeScriptObject

    # not while Dynamo traces: it takes the real mesh for one and refuses unknown attributes
    # (AOTAutograd's trace unwraps its own: traced_mesh_coordinate_of_rank)
    if not torch.compiler.is_compiling() and isinstance(mesh, FakeScriptObject):
        mesh = mesh.real_obj
    return type(mesh)._compute_coordinates_from_mesh(mesh.mesh, rank)


def traced_mesh_coordinate_of_rank(mesh: Any, rank: int) -> list | None:
    """:func:`mesh_coordinate_of_rank` while AOTAutograd traces: the mesh is then a
    ``FakeScriptObject`` holding the real one (``real_obj``; a plain make_fx trace
    keeps the real mesh), and the fake and proxy modes are active - the real mesh is
    read without them."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return mesh_coordinate_of_rank(getattr(mesh, "real_obj", mesh), rank)


def local_tensor_mode_enabled() -> bool:
    """Whether LocalTensorMode simulates every rank in this process."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode()


def fake_store() -> Any:
    """The store of the ``fake`` process group (one process acts as any rank, no
    communication): ``explain`` on a multi-rank model in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def checkpoint_name(model: Any, key: str) -> str:
    """The name ``torch.distributed.checkpoint``'s state dict gives the parameter or buffer
    at ``key`` (a ``named_parameters``/``named_buffers`` path under ``model``): the wrappers
    DCP leaves out of names - ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``,
    ``torch.compile``'s ``OptimizedModule._orig_mod``, FSDP1's ``_fsdp_wrapped_module``,
    DDP's ``module``, a module's ``_fqn_modifiers()`` - are not part of it.

    Private: ``torch.distributed.checkpoint.state_dict._get_fqns`` is that rule (what
    ``get_model_state_dict`` names keys by), with no public form in 2.13-2.15; the function
    is the same in 2.13.0 and 2.15.0. An FSDP1 FlatParameter names several parameters: refused."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names = _get_fqns(model, key)
    if len(names) != 1:
        raise NotImplementedError(
            f"compile_rng: {key!r} stands for several parameters in a checkpoint ({sorted(names)}), an FSDP1 "
            "FlatParameter: wrap with FSDP1's use_orig_params=True, or FSDP2 (fully_shard)"
        )
    return next(iter(names))


def checkpoint_module_name(model: Any, path: str) -> str | None:
    """The module at ``path`` (a ``named_modules`` path under ``model``) named as DCP's
    state dict names its parameters' prefix (:func:`checkpoint_name`; a wrapper and the
    module it wraps get the same name), or None for a module DCP walks through to the one
    it wraps (DDP, ``OptimizedModule``, FSDP1: ``_get_fqns`` fails on a key that stops at them).
    ``_get_fqns`` walks a key to its leaf; the leaf ``_extra_state`` is the one it names
    without looking it up (2.13.0, 2.15.0)."""
    from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX as leaf

    try:
        name = checkpoint_name(model, f"{path}.{leaf}" if path else leaf)
    except (AssertionError, AttributeError):  # "Expected '_orig_mod'"; FSDP1 looks the leaf up
        return None
    return name[: -len(leaf)].rstrip(".")


def exit_skipping_teardown() -> NoReturn:
    """End this process with status 0 without the interpreter's teardown: gloo's threads
    can abort it ("terminate called without an active exception") after a rank's body
    has passed (:mod:`compile_rng.launch`). multiprocessing's own exit step still runs
    first - ``multiprocessing.util._exit_function``, private, the function it registers
    with ``atexit`` (checked on Python 3.11 with torch 2.13.0 and 2.15.0): it releases the
    semaphores of Inductor's compile workers, which the parent's resource tracker would
    otherwise report leaked. Then the output is flushed and ``os._exit(0)`` ends it."""
    import multiprocessing.util
    import os
    import sys

    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: The methods of a ``PipelineStage`` a schedule calls with the microbatch index first
#: (torch 2.13-2.15 ``pipelining/schedules.py``: GPipe, 1F1B, interleaved 1F1B, zero bubble).
STAGE_CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
_ABSENT = object()  # a stage without an instance attribute of that name


@contextlib.contextmanager
def pipeline_chunks_wrapped(stages: Sequence[Any], wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, each of :data:`STAGE_CHUNK_METHODS` a stage of ``stages`` has is
    ``wrap(method)``, set on the instance; after the block the instance has what it had
    before (its own attribute - a user's patch, an outer block's wrapper - or none)."""
    patched = []
    try:
        for stage in stages:
            for name in STAGE_CHUNK_METHODS:
                if hasattr(stage, name):
                    before = vars(stage).get(name, _ABSENT)
                    setattr(stage, name, wrap(getattr(stage, name)))
                    patched.append((stage, name, before))
        yield
    finally:
        for stage, name, before in reversed(patched):  # reversed: a stage listed twice ends as it began
            if before is _ABSENT:
                delattr(stage, name)
            else:
                setattr(stage, name, before)
