"""Importing compile_rng leaves DTensor random ops on meshes it does not serve (device
types other than CPU, CUDA and XPU: here a ``meta`` mesh, the one such device type this
machine has) as stock torch has them. It pins the branch logic DTensor's dispatch runs
(torch 2.13-2.15 ``torch/distributed/tensor/_dispatch.py``):

* no ``generator=``, an accelerator local tensor: ``assert isinstance(_rng_tracker,
  OffsetBasedRNGTracker)`` then ``_rng_tracker._compute_rng_offsets(spec)`` - torch's
  offsets for a mesh compile_rng does not serve (CUDA/XPU meshes get compile_rng's
  region instead: ``tests/test_accelerator_path.py``);
* otherwise ``_rng_tracker._distribute_region(spec, generator)`` - for such a mesh it
  must be torch's own ``OffsetBasedRNGTracker`` region;
* the op handlers DTensor consults first, on every device - for such a mesh they must
  hand the op to DTensor's stock dispatch.
"""

import contextlib
import threading

import pytest
import torch
import torch.distributed.tensor._random as dtensor_random
from dtensor_reference import ceil4, counters, fake_rank, local_zeros, needs_accelerator_branch, uniform
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import compile_rng
from compile_rng._torch.core_internals import torch_release
from compile_rng.eager import unrouted_ops
from compile_rng.stream import state


@pytest.mark.parametrize("seed_with", ["torch.manual_seed", "compile_rng.manual_seed"])
def test_seeding_keeps_compile_rng_serving_dtensor_dispatch(seed_with):
    """Whichever seeding a program calls, DTensor's dispatch still finds compile_rng's
    tracker: a random op on a CPU mesh draws the stream's values at torch's tracker
    offsets and advances the state by ``ceil4(numel(global))`` (stock torch 2.13 would
    build its own tracker here and refuse the CPU device)."""
    seed = 6
    {"torch.manual_seed": torch.manual_seed, "compile_rng.manual_seed": compile_rng.manual_seed}[seed_with](seed)
    assert compile_rng.get_state() == (seed, 0)
    assert dtensor_random._rng_tracker.distribute_region_enabled
    with fake_rank(1, 2):
        x = local_zeros((5, 3), DeviceMesh("cpu", [0, 1]), [Shard(0)])
        y = torch.rand_like(x)
        assert torch.equal(y.to_local(), uniform(seed, counters(x, 0), x.to_local().shape))
    assert compile_rng.get_state() == (seed, ceil4(5 * 3))


# (global shape, placements, rank) -> torch's (start, end) derived by hand:
# start = ceil4(shard_linear_idx * numel(first shard)), end = ceil4(numel(global))
OFFSET_CASES = [
    ((8, 6), [Shard(0)], 3, (ceil4(3 * 2 * 6), 48)),
    ((10, 3), [Shard(0)], 3, (ceil4(3 * 3 * 3), ceil4(30))),
    ((5, 6), [Shard(1)], 2, (ceil4(2 * 5 * 2), 32)),
    ((7, 7), [Replicate()], 1, (0, ceil4(49))),
]


@needs_accelerator_branch
@pytest.mark.parametrize("shape,placements,rank,expected", OFFSET_CASES)
def test_accelerator_branch_gets_torchs_offsets_on_meshes_compile_rng_does_not_serve(shape, placements, rank, expected):
    with fake_rank(rank, 4):
        mesh = DeviceMesh("meta", [0, 1, 2, 3])
        spec = DTensor.from_local(
            torch.empty(local_zeros(shape, DeviceMesh("cpu", [0, 1, 2, 3]), placements).to_local().shape, device="meta"),
            mesh, placements, shape=torch.Size(shape), stride=torch.empty(shape).stride(),
        )._spec
        assert not state.serves(mesh)
        torch.manual_seed(1)  # seeding leaves the offsets of such a mesh as torch's
        # the method DTensor's accelerator branch calls (after asserting the tracker is an
        # OffsetBasedRNGTracker): torch's (start, end) for this spec
        assert tuple(int(v) for v in dtensor_random._rng_tracker._compute_rng_offsets(spec)) == expected


class _RecordingTracker:
    distribute_region_enabled = True

    def __init__(self):
        self.entered = []

    @contextlib.contextmanager
    def _distribute_region(self, spec, generator=None):
        self.entered.append((spec, generator))
        yield


def test_unserved_mesh_regions_go_to_torchs_tracker(monkeypatch):
    with fake_rank(0, 2):
        mesh = DeviceMesh("meta", [0, 1])
        spec = DTensor.from_local(torch.empty(2, 3, device="meta"), mesh, [Shard(0)])._spec
        stock = _RecordingTracker()
        monkeypatch.setitem(dtensor_random._rng_tracker.fallbacks, "meta", stock)
        generator = torch.Generator()
        before = compile_rng.get_state()
        with dtensor_random._rng_tracker._distribute_region(spec, generator):
            x = torch.rand(3)  # the region installs no compile_rng mode: torch's generator draws
        assert stock.entered == [(spec, generator)]
        assert compile_rng.get_state() == before and x.shape == (3,)


