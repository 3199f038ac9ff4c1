"""DTensor's private APIs compile_rng reads: its RNG tracker slot and protocol, its
dispatch of random ops, its op dispatcher and handler table, and a DTensor's spec.

DTensor's private tracker protocol (``_distribute_region``, ``_compute_rng_offsets``,
``_manual_seed`` and the fields DTensor reads) is implemented here once, by
:func:`dtensor_rng_tracker_base`, and mapped to public methods compile_rng's tracker
defines (:data:`compile_rng._torch.PRIVATE_OVERRIDES` lists any other private torch name
a compile_rng class overrides: none).

One temporary patch lives here, beside what it patches, used by the traced code below
the installer: :func:`dtensor_operands_kept` lasts for a block. The accessors that set or
hand out DTensor's mutable state (:data:`compile_rng._torch.INSTALLER_ONLY`) are the
installer's: among them :func:`set_op_handlers_per_thread`, which lets
:func:`dtensor_dispatch_unhandled` hand one op call to DTensor's own dispatch in its own
thread, the handler table unchanged. DTensor is imported inside the functions, or
through the lazy names of :data:`_LAZY`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from compile_rng._torch.core_internals import lazy_attributes, tree_leaves
from compile_rng._torch.dynamo_internals import disable_dynamo

__all__ = [  # and the lazy names of _LAZY, added below
    "distribute_region",
    "dtensor_dispatch",
    "dtensor_dispatch_has_rng_op",
    "dtensor_dispatch_unhandled",
    "dtensor_op_dispatcher",
    "dtensor_op_handlers",
    "dtensor_operands_kept",
    "dtensor_random",
    "dtensor_rng_tracker_base",
    "dtensor_spec",
    "dtensor_views_flatten_sharded_dims",
    "local_tensor",
    "rng_tracker",
    "set_op_handlers_per_thread",
    "set_rng_tracker",
    "split_factor",
]


def dtensor_random() -> Any:
    """``torch.distributed.tensor._random``: the module whose ``_rng_tracker`` DTensor
    runs random ops in, and whose ``is_rng_supported_mesh`` its seeding asks."""
    import torch.distributed.tensor._random as module

    return module


def rng_tracker() -> Any:
    """DTensor's RNG tracker (None until one is made)."""
    return dtensor_random()._rng_tracker


def set_rng_tracker(tracker: Any) -> None:
    dtensor_random()._rng_tracker = tracker


def distribute_region(tracker: Any, spec: Any, generator: Any = None) -> Any:
    """The region a DTensor RNG tracker runs a random op's local op in (the protocol
    DTensor's dispatch calls)."""
    return tracker._distribute_region(spec, generator)


@functools.cache
def dtensor_rng_tracker_base() -> type:
    """The base class of compile_rng's DTensor RNG tracker: an ``OffsetBasedRNGTracker``
    (DTensor's accelerator dispatch asserts that type) whose private protocol calls
    public methods the subclass defines.

    DTensor calls, on ``torch.distributed.tensor._random._rng_tracker`` (checked on torch
    2.13.0 and 2.15.0): ``_distribute_region(spec, generator)``, the region a random op's
    local op runs in -> ``region(spec, generator)``; ``_compute_rng_offsets(spec)``, what
    its accelerator branch hands ``run_dtensor_rng_op`` -> ``rng_offsets(spec)`` (torch's
    own: ``stock_rng_offsets(spec)``); ``_manual_seed(seed)``, DTensor's
    ``manual_seed(seed, mesh)`` -> ``reseed(seed)``. ``__init__`` sets the fields
    ``_RNGStateTracker.__init__`` sets and DTensor reads (``_device``,
    ``_device_handle``, ``_use_distribute_region``), not through
    ``OffsetBasedRNGTracker.__init__``, which refuses a CPU device and syncs a device
    generator. Made on the first call (it imports DTensor), once."""
    from torch.distributed.tensor._random import OffsetBasedRNGTracker

    class DTensorRNGTracker(OffsetBasedRNGTracker):
        def __init__(self) -> None:
            self._device = torch.device("cpu")
            self._device_handle = None
            self._use_distribute_region = True

        # Dynamo must not inline the region (it reads the state and placements); code
        # that calls it from a compiled frame graph-breaks and runs the region eagerly.
        @disable_dynamo
        def _distribute_region(self, spec: Any, generator: Any = None) -> Any:
            return self.region(spec, generator)

        def _compute_rng_offsets(self, spec: Any) -> Any:
            return self.rng_offsets(spec)

        def stock_rng_offsets(self, spec: Any) -> Any:
            return super()._compute_rng_offsets(spec)

        def _manual_seed(self, parallel_seed: int) -> None:
            self.reseed(parallel_seed)

        def region(self, spec: Any, generator: Any = None) -> Any:
            raise NotImplementedError

        def rng_offsets(self, spec: Any) -> Any:
            raise NotImplementedError

        def reseed(self, parallel_seed: int) -> None:
            raise NotImplementedError

    return DTensorRNGTracker


