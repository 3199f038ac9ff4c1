"""Every private torch API compile_rng reads, in one place.

Each item says why compile_rng needs it; all were checked on torch 2.13.0 and 2.15.0
(2.14 has the same modules). Private here means a module, attribute or method whose
name starts with ``_`` (``torch._dynamo``, ``DTensor._op_dispatcher``), and Dynamo's
undocumented fields (:data:`UNDOCUMENTED_FIELDS`); the one private stdlib function
compile_rng calls (:func:`exit_skipping_teardown`) is here too.

The changes compile_rng *makes* to torch live in :mod:`compile_rng.installation`, which
reads them through this module, with two kinds of exception, listed for
``tests/test_torch_internals.py``:

* :data:`TEMPORARY_PATCHES`, which live here beside what they patch: two cache patches
  that last only for the backend's own compile (:func:`autograd_cache_keys`,
  :func:`rank_free_mesh_cache_keys`), and two DTensor dispatch patches that last for one
  op call (:func:`dtensor_dispatch_unhandled`) or a block (:func:`dtensor_operands_kept`),
  which eager and traced code below the installer use;
* :data:`INSTALLER_ONLY`: the accessors that set or hand out torch's mutable state
  (DTensor's tracker slot, handler table and dispatcher), which only the installer calls.

DTensor's private tracker protocol (``_distribute_region``, ``_compute_rng_offsets``,
``_manual_seed`` and the fields DTensor reads) is implemented here once, by
:func:`dtensor_rng_tracker_base`, and mapped to public methods compile_rng's tracker
defines; :data:`PRIVATE_OVERRIDES` lists any other private torch name a compile_rng
class overrides (none).

Nothing heavy is imported here at module import: DTensor, Dynamo, Inductor and sympy
come in through functions, or through the lazy names of :data:`_LAZY`
(``from compile_rng._torch.torch_internals import register_lowering`` imports Inductor then).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

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
    "GraphBreak",
    "INSTALLER_ONLY",
    "OpOverload",
    "PRIVATE_OVERRIDES",
    "TEMPORARY_PATCHES",
    "UNDOCUMENTED_FIELDS",
    "TorchDispatchMode",
    "aot_autograd",
    "autograd_cache_keys",
    "autograd_cache_off",
    "compile_failures",
    "copy_dynamo_input_sources",
    "current_dispatch_mode",
    "default_partition",
    "detect_fake_mode",
    "dynamo_module_path",
    "dynamo_module_source",
    "dynamo_module_call",
    "compiled_frame",
    "is_resume_frame",
    "in_backward",
    "higher_order_op_name",
    "is_run_with_rng_state",
    "disable_dynamo",
    "distribute_region",
    "graph_compile_id",
    "exit_skipping_teardown",
    "dispatch_mode_stack",
    "dtensor_dispatch_unhandled",
    "dtensor_op_dispatcher",
    "dtensor_operands_kept",
    "dtensor_op_handlers",
    "dtensor_random",
    "dtensor_rng_tracker_base",
    "dtensor_spec",
    "fake_store",
    "get_proxy_mode",
    "graph_break",
    "inductor_cache_dir",
    "inductor_caches_enabled",
    "inductor_compile",
    "inductor_decompositions",
    "inductor_vector_isa",
    "local_tensor",
    "local_tensor_mode_enabled",
    "mark_sourceless_input",
    "mesh_coordinate_of_rank",
    "op_arguments",
    "op_name",
    "quiet_fake_tensor_failures",
    "pop_dispatch_mode_temporarily",
    "rank_free_mesh_cache_keys",
    "register_device_mesh_ops",
    "rng_tracker",
    "set_rng_tracker",
    "split_factor",
    "storage_weak_ref",
    "symbolic_mesh_coordinate",
    "traced_code_name",
    "traced_graph",
    "traced_mesh_coordinate_of_rank",
    "tree_leaves",
    "tree_map",
]


# --- the boundary's lists (tests/test_torch_internals.py reads them) ---------------------

#: Functions of this module that change torch for one call or the length of a ``with``
#: block: each is named in the module docstring. Every other change to torch is made by
#: compile_rng.installation.
TEMPORARY_PATCHES: tuple[str, ...] = (
    "autograd_cache_keys", "rank_free_mesh_cache_keys", "dtensor_dispatch_unhandled", "dtensor_operands_kept",
)

#: Accessors that set or hand out torch's mutable state: only compile_rng.installation
#: calls them (DTensor's tracker slot, its per-op handler table, its op dispatcher).
INSTALLER_ONLY: tuple[str, ...] = ("set_rng_tracker", "dtensor_op_handlers", "dtensor_op_dispatcher")

#: Dynamo's undocumented fields with public-looking names: only this module reads them.
#: ``dynamo_compile_id`` (``gm.meta``) and ``compile_subgraph_reason`` (an attribute) are
#: set by Dynamo on the graphs it hands a backend (2.13.0, 2.15.0).
UNDOCUMENTED_FIELDS: tuple[str, ...] = ("dynamo_compile_id", "compile_subgraph_reason")

#: ``(module path, class, private name, reason with the torch versions checked)`` of each
#: private torch method or field a compile_rng class outside this module overrides or sets.
#: None: DTensor's tracker protocol is implemented here (:func:`dtensor_rng_tracker_base`).
PRIVATE_OVERRIDES: tuple[tuple[str, str, str, str], ...] = ()


# The type of an aten op overload (``aten.rand.default``), for annotations.
OpOverload = torch._ops.OpOverload

# Functions Dynamo must graph-break on (they read values or the state, or communicate).
# torch._disable_dynamo imports Dynamo at the first call, not at decoration: importing
# compile_rng stays light. torch uses it for torch.manual_seed.
disable_dynamo = torch._disable_dynamo


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


# --- Dynamo, AOTAutograd and Inductor: the backend ---------------------------------------


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
def rank_free_mesh_cache_keys() -> Iterator[None]:
    """Inductor's FX-graph cache key with a DeviceMesh graph input reduced to the mesh's
    ``_stable_hash()`` (its ranks, layout, device type and dim names: what DTensor's
    guards and AOTAutograd's cache key use), not to its pickled ``__dict__``, which holds
    the process's rank, coordinate and ``hash()`` (a different key in every process).
    AOTAutograd lifts a DTensor's mesh into the graph as an opaque input; the compiled
    code reads nothing rank-specific from it at compile time (a value it bakes in is in
    the graph's code, which the key hashes). Lasts for the block (the backend's own
    compile, under Dynamo's compile lock): other compiles keep torch's key.
    ``FxGraphCachePickler._reduce_fake_script_object`` is looked up when a pickler is
    made (2.13, 2.15)."""
    if not torch.distributed.is_available():
        yield
        return
    from torch._inductor.codecache import FxGraphCachePickler
    from torch.distributed.device_mesh import DeviceMesh

    stock = FxGraphCachePickler.__dict__["_reduce_fake_script_object"]

    def reduce(self: Any, obj: Any) -> Any:
        if isinstance(obj.real_obj, DeviceMesh):
            return (str, (f"{obj.script_class_name}:{obj.real_obj._stable_hash()}",))
        return stock(self, obj)

    FxGraphCachePickler._reduce_fake_script_object = reduce
    try:
        yield
    finally:
        FxGraphCachePickler._reduce_fake_script_object = stock


def inductor_cache_dir() -> str:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR`` or its default): compile_rng's
    plans are kept beside the artifacts they describe."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_caches_enabled() -> bool:
    """Whether Inductor files and looks up its FX-graph artifacts in this process
    (``fx_graph_cache`` on, ``force_disable_caches`` off)."""
    from torch._inductor import config

    return bool(config.fx_graph_cache) and not config.force_disable_caches


def inductor_caches_off() -> Any:
    """A context in which Inductor neither looks up nor files artifacts: for compiles
    whose code depends on something its keys do not hold (benchmarks and tests that
    force the lowering's choice of a fused loop or a kernel call)."""
    from torch._inductor import config

    return config.patch(force_disable_caches=True)


def register_device_mesh_ops() -> None:
    """Register ``torch.ops.device_mesh`` (the runtime mesh coordinate of a graph traced
    with ``compile_on_one_rank``). Tracing registers it; a graph loaded from the cache
    is not traced, and calling it would fail on an unregistered op."""
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed._ops.device_mesh")


def inductor_vector_isa() -> str:
    """The vector instruction set Inductor generates CPU C++ for, e.g. ``"avx512"``,
    ``"avx2"``, ``"neon"``, ``""`` for none (its ``pick_vec_isa``, which honours
    ``ATEN_CPU_CAPABILITY``): the lowerings pick fused loops or the C kernel by it."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return str(isa).split(" ")[0] if isa else ""  # an InvalidVecISA is falsy


def inductor_decompositions() -> dict:
    """Inductor's decomposition table (the aot_eager path applies the same ones)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: fx.GraphModule, inputs: list, config_patches: dict, decompositions: dict) -> Any:
    """Inductor's ``compile_fx`` with config patches: ``joint_custom_pre_pass`` is where
    the pass runs on the joint graph, before partitioning."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, inputs, config_patches=config_patches, decompositions=decompositions)


def inductor_options(mode: str | None, options: dict | None) -> dict:
    """Inductor config patches for ``torch.compile``'s ``mode`` and ``options``, as
    ``torch.compile`` derives them for its own Inductor backend (2.13-2.15:
    ``torch._inductor.list_mode_options``, option names are config names with ``-`` as
    ``_``). An unknown mode or option raises, naming it."""
    from torch._inductor import config, list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    known = config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(
                f"compile_rng backend: unknown Inductor option {key!r} in torch.compile(options=...); "
                "torch._inductor.list_options() lists them"
            )
        patches[name] = value
    return patches


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


# --- DTensor ---------------------------------------------------------------------------


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


# one thread at a time steps a handler out of the shared table and back
_handlers_lock = threading.RLock()


def dtensor_dispatch_unhandled(op_call: Any, args: Any, kwargs: Any) -> Any:
    """DTensor's own dispatch of ``op_call``, as if compile_rng had no handler for it
    (meshes compile_rng does not serve keep stock semantics). DTensor's C++ entry point reads the
    handler table on every op, so the handler steps out of it for this one call."""
    handlers = dtensor_op_handlers()
    with _handlers_lock:
        mine = handlers.pop(op_call)
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = mine


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


def local_tensor(tensor: Any) -> Any:
    """The rank's local shard of a DTensor (``tensor`` itself otherwise), without the
    autograd-tracked ``to_local()``."""
    return getattr(tensor, "_local_tensor", tensor)


def symbolic_mesh_coordinate(mesh: Any) -> list:
    """The mesh coordinate as runtime SymInts (``compile_on_one_rank``): one traced graph
    serves every rank."""
    with torch.distributed.config.patch(compile_on_one_rank=True):
        return [mesh._sym_get_coordinate(d) for d in range(mesh.ndim)]


def mesh_coordinate_of_rank(mesh: Any, rank: int) -> list | None:
    """``rank``'s coordinate in ``mesh``, computed as the runtime op does (a mesh object
    cached from another process-group incarnation must not leak its coordinate)."""
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


def split_factor(placement: Any) -> int:
    """A ``_StridedShard``'s split factor (FSDP2 x TP lays shards out with it)."""
    return placement.split_factor


# --- distributed checkpoint: the canonical names of parameters and modules ---------------


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


# --- the process ---------------------------------------------------------------------


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
    "FloorDiv": ("torch.utils._sympy.functions", "FloorDiv", "the SymInt expressions of offsets and sizes"),
    "CeilDiv": ("torch.utils._sympy.functions", "CeilDiv", "the SymInt expressions of offsets and sizes"),
    "Mod": ("torch.utils._sympy.functions", "Mod", "the SymInt expressions of offsets and sizes"),
    "PythonMod": ("torch.utils._sympy.functions", "PythonMod", "the SymInt expressions of offsets and sizes"),
    "inductor_ir": ("torch._inductor.ir", None, "the lowerings build Inductor IR"),
    "register_lowering": ("torch._inductor.lowering", "register_lowering", "lowers the functional ops"),
    "fallback_handler": (
        "torch._inductor.lowering", "fallback_handler",
        "long float32 streams call the C kernel from compiled code",
    ),
    "inductor_ops": ("torch._inductor.virtualized", "ops", "the pointwise ops of a lowering's inner function"),
    "CustomGraphPass": (
        "torch._inductor.custom_graph_pass", "CustomGraphPass",
        "the joint pass's type: Inductor's FX-graph cache keys a custom pass on its uuid() (else bypasses)",
    ),
}


__all__ += list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attribute, _why = _LAZY[name]
    value = importlib.import_module(module_name)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


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


def is_resume_frame(frame: Any) -> bool:
    """Whether ``frame`` runs one of Dynamo's resume functions: the rest of a function
    after a graph break, still in the call that broke (Dynamo names them
    ``torch_dynamo_resume_in_<function>_at_<line>``, 2.13.0, 2.15.0)."""
    return "torch_dynamo_resume_in" in frame.f_code.co_name


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
