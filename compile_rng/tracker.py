"""compile_rng as DTensor's RNG tracker: SPMD random semantics on CPU meshes.

DTensor runs the local op of a random op inside ``_rng_tracker._distribute_region(spec)``.
:class:`Tracker` makes that region replace the local op with compile_rng's functional
ops at the shard's counter layout (:mod:`compile_rng.spmd`):

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
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._random import OffsetBasedRNGTracker
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from . import state, verify
from . import ops as cr_ops
from .random_ops import INPLACE, RULES, RandomCall, draws, is_random, unsupported
from .spmd import Sharding, contiguous_strides
from .stream import ceil4

aten = torch.ops.aten


# --- the pending key: a graph placeholder the pass resolves -------------------------


@torch.library.custom_op("compile_rng::pending_key", mutates_args=())
def pending_key(site: int, device: torch.device) -> torch.Tensor:
    """Stands for the graph's key during tracing; never runs."""
    raise RuntimeError(
        "compile_rng internal error: a traced DTensor random op was not resolved by the "
        "compile_rng pass; compile with backend='compile_rng'"
    )


@pending_key.register_fake
def _(site, device):
    return torch.empty(2, dtype=torch.int64, device=device)


@dataclass
class Site:
    """A DTensor random op seen while tracing (for the pass, dumps and reports)."""

    op: str
    mode: str
    sharding: Sharding
    start: Any  # SymInt/int: offset of the rank's first counter within the op's range
    advance: Any  # SymInt/int: counters the op reserves
    coords: tuple  # the runtime mesh coordinate (SymInts) ``start`` is a function of
    mesh: Any = None  # the DeviceMesh (verify=True checks over the ranks that run the graph)

_sites: dict[int, Site] = {}
_site_ids = itertools.count()


def site(site_id: int) -> Site:
    return _sites[site_id]


# Set by the backend while AOTAutograd traces one of its graphs.
_tracing_for_compile_rng: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "compile_rng_tracing_mode", default=None
)


@contextlib.contextmanager
def tracing_for_backend(mode: str) -> Iterator[None]:
    token = _tracing_for_compile_rng.set(mode)
    try:
        yield
    finally:
        _tracing_for_compile_rng.reset(token)


MODES = ("tracker", "invariant")
_eager_mode: contextvars.ContextVar[str] = contextvars.ContextVar("compile_rng_mode", default="tracker")


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Counter layout of eager DTensor random ops inside the block (``"tracker"`` by
    default, or ``"invariant"``). Compiled graphs take the mode of their backend; code
    that graph-breaks out of one runs eagerly, so wrap the call in the same mode
    (``@compile_rng.init`` does)."""
    if name not in MODES:
        raise ValueError(f"compile_rng.mode: expected one of {MODES}, got {name!r}")
    token = _eager_mode.set(name)
    try:
        yield
    finally:
        _eager_mode.reset(token)


# --- replacing the local op -----------------------------------------------------------


def _out_shape_dtype(func: torch._ops.OpOverload, kw: dict) -> tuple[list, torch.dtype]:
    """Output shape and dtype of a random op from its normalized arguments."""
    if "size" in kw:
        default = torch.int64 if "randint" in func.name() else torch.get_default_dtype()
        return list(kw["size"]), kw.get("dtype") or default
    if isinstance(kw.get("mean"), torch.Tensor) or isinstance(kw.get("std"), torch.Tensor):
        tensors = [t for t in (kw.get("mean"), kw.get("std")) if isinstance(t, torch.Tensor)]
        return list(torch.broadcast_shapes(*(t.shape for t in tensors))), tensors[0].dtype
    first = kw["input"]
    return list(first.shape), kw.get("dtype") or first.dtype


class _TensorCall(RandomCall):
    """A random op call on local tensors, replaced at dispatch time."""

    def __init__(self, func, kw, key, offset, strides, size, dtype, out=None):
        self.op, self.kw, self.key, self.offset = func, kw, key, offset
        self._strides, self._size, self.dtype = strides, size, dtype
        self.out = out  # an in-place op's target: the values may be written straight into it

    def arg(self, name, default=None):
        value = self.kw.get(name)
        return default if value is None else value

    def size(self):
        return self._size

    def strides(self):
        return self._strides

    def emit(self, target, *args):
        into = cr_ops.INTO.get(target)
        if self.out is not None and into is not None and into(self.out, self.key, self.offset, *args):
            return self.out
        return target(self.key, self.offset, *args)

    def apply(self, target, *args, **kwargs):
        return target(*args, **kwargs)


def _normalize(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    from torch.fx.operator_schemas import normalize_function

    normalized = normalize_function(func, args, kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs) if normalized is not None else dict(kwargs)


def _generator_error(func: torch._ops.OpOverload) -> NotImplementedError:
    return NotImplementedError(
        f"compile_rng: {func} got generator= inside compile_rng's stream; drop the "
        "argument (seed with compile_rng.manual_seed) or call it outside"
    )


@dataclass(frozen=True)
class Counters:
    """The counters an eager random op drew: element ``idx`` of its ``size``-shaped local
    result has counter ``key base + offset + sum(idx * strides)`` under ``key``'s seed."""

    key: torch.Tensor
    offset: int
    strides: tuple[int, ...]
    size: tuple[int, ...]