def dtensor_dispatch() -> Any:
    """``torch.distributed.tensor._dispatch``: for an accelerator DTensor (2.13: CUDA;
    2.15: the current accelerator) without ``generator=``, its dispatch skips the
    tracker's region and runs the local op through this module's global
    ``run_dtensor_rng_op`` with ``_rng_tracker._compute_rng_offsets(spec)``."""
    import torch.distributed.tensor._dispatch as module

    return module


def dtensor_dispatch_has_rng_op() -> bool:
    """Whether DTensor's dispatch has the accelerator branch of :func:`dtensor_dispatch`
    (2.12-2.15). torch 2.11 has none: it runs every random op, on any device, inside the
    tracker's region, which compile_rng's tracker serves on every device already."""
    return hasattr(dtensor_dispatch(), "run_dtensor_rng_op")


@functools.cache
def dtensor_views_flatten_sharded_dims() -> bool:
    """Whether DTensor's view rule merges a sharded dim with the dims after it (``(2, 4,
    8)`` ``Shard(1)`` viewed as ``(8, 8)`` gives ``_StridedShard``: torch 2.12-2.15). torch
    2.11's refuses ("Attempted to flatten multiple dimensions"): there a TP rank's local
    piece viewed that way (attention heads flattened) has no layout, and compile_rng
    refuses its draws. Asks ``_ops._view_ops`` directly: no process group needed."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops._view_ops import propagate_shape_and_sharding, view_groups

    try:
        propagate_shape_and_sharding([Shard(1)], (2, 4, 8), view_groups((2, 4, 8), (8, 8)), (2,), strict_view=True)
    except RuntimeError:
        return False
    return True


def dtensor_op_dispatcher() -> Any:
    """DTensor's op dispatcher (``DTensor._op_dispatcher``, an ``OpDispatcher``; checked
    on torch 2.13.0 and 2.15.0): :func:`dtensor_operands_kept` wraps its
    ``redistribute_local_args`` for a block."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher


def dtensor_op_handlers() -> dict:
    """DTensor's per-op custom handlers (in-place random ops DTensor runs without a
    tracker region get one that opens it)."""
    return dtensor_op_dispatcher()._custom_op_handlers


class _Unhandled(threading.local):
    """Per thread: the ops DTensor dispatches in this thread as if compile_rng had no
    handler for them (:func:`dtensor_dispatch_unhandled`)."""

    ops: frozenset = frozenset()


_unhandled = _Unhandled()


@functools.cache
def _per_thread_dispatcher(stock: type) -> type:
    """``stock`` (DTensor's ``OpDispatcher``) whose ``_custom_op_handlers`` is read through
    a property: the table the instance holds, less the ops of :data:`_unhandled` in the
    calling thread. A property is a data descriptor, so it wins over the instance's own
    attribute, which keeps holding the table (torch's own code sets and updates it through
    the property: ``loss_parallel``, context parallel)."""

    class PerThreadHandlers(stock):
        @property
        def _custom_op_handlers(self) -> dict:
            table = vars(self)["_custom_op_handlers"]
            skipped = _unhandled.ops
            return {op: h for op, h in table.items() if op not in skipped} if skipped else table

        @_custom_op_handlers.setter
        def _custom_op_handlers(self, table: dict) -> None:
            vars(self)["_custom_op_handlers"] = table

    PerThreadHandlers.compile_rng_stock_class = stock
    return PerThreadHandlers