def _outcome(fn):
    try:
        out = fn()
    except Exception as e:  # stock DTensor refuses some of these ops: that is the behaviour to keep
        return ("raises", type(e), str(e).splitlines()[0])
    return ("returns", type(out), out.placements, out.to_local().shape)


def test_op_handlers_hand_unserved_meshes_to_stock_dispatch(monkeypatch):
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = dict(handlers)
    calls = {
        "exponential_": lambda t: t.exponential_(),
        "log_normal_": lambda t: t.log_normal_(),
        "geometric_": lambda t: t.geometric_(0.5),
        "cauchy_": lambda t: t.cauchy_(),
        "random_": lambda t: t.random_(0, 10),
        "bernoulli_": lambda t: t.bernoulli_(torch.full_like(t, 0.5)),
    }
    with fake_rank(1, 2):
        mesh = DeviceMesh("meta", [0, 1])

        def run_all():
            return {name: _outcome(lambda call=call: call(DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0)])))
                    for name, call in calls.items()}

        with monkeypatch.context() as m:  # stock torch: compile_rng's handlers removed
            for op in unrouted_ops.UNROUTED:
                m.delitem(handlers, op)
            stock = run_all()

        def refuse(*args, **kwargs):
            raise AssertionError("compile_rng's region ran for a mesh it does not serve")

        monkeypatch.setattr(dtensor_random._rng_tracker, "_distribute_region", refuse)
        assert run_all() == stock
        # Not vacuous: stock DTensor runs exponential_ where it has a sharding strategy for
        # it (torch 2.12+); torch 2.11's has none for these ops, and every call raises there.
        propagator = DTensor._op_dispatcher.sharding_propagator
        strategies = (propagator.op_strategy_funcs, propagator.op_single_dim_strategy_funcs, propagator.op_to_rules)
        has_strategy = any(torch.ops.aten.exponential_.default in table for table in strategies)
        assert any(o[0] == "returns" for o in stock.values()) == has_strategy
    assert handlers == mine  # each handler stepped back in after its call


def test_op_handlers_still_serve_cpu_meshes():
    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        t = local_zeros((4, 3), mesh, [Shard(0)])
        compile_rng.manual_seed(9)
        t.exponential_()
        assert compile_rng.get_state() == (9, ceil4(4 * 3))  # compile_rng's stream advanced by ceil4(numel(global))


class _PauseInStockDispatch(TorchDispatchMode):
    """In the thread that enters it: at the first ``exponential_``, say so (``inside``) and
    wait for ``resume`` before running it."""

    def __init__(self, inside: threading.Event, resume: threading.Event):
        super().__init__()
        self.inside, self.resume = inside, resume

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.exponential_.default and not self.inside.is_set():
            self.inside.set()
            assert self.resume.wait(60), "the other thread did not finish"
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(torch_release(torch.__version__) < (2, 12), reason="torch 2.11's own DTensor dispatch has no sharding "
                    "strategy for exponential_ (it raises, threads or not)")
def test_a_stock_dispatch_in_one_thread_leaves_the_handler_to_the_others():
    """While one thread hands ``exponential_`` to DTensor's own dispatch (what the handler
    does for a mesh compile_rng does not serve), the same op in another thread, on a CPU
    mesh, still runs compile_rng's handler: the handler table is the same for every
    thread (stepping the handler out of it for the call gave the other thread stock torch's
    draw from its own generator)."""
    from compile_rng._torch.dtensor_internals import dtensor_dispatch_unhandled

    inside, resume, failed = threading.Event(), threading.Event(), []
    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        stocks, served = local_zeros((4, 3), mesh, [Shard(0)]), local_zeros((4, 3), mesh, [Shard(0)])

        def hand_to_stock_dispatch():
            try:
                with _PauseInStockDispatch(inside, resume):
                    dtensor_dispatch_unhandled(torch.ops.aten.exponential_.default, (stocks,), {})
            except BaseException as e:  # noqa: BLE001  (reported by the main thread)
                failed.append(e)
                inside.set()

        other = threading.Thread(target=hand_to_stock_dispatch)
        compile_rng.manual_seed(9)
        other.start()
        try:
            assert inside.wait(60)
            served.exponential_()  # meanwhile, in this thread
        finally:
            resume.set()
            other.join(60)
        assert not failed, failed
        assert compile_rng.get_state() == (9, ceil4(4 * 3))  # compile_rng's handler drew, and only it
        assert (stocks.to_local() > 0).all()  # the stock dispatch ran too, on torch's generator