_counter_log: contextvars.ContextVar[list[Counters] | None] = contextvars.ContextVar("compile_rng_counter_log", default=None)


@contextlib.contextmanager
def recorded_counters() -> Iterator[list[Counters]]:
    """Collects the :class:`Counters` of every eager random op run inside the block."""
    log: list[Counters] = []
    token = _counter_log.set(log)
    try:
        yield log
    finally:
        _counter_log.reset(token)


class RandomOpMode(TorchDispatchMode):
    """Replaces random ops with the functional ops at the counters ``counters`` assigns.

    ``counters(op, local_shape) -> (key, offset, strides)``. With ``plain_only`` the
    mode leaves ops on tensor subclasses (DTensor) to their own dispatch, whose tracker
    region then applies the sharded layout.
    """

    def __init__(self, counters, plain_only: bool = False):
        super().__init__()
        self.counters, self.plain_only = counters, plain_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        functional = INPLACE.get(func, func)
        if self.plain_only and any(t is not torch.Tensor for t in types):
            return func(*args, **kwargs)
        if functional not in RULES:
            if is_random(func):
                kw = _normalize(func, args, kwargs)
                if kw.get("generator") is not None:
                    raise _generator_error(func)
                if draws(func, kw):
                    raise unsupported(func)
            return func(*args, **kwargs)
        kw = _normalize(func, args, kwargs)
        if kw.get("generator") is not None:
            raise _generator_error(func)
        size, dtype = _out_shape_dtype(func, kw)
        key, offset, strides = self.counters(func, size)
        log = _counter_log.get()
        if log is not None:
            log.append(Counters(key, offset, tuple(strides), tuple(size)))
        inplace = func is not functional
        # Writing straight into the target needs real values (not while a graph is traced).
        direct = inplace and get_proxy_mode() is None and torch._guards.detect_fake_mode() is None
        call = _TensorCall(functional, kw, key, offset, strides, size, dtype, out=kw["input"] if direct else None)
        result = RULES[functional](call)
        if inplace:
            target = kw["input"]
            result = result[0] if isinstance(result, tuple) else result
            if result is not target:
                target.copy_(result)
            return target
        return result


def _plain_counters(func, size):
    numel = 1
    for s in size:
        numel *= s
    seed, base = state.advance(ceil4(numel))
    return cr_ops.make_key(seed, base), 0, contiguous_strides(size)


@contextlib.contextmanager
def eager_stream() -> Iterator[None]:
    """Eager random ops on plain CPU tensors inside the block draw from compile_rng's
    stream (a plain tensor is a replica on a one-rank mesh: counter ``base + i``, then
    ``base += ceil4(numel)``), exactly as they would in a compiled graph. DTensor ops
    keep going through the tracker. Disables ``torch.compile`` inside the block."""
    with RandomOpMode(_plain_counters, plain_only=True):
        yield


class _SegmentMode(RandomOpMode):
    # Dynamo compiles under a mode that ignores compile internals and the compiled
    # graphs run under it; only the eager code between graphs reaches the mode with
    # random ops (the graphs' own random ops are functional already).
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


_IN_COMPILED_CALL = contextvars.ContextVar("compile_rng_in_compiled_call", default=False)


@contextlib.contextmanager
def compiled_call() -> Iterator[None]:
    """Around a call of a ``compile_rng.compile``d function: the eager code Dynamo runs
    between graphs draws plain-tensor random ops from the stream (as
    :func:`eager_stream`), while ``torch.compile`` keeps compiling inside."""
    token = _IN_COMPILED_CALL.set(True)
    try:
        with _SegmentMode(_plain_counters, plain_only=True):
            yield
    finally:
        _IN_COMPILED_CALL.reset(token)


