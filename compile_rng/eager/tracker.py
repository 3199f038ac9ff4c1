"""compile_rng as DTensor's RNG tracker: SPMD random semantics on CPU, CUDA and XPU meshes.

DTensor runs the local op of a random op inside ``_rng_tracker._distribute_region(spec)``
(on the accelerator it calls ``_compute_rng_offsets(spec)`` and ``run_dtensor_rng_op``
instead; :func:`run_dtensor_rng_op_hook` brings those calls back to the region).
:class:`Tracker` makes that region replace the local op with compile_rng's functional
ops at the shard's counter layout (:mod:`compile_rng.semantics.spmd`):

* eager: the counters come from the state (reserved once per op, identical on every
  rank) and the rank's mesh coordinate;
* while AOTAutograd traces a graph for ``backend="compile_rng"``: the key is a
  placeholder (``compile_rng::pending_key``, resolved to the graph's key input by the
  pass) and the coordinate is a runtime SymInt
  (``device_mesh::_runtime_compute_coordinate_on_dim``), so one graph serves every rank.

Random ops that DTensor does not route through the tracker (``exponential_``,
``log_normal_``, ``cauchy_``, ``geometric_``, ``random_``, ``bernoulli_`` with tensor
``p``) get a DTensor op handler that does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from compile_rng._torch.core_internals import detect_fake_mode, get_proxy_mode, traced_graph
from compile_rng._torch.distributed_internals import (
    local_tensor_mode_enabled,
    mesh_coordinate_of_rank,
    symbolic_mesh_coordinate,
    traced_mesh_coordinate_of_rank,
)
from compile_rng._torch.dtensor_internals import (
    OffsetBasedRNGTracker,
    distribute_region,
    dtensor_rng_tracker_base,
    rng_tracker,
)
from compile_rng._torch.dynamo_internals import eager_contextmanager
from compile_rng.eager import random_kernels
from compile_rng.eager.dispatch_modes import RandomOpMode
from compile_rng.eager.draw_counters import draw_rows, eager_key, read_stack
# spmd as a module: importing it first imports DTensor, whose import hook imports this
# module, which then finds spmd half-initialized (its names are read at call time)
from compile_rng.semantics import spmd, verify
from compile_rng.semantics.layouts import current_layout
from compile_rng.semantics.pending_key import SITE, Site, pending_key
from compile_rng.semantics.pieces import Pieces
from compile_rng.semantics.rows import Rows, ScatteredRows
from compile_rng.stream import state

aten = torch.ops.aten


_site_ids = itertools.count()


def _traced_node(site_id: int) -> torch.fx.Node:
    """The ``pending_key(site_id)`` node the proxy tracer just recorded."""
    for node in reversed(traced_graph().nodes):
        if node.target is torch.ops.compile_rng.pending_key.default and node.args[0] == site_id:
            return node
    raise RuntimeError(f"compile_rng internal error: the traced graph has no pending_key({site_id}) node")


# Set by the backend while AOTAutograd traces one of its graphs.
_tracing_for_compile_rng: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "compile_rng_tracing_layout", default=None
)


@contextlib.contextmanager
def tracing_for_backend(layout: str) -> Iterator[None]:
    token = _tracing_for_compile_rng.set(layout)
    try:
        yield
    finally:
        _tracing_for_compile_rng.reset(token)


def _coordinates(mesh: Any, symbolic: bool) -> list:
    if symbolic:
        return symbolic_mesh_coordinate(mesh)
    coords = mesh_coordinate_of_rank(mesh, torch.distributed.get_rank())
    if coords is None:
        raise RuntimeError(
            f"compile_rng: this rank ({torch.distributed.get_rank()}) is not part of the mesh "
            f"{mesh} of a DTensor random op; run the op only on the mesh's ranks"
        )
    return list(coords)


class Tracker(dtensor_rng_tracker_base()):
    """The object installed as ``torch.distributed.tensor._random._rng_tracker``.

    It must be an ``OffsetBasedRNGTracker``: for accelerator DTensors DTensor's dispatch
    (torch 2.13-2.15 ``_dispatch.py``) skips the region, asserts that type and passes the
    tracker's offsets for the spec to ``run_dtensor_rng_op``. DTensor's private tracker
    protocol is implemented by :func:`~compile_rng._torch.dtensor_internals.dtensor_rng_tracker_base`,
    which calls :meth:`region`, :meth:`rng_offsets` and :meth:`reseed`. Meshes of other
    device types (:func:`serves`) keep torch's semantics: their regions go to a stock
    ``OffsetBasedRNGTracker``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fallbacks: dict[str, Any] = {}  # device type -> torch's tracker for its meshes

    # Dynamo must not inline the tracker (it reads the state and placements); code that
    # calls it from a compiled frame graph-breaks and runs the region eagerly.
    @eager_contextmanager
    def region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        """The region DTensor runs a random op's local op in (its ``_distribute_region``).
        The local op is never an eager stream's plain random op: where this region draws
        nothing itself (torch's tracker's meshes, a disabled region), it draws torch's."""
        context = random_kernels.stream_context()  # read before the region hides the stream
        with random_kernels.drawing(None):
            yield from self.drawing_region(spec, generator, context)

    def drawing_region(
        self, spec: Any, generator: torch.Generator | None, context: contextvars.Context | None = None
    ) -> Iterator[None]:
        """:meth:`region`'s body (a generator): this tracker's mode or torch's tracker's
        region. ``context``: the one the stream's draws run in where it is not this
        thread's own (:func:`~compile_rng.eager.random_kernels.stream_context`)."""
        if not state.serves(spec.mesh):
            fallback = self.fallback(spec.mesh)
            fallback.distribute_region_enabled = self.distribute_region_enabled
            with distribute_region(fallback, spec, generator):
                yield
            return
        if not self.distribute_region_enabled:
            yield
            return
        if local_tensor_mode_enabled():
            _check_local_tensor_mode(spec)
            # torch's per-rank tracker simulates accelerator ranks; keep its semantics there.
            with distribute_region(self.fallback(spec.mesh), spec, generator):
                yield
            return
        counters = _counters(spec, generator) if context is None else _in(context, _counters, spec, generator)
        if context is not None and counters is not None:
            counters = functools.partial(_in, context, counters)
        if counters is None:
            yield
            return
        with RandomOpMode(counters):
            yield

    def rng_offsets(self, spec: Any) -> tuple[Any, Any]:
        """What DTensor's accelerator branch passes to run_dtensor_rng_op (its
        ``_compute_rng_offsets``), where run_dtensor_rng_op_hook opens this tracker's
        region for the spec instead."""
        if not state.serves(spec.mesh):
            return self.stock_rng_offsets(spec)
        return _Region(spec), None

    def fallback(self, mesh: Any) -> OffsetBasedRNGTracker:
        """torch's own tracker for the meshes of ``mesh``'s device type."""
        if mesh.device_type not in self.fallbacks:
            self.fallbacks[mesh.device_type] = OffsetBasedRNGTracker(mesh, run_state_sync=False)
        return self.fallbacks[mesh.device_type]

    def reseed(self, parallel_seed: int) -> None:
        """DTensor's ``manual_seed(seed, mesh)`` (its ``_manual_seed``)."""
        state.manual_seed(parallel_seed)


