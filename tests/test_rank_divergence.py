"""Ranks that disagree are named, never silently desynchronized: ``verify=True`` /
``COMPILE_RNG_VERIFY`` before compiled calls, and ranks outside an op's mesh."""

import pytest
import torch
import torch.nn.functional as F

import compile_rng
from compile_rng.launch import spawn


def _verify_worker(rank: int, world: int, scenario: str) -> None:
    from dtensor_reference import ceil4
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    global_shape = (8, 4)
    per_op = ceil4(global_shape[0] * global_shape[1])  # 32: one rand_like over the global (8, 4), every rank
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(global_shape), mesh, [Shard(0)])
    compile_rng.manual_seed(7 + rank if scenario == "seeds" else 7)
    if scenario == "extra-op":
        # Both ranks run the first eager op on the mesh (it checks that they agree), then
        # only rank 1 runs another (eager DTensor random ops after that are collective-free).
        torch.rand_like(x)
        if rank == 1:
            torch.rand_like(x)
    fn = torch.compile(lambda t: F.dropout(t + 1, 0.5), backend=compile_rng.backend(inner="aot_eager", verify=True))
    try:
        fn(x)
    except Exception as e:  # noqa: BLE001 - the message is the test
        message = str(e)
    else:
        message = ""
    expected = {
        "seeds": "seed: ranks [0] have 7; ranks [1] have 8",  # manual_seed(7 + rank)
        # rank 0 ran one rand_like before the call, rank 1 two
        "extra-op": f"offset: ranks [0] have {per_op}; ranks [1] have {2 * per_op}",
        "agree": "",
    }
    assert expected[scenario] in message and bool(message) == bool(expected[scenario]), message


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["agree", "seeds", "extra-op"])
def test_verify_names_the_diverging_ranks_on_every_rank(scenario):
    spawn(_verify_worker, 2, scenario)


def test_verify_env_variable(monkeypatch):
    from compile_rng.semantics import verify

    monkeypatch.setenv("COMPILE_RNG_VERIFY", "1")
    assert verify.enabled(False)
    monkeypatch.setenv("COMPILE_RNG_VERIFY", "0")
    assert not verify.enabled(False)


def _outside_sub_mesh_worker(rank: int, world: int) -> None:
    from dtensor_reference import ceil4, uniform
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    sub = DeviceMesh("cpu", [0])  # rank 1 is not in it
    local = torch.zeros(4, 3) if rank == 0 else torch.zeros(0)
    t = DTensor.from_local(local, sub, [Replicate()], run_check=False)
    # rank 0 runs three ops over the replicated (4, 3): rand_like, exponential_, compiled rand_like
    numel = 4 * 3
    per_op = ceil4(numel)  # 12
    compile_rng.manual_seed(4)
    eager = [torch.rand_like(t), t.clone().exponential_()]
    compiled = torch.compile(lambda u: torch.rand_like(u), backend=compile_rng.backend(inner="aot_eager"))(t)
    if rank == 0:
        assert torch.equal(eager[0].to_local(), uniform(4, list(range(numel)), (4, 3)))
        third = 2 * per_op  # 24: the compiled op starts after the two eager ops' ranges
        assert torch.equal(compiled.to_local(), uniform(4, list(range(third, third + numel)), (4, 3)))
        assert compile_rng.get_state() == (4, 3 * per_op)  # 36
    else:  # documented: a rank outside the op's mesh runs nothing and keeps its state
        assert all(o.to_local().numel() == 0 for o in (*eager, compiled))
        assert compile_rng.get_state() == (4, 0)
    # the divergence this leaves is caught by the next verified call on a common mesh
    world_mesh = init_device_mesh("cpu", (world,))
    w = DTensor.from_local(torch.zeros(2), world_mesh, [Replicate()], run_check=False)
    fn = torch.compile(lambda u: torch.rand_like(u), backend=compile_rng.backend(inner="aot_eager", verify=True))
    # rank 0 is 3 * per_op ahead; rank 1, outside the sub-mesh, is still at 0
    with pytest.raises(RuntimeError, match=rf"offset: ranks \[0\] have {3 * per_op}; ranks \[1\] have 0"):
        fn(w)


@pytest.mark.slow
def test_rank_outside_a_sub_mesh_skips_the_op_and_verify_reports_the_divergence():
    spawn(_outside_sub_mesh_worker, 2)


def _named_step_streams_worker(rank: int, world: int) -> None:
    from compile_rng.stream import state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    stock_snapshot, stock_set_state = state.snapshot, state.set_state
    for offsets, refused in (((0, 0), False), ((0, 8), True)):
        compile_rng.manual_seed(7)  # the CPU streams agree
        # a stand-in accelerator stream (no GPU here): ranks at different offsets on it, as
        # stages that ran other stock CUDA random ops before the step would be
        state.snapshot = lambda mine=offsets[rank]: {**stock_snapshot(), "cuda": (7, mine)}
        state.set_state = lambda seed, offset, device="cpu": None if device == "cuda" else stock_set_state(
            seed, offset, device)
        try:
            with compile_rng.step(2, names=model):
                model(torch.ones(2, 4))
        except RuntimeError as e:
            assert refused and "different stream positions" in str(e) and "cuda offset" in str(e), e
        else:
            assert not refused
        finally:
            state.snapshot, state.set_state = stock_snapshot, stock_set_state


def test_a_named_step_compares_every_devices_stream_across_ranks():
    """A named draw uses its device's stream: ranks that agree on the CPU stream but not on
    an accelerator's are refused, naming the stream (real gloo ranks, a stand-in stream)."""
    spawn(_named_step_streams_worker, 2)