def in_compiled_call() -> bool:
    """Whether the code runs inside :func:`compiled_call`."""
    return _IN_COMPILED_CALL.get()


@contextlib.contextmanager
def graph_call() -> Iterator[None]:
    """Around a compiled graph: its ops skip :func:`compiled_call`'s mode (their random
    ops are functional already), which saves a Python dispatch per op."""
    if isinstance(_get_current_dispatch_mode(), _SegmentMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def _coordinates(mesh: Any, symbolic: bool) -> list:
    if symbolic:
        with torch.distributed.config.patch(compile_on_one_rank=True):
            return [mesh._sym_get_coordinate(d) for d in range(mesh.ndim)]
    # From the current rank, like the runtime op compiled graphs use (a mesh object
    # cached from another process-group incarnation must not leak its coordinate).
    coords = type(mesh)._compute_coordinates_from_mesh(mesh.mesh, torch.distributed.get_rank())
    if coords is None:
        raise RuntimeError(
            f"compile_rng: this rank ({torch.distributed.get_rank()}) is not part of the mesh "
            f"{mesh} of a DTensor random op; run the op only on the mesh's ranks"
        )
    return list(coords)


class Tracker(OffsetBasedRNGTracker):
    """The object installed as ``torch.distributed.tensor._random._rng_tracker``.

    It must be an ``OffsetBasedRNGTracker``: for CUDA DTensors DTensor's dispatch
    (torch 2.13-2.15 ``_dispatch.py``) skips ``_distribute_region``, asserts that type
    and calls the inherited ``_compute_rng_offsets(spec)``. Accelerator meshes keep
    torch's own semantics: their regions go to a stock ``OffsetBasedRNGTracker``.
    """

    # Not OffsetBasedRNGTracker.__init__: it refuses CPU and syncs a device generator.
    def __init__(self) -> None:
        self._device = torch.device("cpu")
        self._device_handle = None
        self._use_distribute_region = True
        self._fallbacks: dict[str, Any] = {}

    # Dynamo must not inline the tracker (it reads the state and placements); code that
    # calls it from a compiled frame graph-breaks and runs the region eagerly.
    @torch._dynamo.disable
    @contextlib.contextmanager
    def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        if spec.mesh.device_type != "cpu":
            fallback = self._fallback(spec.mesh)
            fallback.distribute_region_enabled = self.distribute_region_enabled
            with fallback._distribute_region(spec, generator):
                yield
            return
        if not self.distribute_region_enabled:
            yield
            return
        from torch.distributed._local_tensor import enabled_local_tensor_mode

        if enabled_local_tensor_mode():
            # LocalTensorMode simulates every rank in one process; the coordinate here would
            # be the process's rank for all of them (identical shards), and torch's own
            # per-rank tracker has no CPU support (torch 2.13: no torch.cpu.get_rng_state).
            raise NotImplementedError(
                "compile_rng: DTensor random ops under LocalTensorMode (every rank simulated in one "
                "process) are not supported on CPU meshes; simulate ranks with the fake process group "
                "(one process acting as each rank) or run real ranks"
            )
        sharding = Sharding.from_spec(spec)
        if generator is not None:
            raise NotImplementedError(
                "compile_rng: DTensor random ops with generator= are not supported: the stream of "
                "a sharded op lives in compile_rng's state. Drop generator= and seed with "
                "compile_rng.manual_seed / torch.manual_seed on every rank."
            )
        sharding.check("DTensor random op")
        tracing = torch._guards.detect_fake_mode() is not None
        if tracing and get_proxy_mode() is None:
            # Fake propagation (Dynamo, AOTAutograd's metadata pass): no graph is recorded.
            yield
            return
        mode = _tracing_for_compile_rng.get() if tracing else _eager_mode.get()
        if mode is None:
            raise RuntimeError(
                "compile_rng is DTensor's RNG tracker, but this graph is compiled by another backend: "
                "DTensor random ops on a CPU mesh need torch.compile(..., backend='compile_rng')"
            )
        coords = _coordinates(spec.mesh, symbolic=tracing)
        if not tracing:
            verify.check_mesh_once(spec.mesh)
        device = torch.device(spec.mesh.device_type)

        def counters(func, local_shape):
            offset, strides = sharding.layout(mode, coords, local_shape)
            if tracing:
                site_id = next(_site_ids)
                _sites[site_id] = Site(str(func), mode, sharding, offset, sharding.advance(), tuple(coords), spec.mesh)
                return pending_key(site_id, device), offset, strides
            seed, base = state.advance(int(sharding.advance()), device)
            return cr_ops.make_key(seed, base, device), offset, strides

        with RandomOpMode(counters):
            yield

    def _fallback(self, mesh: Any) -> OffsetBasedRNGTracker:
        if mesh.device_type not in self._fallbacks:
            self._fallbacks[mesh.device_type] = OffsetBasedRNGTracker(mesh, run_state_sync=False)
        return self._fallbacks[mesh.device_type]

    def _manual_seed(self, parallel_seed: int) -> None:
        state.manual_seed(parallel_seed)


# Random ops DTensor's dispatcher runs without a distribute region.
_UNROUTED = [
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    aten.random_.to,
    getattr(aten.random_, "from"),
    aten.bernoulli_.Tensor,
]


def _describe(mesh: Any) -> str:
    return f"the {mesh.device_type} mesh of ranks {mesh.mesh.tolist()}"


def _local_operand(op_call, target: DTensor, a: Any) -> Any:
    """``a``'s local tensor laid out like ``target``'s shard (as DTensor's own dispatch
    would redistribute it); operands from another mesh or plain tensors are refused."""
    if isinstance(a, DTensor):
        if a.device_mesh != target.device_mesh:
            raise ValueError(
                f"compile_rng: {op_call}: an operand lives on {_describe(a.device_mesh)}, the tensor it "
                f"fills on {_describe(target.device_mesh)}; move it to the target's mesh "
                "(distribute_tensor / redistribute)"
            )
        return a.redistribute(target.device_mesh, target.placements).to_local()
    if isinstance(a, torch.Tensor) and a.dim() > 0:
        raise ValueError(
            f"compile_rng: {op_call}: mixes a torch.Tensor operand with a DTensor; make it a DTensor on "
            "the target's mesh (distribute_tensor or DTensor.from_local)"
        )
    return a


def _inplace_handler(op_call, args, kwargs):
    target = args[0]
    if target.device_mesh.device_type != "cpu":
        return _stock_dispatch(op_call, args, kwargs)
    if target.device_mesh.get_coordinate() is None:
        # Like DTensor's own dispatch: a rank outside the mesh holds no shard, runs
        # nothing and does not advance its state.
        return target
    local_args = [target.to_local(), *(_local_operand(op_call, target, a) for a in args[1:])]
    import torch.distributed.tensor._random as dtensor_random

    with dtensor_random._rng_tracker._distribute_region(target._spec):
        op_call(*local_args, **kwargs)
    return target


_stock_lock = threading.RLock()


def _stock_dispatch(op_call, args, kwargs):
    """DTensor's own dispatch of ``op_call``, as if compile_rng had no handler for it
    (accelerator meshes keep stock semantics). DTensor's C++ entry point reads the
    handler table on every op, so the handler steps out of it for this one call."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    with _stock_lock:
        mine = handlers.pop(op_call)
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = mine


_TRACKER = Tracker()


def install() -> None:
    """Make compile_rng DTensor's RNG tracker (idempotent)."""
    import torch.distributed.tensor._random as dtensor_random

    dtensor_random._rng_tracker = _TRACKER
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _UNROUTED:
        handlers[op] = _inplace_handler
    if not getattr(dtensor_random.is_rng_supported_mesh, "_compile_rng", False):
        dtensor_random.is_rng_supported_mesh = _rng_supported_mesh(dtensor_random.is_rng_supported_mesh)


def _rng_supported_mesh(stock):
    # DTensor's manual_seed(seed, mesh) - what pipeline code calls per stage - and its
    # init helpers ask this before seeding; with compile_rng serving CPU meshes the answer
    # there is yes, so the stream is seeded (and a rank outside the mesh gets torch's error).
    def is_rng_supported_mesh(device_mesh) -> bool:
        if device_mesh.device_type == "cpu" and installed():
            return True
        return stock(device_mesh)

    is_rng_supported_mesh._compile_rng = True
    return is_rng_supported_mesh


def installed() -> bool:
    import torch.distributed.tensor._random as dtensor_random

    return dtensor_random._rng_tracker is _TRACKER