def set_op_handlers_per_thread(per_thread: bool) -> None:
    """Make DTensor's op dispatcher read its handler table per thread
    (:func:`_per_thread_dispatcher`), or, False, as stock torch does. DTensor's C++ entry
    point reads ``_custom_op_handlers`` by attribute on every op (2.13-2.15; 2.11's Python
    dispatch too), so a thread inside :func:`dtensor_dispatch_unhandled` gets DTensor's own
    dispatch of its op while every other thread keeps compile_rng's handler: the table
    itself never changes."""
    dispatcher = dtensor_op_dispatcher()
    stock = getattr(type(dispatcher), "compile_rng_stock_class", type(dispatcher))
    dispatcher.__class__ = _per_thread_dispatcher(stock) if per_thread else stock


def dtensor_dispatch_unhandled(op_call: Any, args: Any, kwargs: Any) -> Any:
    """DTensor's own dispatch of ``op_call``, as if compile_rng had no handler for it
    (meshes compile_rng does not serve keep stock semantics): for this call, in this thread
    only, DTensor's dispatcher reads its handler table without ``op_call``
    (:func:`set_op_handlers_per_thread`). Another thread dispatching the op meanwhile still
    gets compile_rng's handler."""
    if not hasattr(type(dtensor_op_dispatcher()), "compile_rng_stock_class"):
        raise RuntimeError(
            f"compile_rng: its handler of {op_call} ran while DTensor reads its handler table as stock torch "
            "does (compile_rng uninstalled?), so the op cannot be handed to DTensor's own dispatch; "
            "call compile_rng.install()"
        )
    before = _unhandled.ops
    _unhandled.ops = before | {op_call}
    try:
        return op_call(*args, **kwargs)
    finally:
        _unhandled.ops = before


@contextlib.contextmanager
def dtensor_operands_kept(error: type[Exception]) -> Iterator[None]:
    """Inside the block DTensor's dispatch raises ``error`` where it would change an
    operand's placements to run an op (``OpDispatcher.redistribute_local_args``, 2.13-2.15;
    a change of non-tensor arguments only - a view's global sizes made local - still
    runs). :mod:`compile_rng.compiled.local_shards` runs a plain program's ops on DTensors this
    way: the local op computes a shard of the DTensor op only where nothing moves."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    dispatcher = dtensor_op_dispatcher()
    stock = dispatcher.redistribute_local_args

    def specs(args: Any) -> list:
        return [s for s in tree_leaves(args) if isinstance(s, DTensorSpec)]

    def moves(before: Any, after: Any) -> bool:
        # an empty operand (a KV cache's first torch.cat) has no data to move
        return before.placements != after.placements and before.tensor_meta.shape.numel() > 0

    def kept(op_info: Any, suggested: Any, use_val: bool) -> None:
        # the op's own schema is None after DTensor's C++ fast path; its flat args remain
        if any(moves(b, a) for b, a in zip(specs(op_info.flat_args_schema), specs(suggested.args_schema))):
            raise error(f"{op_info.schema} needs {suggested}")
        return stock(op_info, suggested, use_val)

    dispatcher.redistribute_local_args = kept  # an instance attribute over the staticmethod
    try:
        yield
    finally:
        del dispatcher.redistribute_local_args


def dtensor_spec(dtensor: Any) -> Any:
    """A DTensor's ``DTensorSpec`` (mesh, placements, shape): what the tracker receives."""
    return dtensor._spec


def local_tensor(tensor: Any) -> Any:
    """The rank's local shard of a DTensor (``tensor`` itself otherwise), without the
    autograd-tracked ``to_local()``."""
    return getattr(tensor, "_local_tensor", tensor)


def split_factor(placement: Any) -> int:
    """A ``_StridedShard``'s split factor (FSDP2 x TP lays shards out with it)."""
    return placement.split_factor


# --- names imported on first use ---------------------------------------------------------

# name -> (module, attribute or None for the module itself, why)
_LAZY: dict[str, tuple[str, str | None, str]] = {
    "OffsetBasedRNGTracker": (
        "torch.distributed.tensor._random", "OffsetBasedRNGTracker",
        "the tracker type DTensor's CUDA dispatch asserts; compile_rng's tracker subclasses it",
    ),
    "DTensorSpec": (
        "torch.distributed.tensor._dtensor_spec", "DTensorSpec",
        "what DTensor's dispatch passes around for an operand (mesh, placements, shape)",
    ),
    "StridedShard": (
        "torch.distributed.tensor.placement_types", "_StridedShard",
        "the placement FSDP2 x TP uses for a dim sharded twice",
    ),
}
__all__ += list(_LAZY)
__getattr__ = lazy_attributes(__name__, _LAZY)
