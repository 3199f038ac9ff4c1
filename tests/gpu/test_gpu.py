"""The GPU suite (``make test-gpu``): compile_rng on CUDA tensors and CUDA meshes.

Skipped where no CUDA device is present. ``tests/test_triton_kernels.py`` and the
``triton`` entry of ``tests/test_stream_conformance.py`` run their kernels on the GPU
too when one is present (CPU == GPU against the scalar reference and the CPU kernels).

Here: eager == compiled bitwise on CUDA; CPU == GPU bitwise for the integer-derived ops;
DTensor ops on a CUDA mesh (fake process group, 4 ranks on this one GPU) at
``OffsetBasedRNGTracker``'s offsets with compile_rng's values, no generator touched in
a compiled graph; invariant init equal to single device; dropout backward without a
saved mask; activation checkpointing.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from dtensor_reference import fake_rank, tracker_start  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

import compile_rng  # noqa: E402
from compile_rng.eager import dispatch_modes
from compile_rng import ops  # noqa: E402

CUDA = torch.device("cuda", torch.cuda.current_device())
WORLD = 4


def _program(x):
    dropped, u, n = F.dropout(x, 0.3), torch.rand_like(x), torch.randn(x.shape, device=x.device)
    return dropped * u + n, (dropped, u, n, torch.bernoulli(torch.full_like(x, 0.4)))


def test_eager_equals_compiled_on_cuda():
    """The draws bitwise; the arithmetic on them within float32 rounding: Inductor's
    Triton contracts ``dropped * u + n`` into an FMA, eager rounds twice (on an H200,
    torch 2.11, the sum differed in its last digits when the test compared it bitwise)."""
    x = torch.randn(64, 33, device=CUDA)
    compile_rng.manual_seed(3)
    with dispatch_modes.eager_stream():
        eager_sum, eager_draws = _program(x)
    eager_state = compile_rng.get_state(CUDA)
    compile_rng.manual_seed(3)
    compiled_sum, compiled_draws = torch.compile(_program, backend="compile_rng")(x)
    assert compile_rng.get_state(CUDA) == eager_state
    for a, b in zip(eager_draws, compiled_draws):
        assert torch.equal(a, b)
    torch.testing.assert_close(compiled_sum, eager_sum, rtol=2**-22, atol=2**-22)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_cpu_equals_gpu_bitwise(dtype):
    size, strides = [37, 41], [50, 1]
    for seed, base in ((0, 0), (2**63 + 9, 2**32 - 5), (2**64 - 1, 2**64 - 6)):
        outs = {}
        for device in ("cpu", CUDA):
            key = ops.make_key(seed, base, device)
            x = torch.linspace(-3, 3, 37 * 41, dtype=dtype).view(size).to(device)
            outs[device] = [
                ops.uniform(key, 5, size, strides, -1.0, 2.0, dtype),
                ops.bernoulli(key, 5, size, strides, 0.3, dtype),
                *ops.dropout(key, 5, x, strides, 0.2),
                ops.randint(key, 5, size, strides, -7, 1000, torch.int32),
                ops.random_bits(key, 5, size, strides),
            ]
        for a, b in zip(outs["cpu"], outs[CUDA]):
            assert torch.equal(a, b.cpu())


def _local_zeros(global_shape, mesh, placements):
    local_shape, _ = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return DTensor.from_local(
        torch.zeros(local_shape, device=CUDA), mesh, placements,
        shape=torch.Size(global_shape), stride=torch.empty(global_shape).stride(),
    )


def test_cuda_mesh_follows_torchs_offsets_with_compile_rng_values():
    fn = lambda x: x.uniform_(-1.0, 1.0) * 1  # noqa: E731
    be = compile_rng.backend()
    compiled = torch.compile(fn, backend=be)
    locals_ = []
    for rank in range(WORLD):
        with fake_rank(rank, WORLD):
            mesh = DeviceMesh("cuda", list(range(WORLD)))
            results = []
            for run in (fn, compiled):
                compile_rng.manual_seed(11)
                x = _local_zeros((8, 6), mesh, [Shard(0)])
                results.append(run(x).to_local())
                assert compile_rng.get_state(CUDA) == (11, 48)
            x = _local_zeros((8, 6), mesh, [Shard(0)])
            start = tracker_start(x, list(mesh.get_coordinate()))  # torch's own helpers
            shape = list(x.to_local().shape)
            want = ops.uniform(ops.make_key(11, start), 0, shape, [6, 1], -1.0, 1.0, torch.float32)
            assert torch.equal(results[0].cpu(), want) and torch.equal(results[1].cpu(), want)
            locals_.append(results[1])
    assert not torch.equal(locals_[0], locals_[1])
    # one graph for every rank (an even shard: an uneven one gives the last rank another
    # local shape, which Dynamo compiles again for, as it would without compile_rng)
    assert len(be.plans) == 1
    graph = be.plans[0].graphs[0]
    assert "run_dtensor_rng_op" not in graph and "aten.uniform" not in graph


def test_invariant_init_equals_single_device_on_a_cuda_mesh():
    @compile_rng.init(layout="invariant")
    def init(w):
        torch.nn.init.trunc_normal_(w, std=0.02)
        return w

    compile_rng.manual_seed(5)
    full = init(torch.empty(12, 8, device=CUDA))
    for rank in range(WORLD):
        with fake_rank(rank, WORLD):
            mesh = DeviceMesh("cuda", list(range(WORLD)))
            compile_rng.manual_seed(5)
            w = init(_local_zeros((12, 8), mesh, [Shard(0)]))
            rows = 12 // WORLD
            assert torch.equal(w.to_local(), full[rank * rows:(rank + 1) * rows])


def test_replicas_agree_and_dropout_backward_regenerates_the_mask():
    x = torch.randn(16, 32, device=CUDA, requires_grad=True)
    f = torch.compile(lambda t: F.dropout(t, 0.5).sum(), backend="compile_rng")
    compile_rng.manual_seed(2)
    f(x).backward()
    mask = x.grad != 0
    compile_rng.manual_seed(2)
    _, keep = ops.dropout(ops.make_key(2, 0, CUDA), 0, torch.ones_like(x), [32, 1], 0.5)
    assert torch.equal(mask, keep)


def test_activation_checkpointing_recomputes_the_same_masks():
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(32, 32, device=CUDA)

    def block(t):
        return F.dropout(lin(t), 0.3)

    def step(t, ckpt):
        return (checkpoint(block, t, use_reentrant=False) if ckpt else block(t)).square().sum()

    grads = []
    for ckpt in (False, True):
        x = torch.randn(8, 32, device=CUDA, requires_grad=True, generator=torch.Generator(CUDA).manual_seed(0))
        compile_rng.manual_seed(4)
        torch.compile(step, backend="compile_rng")(x, ckpt).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_an_eager_step_recomputes_its_rows_masks_on_the_device_thread():
    """An eager model in a step (rows 4-7 of a global batch of 8): activation checkpointing
    recomputes its dropout during backward on autograd's CUDA device thread, which gets the
    kernels' handler with the caller's thread state and the step's rows from its copy of
    the caller's context variables - the gradients equal the uncheckpointed run's, and the
    forward equals rows 4-7 of the whole batch."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(32, 32, device=CUDA)

    def block(t):
        return F.dropout(lin(t), 0.3)

    x = torch.randn(8, 32, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    grads, outs = [], []
    for ckpt in (False, True):
        part = x[4:].clone().requires_grad_()
        compile_rng.manual_seed(4)
        with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
            out = checkpoint(block, part, use_reentrant=False) if ckpt else block(part)
            out.square().sum().backward()
        grads.append(part.grad)
        outs.append(out.detach())
    compile_rng.manual_seed(4)
    with compile_rng.step(8), torch.no_grad():
        whole = block(x)
    assert torch.equal(outs[0], whole[4:]) and torch.equal(outs[1], outs[0])
    assert torch.equal(grads[0], grads[1])


def test_replicated_dtensor_is_equal_on_every_rank():
    values = []
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cuda", [0, 1])
            compile_rng.manual_seed(8)
            values.append(_local_zeros((5, 5), mesh, [Replicate()]).normal_().to_local())
    assert torch.equal(values[0], values[1])


def test_draws_and_compiled_calls_never_wait_for_the_gpu():
    """An eager draw and a compiled graph's call hand their key to the GPU without
    synchronizing: the host runs ahead of the device. (From pageable memory the key's copy
    waited for the stream, so every dropout stalled the host until the GPU caught up.)
    torch's sync debug mode raises on any synchronizing call."""
    x = torch.randn(1024, device=CUDA)
    f = torch.compile(lambda t: F.dropout(t, 0.1) + 1, backend="compile_rng")
    f(x)  # the compile itself may synchronize
    with dispatch_modes.eager_stream():
        F.dropout(x, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        f(x)
        with dispatch_modes.eager_stream():
            F.dropout(x, 0.1)
            torch.rand(7, device=CUDA)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_backward_after_the_step_recomputes_its_rows_masks_on_the_device_thread():
    """``loss.backward()`` after the step's block (``scaler.scale(loss).backward()``): the
    device thread gets no stream from the caller, so the recomputation's stream comes
    with the RNG state the checkpoint saved - plain and ``Shard(1)`` DTensor dropouts at
    rows 4-7 of 8 recompute the forward's masks (tests/test_stream_edges.py on CPU)."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(32, 32, device=CUDA)
    x = torch.randn(4, 32, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))

    def run(block, t, ckpt):
        part = t.detach().clone().requires_grad_()
        compile_rng.manual_seed(4)
        with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
            out = checkpoint(block, part, use_reentrant=False) if ckpt else block(part)
            loss = out.square().sum()
        loss.backward()
        return part.grad

    plain = lambda t: F.dropout(lin(t), 0.3)  # noqa: E731
    assert torch.equal(run(plain, x, False), run(plain, x, True))
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cuda", [0, 1])
            sharded = DTensor.from_local(x[:, rank * 16:(rank + 1) * 16], mesh, [Shard(1)])
            block = lambda t: F.dropout(t * 2, 0.3)  # noqa: E731
            assert torch.equal(run(block, sharded, False).to_local(), run(block, sharded, True).to_local())


def test_microbatches_leave_torchs_generator_moving_forward():
    """Code between microbatches drawing from torch's CUDA generator (augmentation after a
    batch's transfer) gets new numbers for every batch; the microbatches draw the whole
    batch's masks."""
    x = torch.ones(8, 16, device=CUDA)
    compile_rng.manual_seed(6)
    with compile_rng.step(8):
        whole = F.dropout(x, 0.5)
    compile_rng.manual_seed(6)
    from compile_rng.eager.batches import open_step

    step, between, parts = open_step(8), [], []
    for half in (x[:4], x[4:]):
        between.append(torch.rand(64, device=CUDA))  # stock torch, outside the step
        with step.microbatch(4):
            parts.append(F.dropout(half, 0.5))
    step.finish()
    assert not torch.equal(between[0], between[1])
    assert torch.equal(torch.cat(parts), whole)
