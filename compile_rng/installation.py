"""Everything importing compile_rng changes in torch, in one place.

:func:`install` (run on ``import compile_rng``; idempotent) makes these changes, and
:func:`uninstall` undoes them, for tests and for users who want stock torch back. Each
was checked on torch 2.13.0 and 2.15.0 (2.14 has the same modules), and on 2.11.0 and
2.12.1 (the two 2.11 differences are read from :mod:`compile_rng._torch`).

==========================================================  ========================================
what                                                        why
==========================================================  ========================================
``torch.manual_seed``, ``torch.random.manual_seed``         the seeding every training script does
wrapped to also call :func:`manual_seed`                    restarts compile_rng's stream too
``torch.nn.init.trunc_normal_``                             fewer redraws; ranks kept in step
``torch.random.fork_rng`` wrapped to also restore           code that forks the RNG (sampling, evals)
compile_rng's CPU stream on exit                            leaves the training stream where it was;
                                                            a recomputation's stream lasts the fork
``torch.get_rng_state`` / ``set_rng_state`` (and           activation checkpointing sets the CPU
``torch.random``'s) wrapped: a state handed out            state back before it recomputes a forward
remembers every stream's position and the stream the       in backward - often after the step's block,
draws came from; set back, the positions return, and       or on a device thread: the forward's masks
inside ``fork_rng`` the rest of the fork draws from        (:mod:`~compile_rng.eager.recomputation`)
that stream
``torch.distributed.tensor._random._rng_tracker``           DTensor runs every random op's local op
= compile_rng's :class:`~compile_rng.eager.tracker.Tracker`       in the tracker's region: the SPMD contract
``_random.is_rng_supported_mesh``: yes for CPU meshes       DTensor's ``manual_seed(seed, mesh)`` and
                                                            init helpers ask it before seeding
``DTensor._op_dispatcher._custom_op_handlers`` for the      DTensor runs those ops without a region
in-place ops DTensor leaves unrouted (``exponential_``...)
DTensor's op dispatcher reads that table per thread         a mesh compile_rng does not serve gets
(a property; the table itself is unchanged)                 DTensor's own dispatch of those ops in
                                                            its own thread, other threads the handler
``_dispatch.run_dtensor_rng_op`` wrapped (2.12+): with     DTensor's accelerator branch runs random
the tracker's offsets it runs the op in the tracker's       ops through it, not through the region
region                                                      (2.11 has no such branch)
``DTensor.to_local`` wrapped: inside compile_rng's eager    a plain TP plan's eager code draws on
stream it records a shard's local tensor                    those pieces (:mod:`~compile_rng.eager.eager_shards`)
``ops.compile_rng_word`` added to Inductor's op handlers   a CUDA graph's draws share one Philox
(its Triton code generator, dtype pass and generic         block among four lanes inside the fused
handlers), at the first lowering of a CUDA graph's draw    kernel (:mod:`~compile_rng.ops.triton_words`);
                                                            stock code never names it
two global module forward hooks (torch's public             ``step(names=...)`` names each eager
``register_module_forward_pre_hook`` and                    random op by the module that runs it
``register_module_forward_hook``), at the first step        (:mod:`~compile_rng.eager.activation_names`)
with ``names=``; outside one they return at once
a kernel in C++ for each aten random op at torch's        a step's random ops draw from the stream,
``Fake`` dispatch key, which only a stream's thread        and no other op pays a Python call;
state includes, a fallthrough there for every other op,    outside streams no dispatch reaches
and compile_rng's Python kernels at a key no dispatch      compile_rng: every random op runs
reaches: at the first step or eager stream, kept for       torch's kernels as stock torch
the process (``uninstall()`` drops only the C++ lane's     (:mod:`~compile_rng.eager.random_kernels`,
handler, which the next stream sets again). Without a      :mod:`~compile_rng.eager.native_kernels`)
C++ compiler (or on torch 2.11, 2.12): kernels at the
backend keys, which ``uninstall()`` removes
every higher-order op (and those made later) passes that   a HOP reads the thread's included keys
key by, as it passes BackendSelect (for the process)       and raises at one it has no kernel for
==========================================================  ========================================

The private torch names these touch are read through :mod:`compile_rng._torch`'s homes.
The DTensor items are made when ``torch.distributed.tensor`` is imported (at once if it
already is): ``import compile_rng`` imports neither DTensor nor Dynamo, which keeps it
within a third of ``import torch``. The module hooks wait for the first step with
``names=``: a process that names nothing pays no Python hook on every module call (nor
torch's warning on ``torch.compile(module)`` under global hooks); then they stay until
:func:`uninstall`, not one step: Dynamo guards a compiled module on the global hooks.

The changes that last for a call or a block, not for the installation, are made by the
layers below that need them, through :mod:`compile_rng._torch`
(its ``TEMPORARY_PATCHES``). This module sits above every layer it wires
(``tests/test_import_structure.py``); the package's ``__init__`` runs :func:`install`.

``tests/test_torch_internals.py`` fails on a change to torch made anywhere else.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils.weak import WeakTensorKeyDictionary

from compile_rng import stream
from compile_rng._torch import core_internals, dtensor_internals, dynamo_internals, inductor_internals
from compile_rng.eager import dispatch_modes, draw_counters, native_kernels, recomputation, short_draws, trunc_normal
from compile_rng.import_hooks import after_import, cancel_pending
from compile_rng.semantics import local_values
from compile_rng.stream import cpu_kernel, state

_stock: dict[str, Any] = {}  # what install() replaced, for uninstall()
_module_hooks: list = []  # the handles of the module hooks of named steps, for uninstall()
_random_op_kernels: list = []  # the torch.library.Library of the Python kernels at the backend keys, while there
_native: list = []  # the C++ kernels' module while its kernels are registered and its lane set
_python_kernels: list = []  # (Library, serve()'s entries) of the Python kernels the C++ ones call (kept for the process)
_kept_native: list = []  # the C++ module whose kernels sit at its own key, kept across uninstall()
_triton_ops: list[str] = []  # the op added to Inductor's op handlers while it is

#: The torch releases the changes below were checked on, as ``[first, past the last)``
#: (pyproject's ``torch>=2.11,<2.16``).
SUPPORTED_TORCH = ((2, 11), (2, 16))


def check_torch_version(version: str) -> None:
    """Raise ImportError unless ``version`` is in :data:`SUPPORTED_TORCH`. The changes
    reach private torch code that other releases lay out differently: on torch 2.11
    (a GPU image's) the DTensor hook once failed inside torch's own
    ``import torch.distributed.fsdp``, breaking code that never used compile_rng."""
    release = core_internals.torch_release(version)
    first, past = SUPPORTED_TORCH
    if not first <= release < past:
        raise ImportError(
            f"compile_rng supports torch {first[0]}.{first[1]} to {past[0]}.{past[1] - 1}, found torch {version}: "
            f"install a supported torch (pip install 'torch>={first[0]}.{first[1]},<{past[0]}.{past[1]}') "
            "or use stock torch without compile_rng; nothing in torch was changed"
        )


def manual_seed(seed: int) -> None:
    """Restart the stream at ``(seed, 0)`` and :func:`install` compile_rng (again, if it
    was uninstalled). ``seed`` is a full uint64; call it with the same seed on every rank
    of a mesh. ``torch.manual_seed(s)`` calls it too while compile_rng is installed."""
    state.manual_seed(seed)
    install()


def install() -> None:
    """Make compile_rng serve torch's seeding, ``trunc_normal_`` and DTensor's random ops
    on CPU, CUDA and XPU meshes (idempotent; the module docstring lists each change and its reason).
    Raises ImportError, changing nothing, on a torch outside :data:`SUPPORTED_TORCH`."""
    check_torch_version(torch.__version__)
    if "manual_seed" not in _stock:
        _stock.update(
            manual_seed=torch.random.manual_seed,
            torch_manual_seed=torch.manual_seed,
            trunc_normal_=torch.nn.init.trunc_normal_,
            fork_rng=torch.random.fork_rng,
            get_rng_state=torch.random.get_rng_state,
            set_rng_state=torch.random.set_rng_state,
        )
        hook = _stock["hook"] = _manual_seed_hook(_stock["manual_seed"])
        torch.random.manual_seed = hook
        torch.manual_seed = hook
        if core_internals.trunc_normal_redraws():  # 2.12+; 2.11's draws once, served as it is
            torch.nn.init.trunc_normal_ = trunc_normal.trunc_normal_
        torch.random.fork_rng = _fork_rng_hook(_stock["fork_rng"])
        torch.get_rng_state = torch.random.get_rng_state = _get_rng_state_hook(_stock["get_rng_state"])
        torch.set_rng_state = torch.random.set_rng_state = _set_rng_state_hook(_stock["set_rng_state"])
    # The tracker module imports DTensor; whichever of the two is imported first, the
    # tracker is installed once its module is complete.
    after_import("torch.distributed.tensor", _import_tracker)
    after_import("compile_rng.eager.tracker", _install_tracker)
    after_import("compile_rng.eager.activation_names", _offer_module_hooks)
    after_import("compile_rng.eager.random_kernels", _offer_random_kernels)
    after_import("compile_rng.ops.triton_words", _offer_triton_op)


def uninstall() -> None:
    """Give torch back its own seeding, ``trunc_normal_``, DTensor tracker and module hooks.
    compile_rng's functions stay usable (a step with ``names=`` needs the hooks: it
    refuses); :func:`install` (or :func:`manual_seed`) installs it again. Raises
    RuntimeError, changing nothing, inside an open stream (on any thread)."""
    kernels = sys.modules.get("compile_rng.eager.random_kernels")
    if kernels is not None and kernels.open_streams():
        raise RuntimeError(
            f"compile_rng.uninstall() with {kernels.open_streams()} compile_rng stream(s) open (a "
            "compile_rng.step, an @compile_rng.init function, a compile_rng.compile'd call, on this or "
            "another thread): the rest of the block would draw torch's values instead of the stream's. "
            "Call uninstall() after the block"
        )
    cancel_pending()
    names = sys.modules.get("compile_rng.eager.activation_names")
    if names is not None:
        names.set_hooks_installer(None)
    for handle in _module_hooks:
        handle.remove()
    _module_hooks.clear()
    _unregister_random_kernels()
    after_import("compile_rng.eager.random_kernels", _offer_random_kernels)  # a stream serves them again
    for name in _triton_ops:
        inductor_internals.remove_triton_op(name)
    _triton_ops.clear()
    after_import("compile_rng.ops.triton_words", _offer_triton_op)  # a CUDA graph's lowering adds it again
    if "manual_seed" in _stock:
        torch.random.manual_seed = _stock["manual_seed"]
        if getattr(torch.manual_seed, "__wrapped__", None) is _stock["hook"]:
            # Dynamo, imported after install(), wrapped our hook in torch._disable_dynamo
            # (torch/_dynamo/__init__.py, 2.13-2.15); keep its wrapper around torch's own.
            torch.manual_seed = dynamo_internals.disable_dynamo(_stock["manual_seed"])
        else:
            torch.manual_seed = _stock["torch_manual_seed"]
        torch.nn.init.trunc_normal_ = _stock["trunc_normal_"]
        torch.random.fork_rng = _stock["fork_rng"]
        torch.get_rng_state = torch.random.get_rng_state = _stock["get_rng_state"]
        torch.set_rng_state = torch.random.set_rng_state = _stock["set_rng_state"]
    if "rng_tracker" in _stock:
        from compile_rng.eager import unrouted_ops  # with DTensor: not on `import compile_rng`

        dtensor_internals.set_rng_tracker(_stock["rng_tracker"])
        dtensor_internals.dtensor_random().is_rng_supported_mesh = _stock["is_rng_supported_mesh"]
        if "run_dtensor_rng_op" in _stock:
            dtensor_internals.dtensor_dispatch().run_dtensor_rng_op = _stock["run_dtensor_rng_op"]
        from torch.distributed.tensor import DTensor

        DTensor.to_local = _stock["to_local"]
        handlers = dtensor_internals.dtensor_op_handlers()
        for op in unrouted_ops.UNROUTED:
            if handlers.get(op) is unrouted_ops.inplace_handler:
                del handlers[op]
        dtensor_internals.set_op_handlers_per_thread(False)
    _stock.clear()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return "manual_seed" in _stock


def _manual_seed_hook(original: Callable) -> Callable:
    # torch.manual_seed is looked up at call time by nearly every caller (training
    # scripts, Lightning's seed_everything, DTensor), so the module attributes cover it.
    @functools.wraps(original)
    def manual_seed_hook(seed):
        result = original(seed)
        # torch accepts negative seeds and reduces them mod 2**64; mirror that.
        manual_seed(stream.as_uint64(seed))
        return result

    manual_seed_hook._compile_rng_hook = True
    return manual_seed_hook


# What each CPU generator state torch handed out knew of compile_rng's streams: setting that
# state back sets them back too (activation checkpointing's recomputation)
_handed_out: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
# the ExitStacks of the fork_rng blocks open on this thread, innermost last: a state set
# back inside one draws the rest of the block from the stream it was handed out in
_forks = threading.local()


def _open_forks() -> list[contextlib.ExitStack]:
    if not hasattr(_forks, "stacks"):
        _forks.stacks = []
    return _forks.stacks


def _get_rng_state_hook(original: Callable) -> Callable:
    # torch.utils.checkpoint saves torch.get_rng_state() before a checkpointed forward and
    # sets it back (in a fork_rng) before recomputing it in backward; the CPU stream is
    # compile_rng's, so the state it hands out remembers the streams (Dynamo runs it eagerly).
    @dynamo_internals.disable_dynamo
    @functools.wraps(original)
    def get_rng_state() -> torch.Tensor:
        result = original()
        _handed_out[result] = recomputation.captured()
        return result

    return get_rng_state


def _set_rng_state_hook(original: Callable) -> Callable:
    @dynamo_internals.disable_dynamo
    @functools.wraps(original)
    def set_rng_state(new_state: torch.Tensor) -> None:
        original(new_state)
        capture = _handed_out.get(new_state)
        if capture is None:  # a state from elsewhere (a file, a clone): the streams stay
            return
        state.set_state(*capture.streams["cpu"], "cpu")
        forks = _open_forks()
        if forks:
            forks[-1].enter_context(recomputation.replaying(capture))

    return set_rng_state


def _fork_rng_hook(original: Callable) -> Callable:
    # torch.random.fork_rng forks the CPU generator and the listed devices' generators; the
    # accelerator streams are those generators already, the CPU stream is compile_rng's.
    signature = inspect.signature(original)

    @functools.wraps(original)
    @contextlib.contextmanager
    def fork_rng(*args: Any, **kwargs: Any) -> Iterator[None]:
        enabled = signature.bind(*args, **kwargs).arguments.get("enabled", True)
        saved = state.get_state("cpu")
        forks = _open_forks()
        with contextlib.ExitStack() as replays:
            forks.append(replays)
            try:
                with original(*args, **kwargs):
                    try:
                        yield
                    finally:
                        if enabled:
                            state.set_state(*saved, "cpu")
            finally:
                forks.pop()

    return fork_rng


def _import_tracker(_dtensor: ModuleType) -> None:
    # A tracker module already in sys.modules is the one whose import is importing
    # DTensor right now: its own hook installs it when it is complete.
    if "compile_rng.eager.tracker" not in sys.modules:
        importlib.import_module("compile_rng.eager.tracker")


def _install_tracker(tracker: ModuleType) -> None:
    # Again on every install(): torch's own code may have replaced the tracker (tests
    # reset _rng_tracker; DTensor's manual_seed creates one where it finds none).
    dtensor_random = dtensor_internals.dtensor_random()
    if "rng_tracker" not in _stock:
        from torch.distributed.tensor import DTensor

        dispatch = dtensor_internals.dtensor_dispatch()
        _stock.update(
            rng_tracker=dtensor_internals.rng_tracker(), is_rng_supported_mesh=dtensor_random.is_rng_supported_mesh,
            to_local=DTensor.to_local,
        )
        dtensor_random.is_rng_supported_mesh = _rng_supported_mesh(dtensor_random.is_rng_supported_mesh, tracker)
        if dtensor_internals.dtensor_dispatch_has_rng_op():  # 2.12+; 2.11 uses the region on every device
            _stock["run_dtensor_rng_op"] = dispatch.run_dtensor_rng_op
            dispatch.run_dtensor_rng_op = tracker.run_dtensor_rng_op_hook(dispatch.run_dtensor_rng_op)
        DTensor.to_local = _to_local_hook(DTensor.to_local)
    dtensor_internals.set_rng_tracker(tracker.TRACKER)
    from compile_rng.eager import unrouted_ops  # with DTensor: not on `import compile_rng`

    # the handlers hand a mesh compile_rng does not serve to DTensor's own dispatch, in the
    # calling thread only (dtensor_internals.dtensor_dispatch_unhandled)
    dtensor_internals.set_op_handlers_per_thread(True)
    handlers = dtensor_internals.dtensor_op_handlers()
    for op in unrouted_ops.UNROUTED:
        handlers[op] = unrouted_ops.inplace_handler


def _offer_module_hooks(names: ModuleType) -> None:
    # The first step with names= asks for the hooks (activation_names.require_hooks).
    names.set_hooks_installer(functools.partial(_install_module_hooks, names))


def _install_module_hooks(names: ModuleType) -> None:
    if not _module_hooks:
        _module_hooks.append(nn_module.register_module_forward_pre_hook(names.enter_hook))
        _module_hooks.append(nn_module.register_module_forward_hook(names.leave_hook, always_call=True))


def _offer_triton_op(words: ModuleType) -> None:
    words.set_installer(functools.partial(_add_triton_op, words))


def _add_triton_op(words: ModuleType) -> None:
    # at the first lowering of a CUDA graph's draw: Inductor imported, its op handlers complete
    if not _triton_ops:
        inductor_internals.add_triton_op(words.OP, words.codegen, torch.int64)
        _triton_ops.append(words.OP)


def _offer_random_kernels(kernels: ModuleType) -> None:
    # A stream asks for the kernels (random_kernels.drawing): served from the first (again
    # after uninstall(), which leaves those at the stream's key registered, their lane
    # cleared) until uninstall() - inert outside streams.
    kernels.set_installer(functools.partial(_installed_random_kernels, kernels))


@contextlib.contextmanager
def _installed_random_kernels(kernels: ModuleType) -> Iterator[None]:
    if not _random_op_kernels and not _native:
        _register_random_kernels(kernels)
    yield


def _register_random_kernels(kernels: ModuleType) -> None:
    native = native_kernels.load()
    if native is None or not core_internals.below_python_key(native.LIVE_KEY):
        _register_at_backend_keys(kernels, native)
        return
    # The Python kernels sit at a key no dispatch reaches, holding nothing of torch's, and
    # the C++ kernels at a key only a stream's thread state includes: both are registered
    # once for the process and kept (~4 ms and ~0.7 ms that a step after uninstall() would
    # pay), as are the C++ module's fallthrough at its key and the higher-order ops' passing
    # it. What a dispatch can reach - the key in a stream's thread state, and the lane's
    # handler - is made here and taken away by uninstall().
    if not _python_kernels:
        served = [op for op in core_internals.random_op_overloads() if not core_internals.decomposes(op)]
        library = torch.library.Library("aten", "IMPL")
        for op in served:
            library.impl(op, kernels.kernel(op, None), core_internals.PYTHON_KERNEL_KEY, with_keyset=True)
        _python_kernels.append((library, _native_entries([(op, []) for op in served])))
        _higher_order_ops_pass(core_internals.numbered_dispatch_key(native.LIVE_KEY))
    try:
        _serve_natively(native, _python_kernels[0][1])
    except RuntimeError as error:
        # another fallback at the key (a fake-tensor backend's: the key is torch's own,
        # unused in 2.11-2.15): the backend keys serve instead, nothing drawn wrongly
        warnings.warn(f"compile_rng's random-op kernels cannot sit at torch's Fake dispatch key ({error}); "
                      "they sit at the backend keys instead (+0.1-0.4 us per random op outside streams)",
                      RuntimeWarning, stacklevel=2)
        _register_at_backend_keys(kernels, native)
        return
    if native not in _kept_native:
        _kept_native.append(native)
    # kept after uninstall(): a guard open across it takes its key out on exit
    kernels.set_key_switch(native.include)


def _register_at_backend_keys(kernels: ModuleType, native: ModuleType | None) -> None:
    # Without the C++ module (or on torch 2.11 and 2.12): a kernel at each backend key where
    # torch has one, over torch's kernel read now (a backend registered since the last
    # registration is served) - the C++ kernel there calling the Python one by an unreached
    # key, or without it the Python kernel itself.
    _release_kept_kernels()  # the stream's key would reach them too
    stocks: dict[Any, dict[str, Any]] = {}
    for op in core_internals.random_op_overloads():
        for key in core_internals.BACKEND_KEYS:
            if core_internals.has_backend_kernel(op, key):
                stocks.setdefault(op, {})[key] = torch.library.get_kernel(op, key)
    library = torch.library.Library("aten", "IMPL")
    _random_op_kernels.append(library)
    with warnings.catch_warnings():
        # torch warns once that a kernel is overridden: here that is the point, and the
        # kernel calls the one it overrides
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        for op, by_key in stocks.items():
            python_kernel = kernels.kernel(op, {core_internals.dispatch_key(k): v for k, v in by_key.items()})
            for key in [core_internals.PYTHON_KERNEL_KEY] if native is not None else by_key:
                library.impl(op, python_kernel, key, with_keyset=True)
    if native is not None:
        _serve_natively(native, _native_entries([(op, list(by_key)) for op, by_key in stocks.items()]))


def _native_entries(ops: list[tuple[Any, list[str]]]) -> list[tuple[str, str, int, list[str]]]:
    # what the C++ module's serve() takes for `ops`, each with its backend keys (none: at
    # the stream's key): (name, overload, lane index, keys)
    lanes = {op: i for i, op in enumerate(short_draws.LANE_OPS)}
    lanes |= dict.fromkeys(short_draws.LANE_FACTORIES, short_draws.THROUGH_TORCH)
    entries = []
    for op, keys in ops:
        name, _, overload = op.name().partition(".")
        entries.append((name, overload, lanes.get(op, short_draws.NO_LANE), keys))
    return entries


def _set_lane(native: ModuleType) -> None:
    native.set_lane(dispatch_modes.stream_op, short_draws, dynamo_internals.frame_hook_getter(), torch.Tensor,
                    cpu_kernel.kernel_addresses(), sorted(draw_counters.watched_codes()))


def _serve_natively(native: ModuleType, entries: list[tuple[str, str, int, list[str]]]) -> None:
    # the C++ kernels and their lane, all or nothing: recorded as registered only once served
    # (kernels kept at the stream's key since an earlier step are served already)
    _set_lane(native)
    if native not in _kept_native:
        try:
            native.serve(entries, core_internals.PYTHON_KERNEL_KEY, core_internals.BACKEND_KEYS)
        except BaseException:
            native.clear()
            raise
    _native.append(native)


def _release_kept_kernels() -> None:
    for native in _kept_native:
        native.clear()
    _kept_native.clear()


def _higher_order_ops_pass(key: Any) -> None:
    # A higher-order op computes its own dispatch keys, the thread's included ones among
    # them, and raises at a key it has no kernel for: it passes the C++ kernels' key by,
    # as it passes BackendSelect (those made later too)
    defaults, made = core_internals.higher_order_op_defaults()
    if key not in defaults:
        defaults.append(key)
    for hop in made:
        hop.fallthrough(key)


def _unregister_random_kernels() -> None:
    for native in _native:
        if native in _kept_native:
            native.clear_lane()
        else:
            native.clear()
    _native.clear()
    for library in _random_op_kernels:
        core_internals.unregister_library(library)
    _random_op_kernels.clear()


def _to_local_hook(stock: Callable) -> Callable:
    # Inside compile_rng's eager stream the local tensor of a sharded DTensor is recorded
    # (compile_rng.semantics.local_values): eager random ops on it then draw its piece of the
    # DTensor op's counters. Elsewhere, and on traced (fake) values, nothing changes.
    @functools.wraps(stock)
    def to_local(self, *, grad_placements=None):
        result = stock(self, grad_placements=grad_placements)
        if local_values.is_recording() and any(not p.is_replicate() for p in self.placements):
            from compile_rng.eager import eager_shards  # noqa: F401  (runs the eager ops on the piece)

            local_values.record(result, local_values.Layout.of(self))
        return result

    return to_local


def _rng_supported_mesh(stock: Callable, tracker: ModuleType) -> Callable:
    # DTensor's manual_seed(seed, mesh) - what pipeline code calls per stage - and its
    # init helpers ask this before seeding; with compile_rng serving CPU meshes the answer
    # there is yes, so the stream is seeded (and a rank outside the mesh gets torch's error).
    @functools.wraps(stock)
    def is_rng_supported_mesh(device_mesh) -> bool:
        if device_mesh.device_type == "cpu" and tracker.installed():
            return True
        return stock(device_mesh)

    return is_rng_supported_mesh
