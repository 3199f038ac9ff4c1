"""Failures stay loud and the stream stays defined: rank divergence, exceptions inside
compiled calls, recompilation, determinism across processes, bad inputs."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import compile_rng
from gloo_ranks import spawn

# --- rank divergence: verify=True ---------------------------------------------------------


def _verify_worker(rank: int, world: int, scenario: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    compile_rng.manual_seed(7 + rank if scenario == "seeds" else 7)
    if scenario == "extra-op" and rank == 1:
        torch.rand_like(x)  # an eager DTensor random op only rank 1 runs (a collective-free op)
    fn = torch.compile(lambda t: F.dropout(t + 1, 0.5), backend=compile_rng.backend(inner="aot_eager", verify=True))
    try:
        fn(x)
    except Exception as e:  # noqa: BLE001 - the message is the test
        message = str(e)
    else:
        message = ""
    expected = {"seeds": "seed: ranks [0] have 7; ranks [1] have 8", "extra-op": "offset: ranks [0] have 0; ranks [1] have 32", "agree": ""}
    assert expected[scenario] in message and bool(message) == bool(expected[scenario]), message


@pytest.mark.parametrize("scenario", ["agree", "seeds", "extra-op"])
def test_verify_names_the_diverging_ranks_on_every_rank(scenario):
    spawn(_verify_worker, 2, scenario)


def test_verify_env_variable(monkeypatch):
    from compile_rng import verify

    monkeypatch.setenv("COMPILE_RNG_VERIFY", "1")
    assert verify.enabled(False)
    monkeypatch.setenv("COMPILE_RNG_VERIFY", "0")
    assert not verify.enabled(False)


# --- exceptions, graph breaks, recompilation ----------------------------------------------


def test_exception_inside_a_compiled_call_consumes_the_whole_graph():
    torch._dynamo.reset()

    def fn(x, idx):
        return torch.rand(3) + x[idx], torch.rand(5)

    compiled = torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))
    compile_rng.manual_seed(1)
    compiled(torch.ones(4), torch.tensor([0, 1, 2]))
    assert compile_rng.get_state() == (1, 12)
    with pytest.raises(IndexError):
        compiled(torch.ones(4), torch.tensor([0, 1, 9]))  # fails inside the graph, after rand(3)
    # documented: a call reserves its graph's counters before running, so it consumed all 12
    assert compile_rng.get_state() == (1, 24)


def test_graph_breaks_give_the_values_of_one_graph_for_dtensors():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    def one_graph(x):
        return torch.rand_like(x) + F.dropout(x + 1, 0.5)

    def with_break(x):
        a = torch.rand_like(x)
        torch._dynamo.graph_break()
        return a + F.dropout(x + 1, 0.5)

    torch._dynamo.reset()
    with fake_rank(1, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        outs = []
        for fn in (one_graph, with_break):
            compile_rng.manual_seed(3)
            outs.append((torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))(local_zeros((4, 6), mesh, [Shard(0)])).to_local(), compile_rng.get_state()))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] == (3, 48)


def test_recompilation_never_double_advances():
    torch._dynamo.reset()
    be = compile_rng.backend(inner="aot_eager")
    fn = torch.compile(lambda x: torch.rand_like(x) * 2, backend=be, dynamic=False)
    compile_rng.manual_seed(2)
    fn(torch.ones(5))
    fn(torch.ones(9))  # recompiles for the new shape
    fn(torch.ones(5))
    assert len(be.plans) == 2
    assert compile_rng.get_state() == (2, 8 + 12 + 8)


# --- determinism across processes, thread counts and compile caches ------------------------

PROGRAM = textwrap.dedent(
    """
    import hashlib, sys, torch, compile_rng
    import torch.nn.functional as F
    torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(123)
    x = torch.ones(300, 70)
    fn = torch.compile(lambda t: (torch.rand_like(t), torch.randn(257), F.dropout(t, 0.3), torch.randint(0, 9, (64,))),
                       backend="compile_rng")
    outs = [*fn(x), *fn(x)]
    h = hashlib.sha256()
    for o in outs:
        h.update(o.numpy().tobytes())
    print(h.hexdigest(), compile_rng.get_state())
    """
)


def test_same_seed_same_values_across_processes_threads_and_caches(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = []
    for threads in ("1", "2", "2"):  # cold cache, then a different thread count, then a warm cache
        out = subprocess.run([sys.executable, str(script), threads], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.strip())
    assert runs[0] == runs[1] == runs[2]


# --- bad inputs: each error names the op/argument and the fix ------------------------------


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda x: F.dropout(x, 1.5), "p=1.5 is not a probability"),
        (lambda x: torch.bernoulli(x, float("nan")), "p=nan is not a probability"),
        (lambda x: x.to(torch.int64).uniform_(), "dtype torch.int64 has no continuous distribution"),
        (lambda x: x.exponential_(-1.0), "lambd=-1.0 is not positive"),
    ],
    ids=["dropout p>1", "bernoulli p nan", "integer uniform_", "negative rate"],
)
def test_bad_arguments_are_named(fn, match):
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))(torch.ones(4))


def test_bad_arguments_on_dtensors_in_eager():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        x = local_zeros((4, 2), mesh, [Shard(0)])
        with pytest.raises((ValueError, RuntimeError), match="floating-point|no continuous distribution"):
            x.to(torch.int32).normal_()
        with pytest.raises(ValueError, match="is not a probability"):
            x.bernoulli_(-0.5)
