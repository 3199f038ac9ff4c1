"""Bad inputs: each error names the op or argument and the fix."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_rng
from compile_rng.launch import spawn


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda x: F.dropout(x, 1.5), "p=1.5 is not a probability"),
        (lambda x: torch.bernoulli(x, float("nan")), "p=nan is not a probability"),
        (lambda x: x.to(torch.int64).uniform_(), "dtype torch.int64 has no continuous distribution"),
        (lambda x: x.exponential_(-1.0), "lambd=-1.0 is not positive"),
        (lambda x: x.to(torch.bool).normal_(), "floating-point|no continuous distribution"),
    ],
    ids=["dropout p>1", "bernoulli p nan", "integer uniform_", "negative rate", "bool normal_"],
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
        with pytest.raises(RuntimeError, match=r"bernoulli_ expects p to be in \[0, 1\], but got p=-0.5"):
            x.bernoulli_(-0.5)  # torch's own error, as for a plain tensor


def test_a_generator_argument_in_an_eager_segment_draws_from_that_generator():
    """``generator=`` asks for torch's generator by name: inside a stream (here the eager
    code of a ``compile_rng.compile``d call) the op draws torch's values from it, and the
    stream does not move."""
    def fn(x):
        return x + torch.rand(4, generator=torch.Generator().manual_seed(0))  # Dynamo runs it eagerly

    torch._dynamo.reset()
    before = compile_rng.get_state()
    got = compile_rng.compile(fn, inner="aot_eager")(torch.ones(4))
    assert torch.equal(got, 1 + torch.rand(4, generator=torch.Generator().manual_seed(0)))
    assert compile_rng.get_state() == before


def test_dtensor_operands_from_another_mesh_or_plain_tensors_are_refused():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    with fake_rank(0, 2):
        mesh, reversed_mesh = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [1, 0])
        x = local_zeros((4, 4), mesh, [Shard(0)])
        p = DTensor.from_local(torch.full((2, 4), 0.5), reversed_mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"bernoulli_.Tensor: an operand lives on the cpu mesh of ranks \[1, 0\]"):
            x.clone().bernoulli_(p)
        with pytest.raises(ValueError, match="mixes a torch.Tensor operand with a DTensor"):
            x.clone().bernoulli_(torch.full((2, 4), 0.5))


def _operand_layout_worker(rank: int, world: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    probabilities = torch.tensor([[1.0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4])  # rows 0-1 certain, rows 2-3 never
    for placement in ([Replicate()], [Shard(1)], [Shard(0)]):
        p = distribute_tensor(probabilities, mesh, placement)
        got = x.clone().bernoulli_(p).to_local()
        assert torch.equal(got, torch.full((2, 4), 1.0 if rank == 0 else 0.0)), (placement, got)


@pytest.mark.slow
def test_bernoulli_probabilities_in_another_layout_follow_the_target_shard_on_real_ranks():
    spawn(_operand_layout_worker, 2)


def test_a_stock_inductor_graph_in_a_step_is_named():
    """Stock Inductor draws its graph's seeds from torch's generator; inside a step that
    is named as what it is, with the fix, not as an op with no counter-based form."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: F.dropout(x, 0.5, True))  # the default backend
    x = torch.ones(8, 4)
    fn(x)
    with pytest.raises(NotImplementedError, match="compiled by another backend.*backend='compile_rng'"):
        with compile_rng.step(8):
            fn(x)