def _in(context: contextvars.Context, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in a copy of ``context``: a backward's device thread reads the caller's
    rows, names and layout, a recomputation its forward's."""
    return context.copy().run(fn, *args)


def _check_local_tensor_mode(spec: Any) -> None:
    """Refuse a CPU mesh under LocalTensorMode (an accelerator mesh keeps torch's tracker)."""
    if spec.mesh.device_type == "cpu":
        # LocalTensorMode simulates every rank in one process; the coordinate here would
        # be the process's rank for all of them (identical shards), and torch's own
        # per-rank tracker has no CPU support (torch 2.13: no torch.cpu.get_rng_state).
        raise NotImplementedError(
            "compile_rng: DTensor random ops under LocalTensorMode (every rank simulated in one "
            "process) are not supported; simulate ranks with the fake process group "
            "(one process acting as each rank) or run real ranks"
        )


def _counters(spec: Any, generator: torch.Generator | None) -> Callable | None:
    """The ``counters`` of :class:`RandomOpMode` for a random op on ``spec``'s shards, or
    None in fake propagation (Dynamo, AOTAutograd's metadata pass: no graph is recorded)."""
    sharding = spmd.Sharding.from_spec(spec)
    if generator is not None:
        raise NotImplementedError(
            "compile_rng: DTensor random ops with generator= are not supported: the stream of "
            "a sharded op lives in compile_rng's state. Drop generator= and seed with "
            "compile_rng.manual_seed / torch.manual_seed on every rank."
        )
    sharding.check("DTensor random op")
    tracing = detect_fake_mode() is not None
    if tracing and get_proxy_mode() is None:
        return None
    # Eager inside a step: the rows of the batch, in the layout batched graphs use.
    rows = None if tracing else draw_rows()
    layout_name = _tracing_for_compile_rng.get() if tracing else ("invariant" if rows is not None else current_layout())
    if layout_name is None:
        raise RuntimeError(
            "compile_rng is DTensor's RNG tracker, but this graph is compiled by another backend: "
            "DTensor random ops on its meshes need torch.compile(..., backend='compile_rng')"
        )
    coords = _coordinates(spec.mesh, symbolic=tracing)
    if not tracing:
        verify.check_mesh_once(spec.mesh)
    device = state.device_of(spec.mesh.device_type)
    if tracing:
        return functools.partial(_traced_counters, spec, sharding, layout_name, coords, device)
    return functools.partial(_eager_counters, sharding, layout_name, coords, rows, device)


def _traced_counters(
    spec: Any, sharding: spmd.Sharding, layout_name: str, coords: list, device: torch.device,
    func: Any, local_shape: Any, _device: torch.device,
) -> tuple:
    """Counters of an op AOTAutograd traces: a pending key (the pass resolves it to the
    graph's key input) at the runtime coordinate's layout, its site recorded on the node."""
    layout = sharding.layout(layout_name, coords, local_shape)
    if isinstance(layout, Pieces):
        # An uneven _StridedShard: this rank's runs of rows, for its own coordinate.
        # Their bounds are nested min/max of the runtime coordinate, which Inductor's
        # index analysis cannot digest; as constants the graph is this rank's (the
        # caches key DTensor graphs by rank: plan_store.process_context).
        rank_coords = traced_mesh_coordinate_of_rank(spec.mesh, torch.distributed.get_rank())
        layout = sharding.layout(layout_name, rank_coords, local_shape)
    offset, strides = (layout, None) if isinstance(layout, Pieces) else layout
    site_id = next(_site_ids)  # distinct args: no pass may merge two sites
    key = pending_key(site_id, device)
    start = offset.pieces[0][2] if isinstance(offset, Pieces) else offset  # reported: the first piece's
    _traced_node(site_id).meta[SITE] = Site(
        str(func), layout_name, sharding, start, sharding.advance(), tuple(coords), spec.mesh
    )
    return key, offset, strides


def _eager_counters(
    sharding: spmd.Sharding, layout_name: str, coords: list, rows: Rows | ScatteredRows | None,
    device: torch.device, func: Any, local_shape: Any, _device: torch.device,
) -> tuple:
    """Counters of an eager op: a key drawn now at this rank's coordinate's layout,
    shifted to the step's rows when there are any."""
    layout = sharding.layout(layout_name, coords, local_shape)
    split = sharding.placements if isinstance(layout, Pieces) or sharding.shards_dim(0) else None
    if rows is not None:
        batch = read_stack(func, sharding.global_shape, True)
        if batch.dim != 0 or batch.heads != 1:
            raise NotImplementedError(
                f"compile_rng: {func} draws on a DTensor inside compile_rng.step whose batch is dim {batch.dim} "
                f"({batch.why or 'the step declares it'}): DTensor random ops in a step draw batch-major (dim 0, "
                "one entry a row) only. Run that module on plain tensors (DDP, or FSDP2 outside it), or batch-first"
            )
    key, row_offset, batch_strides = eager_key(func, sharding.global_shape, int(sharding.advance()), device, rows, split)
    if isinstance(layout, Pieces):
        return key, layout.shifted(row_offset), None
    offset, strides = layout
    if rows is not None and rows.stride != 1:  # interleaved rows: a row's stride of counters apart
        strides = [batch_strides[0], *strides[1:]]
    return key, offset + row_offset, strides


@dataclass(frozen=True)
class _Region:
    """The "offsets" :meth:`Tracker.rng_offsets` hands DTensor's accelerator branch."""

    spec: Any


def run_dtensor_rng_op_hook(stock: Any) -> Any:
    """DTensor's ``run_dtensor_rng_op`` (the HOP its accelerator branch runs a local random
    op with), made to run the op in compile_rng's region when the offsets came from
    :class:`Tracker`: eager and traced, no generator read or written, no HOP in a graph."""

    def run_dtensor_rng_op(start: Any, end: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(start, _Region):
            with distribute_region(TRACKER, start.spec):
                return op(*args, **kwargs)
        return stock(start, end, op, *args, **kwargs)

    run_dtensor_rng_op._compile_rng_stock = stock
    return run_dtensor_rng_op


TRACKER = Tracker()


def installed() -> bool:
    """Whether compile_rng's tracker is DTensor's tracker."""
    return rng_tracker() is TRACKER