def test_an_unbatched_graph_on_part_of_the_batch_is_refused():
    """A graph compiled without batched=True draws at its call's own counters: over the
    step's whole batch those are the eager ones (the same values and state); on a
    microbatch or a data-parallel rank's rows it would draw every part alike (the same
    masks for every microbatch), so it raises naming the op and batched=True, and the
    stream does not move."""
    torch._dynamo.reset()
    x = torch.ones(8, 4)
    fn = torch.compile(lambda t: F.dropout(t, 0.5), backend="compile_rng")
    results = []
    for run in (fn, lambda t: F.dropout(t, 0.5)):
        compile_rng.manual_seed(3)
        with compile_rng.step(8):
            results.append((run(x), compile_rng.get_state()))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]
    for step in ({"rows": [4, 5, 6, 7], "global_batch": 8}, {"microbatch": 4}):
        compile_rng.manual_seed(3)
        with pytest.raises(NotImplementedError, match=r"aten\.native_dropout.*part of the step's global batch"
                                                      r".*batched=True"):
            if "microbatch" in step:
                with compile_rng.step(8) as s, s.microbatch(4):
                    fn(x[:4])
            else:
                with compile_rng.step(4, **step):
                    fn(x[:4])
        assert compile_rng.get_state() == (3, 0)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_random_op_in_a_higher_order_ops_branch_is_refused_by_name(inner):
    """torch.cond's branches are subgraphs the rewrite does not reach: Inductor ran the pass
    on them and failed with an internal error; aot_eager ran their dropout unrewritten,
    other values than eager code's in the step, silently. Both refuse it, naming the op."""
    def program(x):
        return torch.cond(x.sum() > 0, lambda t: F.dropout(t, 0.5), lambda t: t * 2, (x,))

    torch._dynamo.reset()
    fn = torch.compile(program, backend=compile_rng.backend(inner=inner))
    with pytest.raises(Exception, match=r"aten\.native_dropout.*higher-order op \(torch\.cond"):
        with compile_rng.step(4):
            fn(torch.ones(4, 6))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpoint_without_rng_state_recomputing_a_draw_in_a_step_is_refused(reentrant):
    """checkpoint(preserve_rng_state=False) has no state to replay the forward's dropout:
    its recomputation drew a backward replica (the same mask for every microbatch and
    rank, another than the forward's), silently. Refused in the backward; a gradient hook's
    draw in the same backward is still a replica."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(4, 6, requires_grad=True)
    with pytest.raises(NotImplementedError, match="preserve_rng_state=False"):
        with compile_rng.step(4):
            out = checkpoint(lambda t: F.dropout(t, 0.5), x, use_reentrant=reentrant, preserve_rng_state=False)
            out.sum().backward()
    noise = []
    y = torch.ones(4, 6, requires_grad=True)
    y.register_hook(lambda g: noise.append(torch.rand_like(g)) or g)
    with compile_rng.step(4):
        (y * 2).sum().backward()
    assert len(noise) == 1


# --- collectives on the process group's device (NCCL without a GPU) ----------------------


@pytest.mark.parametrize(
    "backend,device", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cpu"), ("xccl", "xpu")]
)
def test_collective_device_follows_the_backend(monkeypatch, backend, device):
    import torch.distributed as dist

    from compile_rng.stream import agreement

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert agreement.collective_device() == torch.device(device)


def test_the_step_and_verify_build_their_collectives_on_an_nccl_groups_device(monkeypatch):
    """On a group whose backend says NCCL, every collective tensor compile_rng builds is on
    the device :func:`~compile_rng.stream.agreement.collective_device` chooses for the
    group: CUDA. ``meta`` stands in for the chosen device, so the tensors can be built on
    any machine; each collective records its tensors' devices and stops the call there."""
    import torch.distributed as dist
    from dtensor_reference import fake_rank

    from compile_rng.semantics import verify
    from compile_rng.stream import agreement

    class Reached(Exception):
        pass

    chosen, built = [], []
    choose = agreement.collective_device

    def stand_in(group=None):
        chosen.append(choose(group))
        return torch.device("meta")

    def collective(*args, **kwargs):
        tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        built.append({t.device.type for t in tensors})
        raise Reached

    def gather_objects(into, mine, group=None):
        into[:] = [mine] * len(into)

    with fake_rank(0, 2), monkeypatch.context() as m:
        m.setattr(dist, "get_backend", lambda group=None: "nccl")
        m.setattr(agreement, "collective_device", stand_in)
        m.setattr(dist, "all_gather_object", gather_objects)
        m.setattr(dist, "all_gather", collective)
        m.setattr(dist, "all_reduce", collective)
        with pytest.raises(Reached):  # the rows of this rank: one all-gather of the local batch sizes
            with compile_rng.step(4, data_parallel=dist.group.WORLD):
                pass
        with pytest.raises(Reached):  # the rank-agreement check of a step with names
            with compile_rng.step(4, names=torch.nn.Linear(2, 2)):
                pass
        with pytest.raises(Reached):  # verify=True's check before a compiled call
            verify.check("graph", 0, 0, "sig", [dist.group.WORLD])
    assert chosen == [torch.device("cuda")] * 3
    assert built == [{"meta"}] * 3


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_a_compiled_recurrent_dropout_torch_would_drop_is_refused(cls):
    """With Dynamo's ``allow_rnn`` a multi-layer RNN compiles as one call, whose
    decomposition applies no dropout between layers (a torch bug): the graph drew no masks,
    unlike eager code. Refused; in eval mode there is no such dropout and it compiles."""
    torch.manual_seed(0)
    rnn = cls(6, 5, num_layers=2, dropout=0.4, batch_first=True)
    x = torch.randn(4, 3, 6)
    with torch._dynamo.config.patch(allow_rnn=True):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"torch.{cls.__name__.lower()} with 2 layers and dropout=0.4 in training"):
            torch.compile(rnn, backend="compile_rng")(x)
        if cls is nn.LSTM:  # stock Inductor fails an eval-mode LSTM under allow_rnn (mkldnn_rnn_layer)
            return
        rnn.eval()
        torch._dynamo.reset()
        # no random op left: Inductor's arithmetic, not the stream, sets the last bits
        torch.testing.assert_close(torch.compile(rnn, backend="compile_rng")(x)[0], rnn(x)[0])
