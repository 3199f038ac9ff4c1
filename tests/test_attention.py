"""``F.scaled_dot_product_attention`` under ``backend="compile_rng"``.

At ``dropout_p=0`` the fused CPU kernel carries torch's random tag but draws nothing:
it compiles and matches eager. At ``dropout_p>0`` the attention-probability dropout is
an ordinary dropout on the stream: the probabilities tensor ``(B, H, L, S)`` draws
counters ``base + row-major index`` (tracker layout: the shard's start plus its local
index; invariant: the global index). With ``v`` the identity the output *is* the
dropped probabilities, so the mask is read off exactly and checked against the scalar
reference.
"""

import math

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from dtensor_reference import counters, fake_rank
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

import compile_rng
from compile_rng._torch.dtensor_internals import dtensor_views_flatten_sharded_dims

SEED = 5
B, H, L, D = 2, 4, 8, 8
P = 0.3


def attention(q, k, v, p=P, causal=False):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)


def checkpointed(q, k, v):
    return checkpoint(attention, q, k, v, use_reentrant=False)


def inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    v = torch.eye(D, dtype=dtype).expand(B, H, L, D).contiguous()
    return q, k, v


def reference_keep(cs: list[int], shape) -> torch.Tensor:
    return torch.tensor([ref.keep_bernoulli(SEED, c, 1 - P) for c in cs]).view(shape)


def reference_attention(q, k, v, keep):
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return (probs * keep / (1 - P)) @ v


def _run(fn, q, k, v):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    compile_rng.manual_seed(SEED)
    out = fn(q, k, v)
    (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_no_dropout_compiles_and_matches(inner):
    q, k, v = inputs(torch.float32)
    v = torch.randn(B, H, L, D)
    fn = lambda q, k, v: attention(q, k, v, p=0.0, causal=True)  # noqa: E731
    torch._dynamo.reset()
    got = _run(torch.compile(fn, backend=compile_rng.backend(inner=inner)), q, k, v)
    torch._dynamo.reset()
    baseline = _run(fn if inner == "aot_eager" else torch.compile(fn, backend="inductor"), q, k, v)
    for a, b in zip(got, baseline):
        assert torch.equal(a, b)
    assert compile_rng.get_state() == (SEED, 0)  # nothing drawn


@pytest.mark.parametrize("fn", [attention, checkpointed], ids=["plain", "checkpoint"])
def test_attention_dropout_mask_is_the_stream_and_backward_reuses_it(fn):
    q, k, v = inputs()
    torch._dynamo.reset()
    out, gq, gk, gv = _run(torch.compile(fn, backend="compile_rng"), q, k, v)
    shape = (B, H, L, L)
    keep = reference_keep(list(range(B * H * L * L)), shape)
    assert torch.equal(out != 0, keep)  # v = I: the output is the dropped probabilities
    assert compile_rng.get_state() == (SEED, B * H * L * L)
    # gradients of the same math with the reference mask (float64: only summation order differs)
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    expected = reference_attention(rq, rk, rv, keep)
    (expected * torch.arange(expected.numel(), dtype=expected.dtype).view(expected.shape)).sum().backward()
    for got, want in ((out, expected.detach()), (gq, rq.grad), (gk, rk.grad), (gv, rv.grad)):
        assert (got - want).abs().max() < 1e-9


@pytest.mark.skipif(not dtensor_views_flatten_sharded_dims() or torch.__version__ < "2.13",
                    reason="this torch cannot trace SDPA on heads sharded over TP, without compile_rng too: 2.11's "
                    "DTensor cannot flatten a sharded dim, 2.12's Dynamo fails its view rule on fake tensors")
@pytest.mark.parametrize("mode", ["tracker", "invariant"])
def test_heads_sharded_over_tp(mode):
    """Heads ``Shard(1)`` over 2 ranks: one compile (as rank 0) serves both ranks; each
    rank's mask is the stream at its layout's counters, and backward uses it."""
    q, k, v = inputs()
    shape = (B, H, L, L)
    torch._dynamo.reset()
    be = compile_rng.backend(layout=mode)
    compiled = torch.compile(attention, backend=be)
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cpu", [0, 1])
            heads = slice(rank * H // 2, (rank + 1) * H // 2)
            local = [DTensor.from_local(t[:, heads].clone(), mesh, [Shard(1)]) for t in (q, k, v)]
            for t in local:
                t.requires_grad_()
            compile_rng.manual_seed(SEED)
            out = compiled(*local)
            out.to_local().sum().backward()
            assert compile_rng.get_state() == (SEED, B * H * L * L)
            if mode == "tracker":
                probs = DTensor.from_local(torch.zeros(B, H // 2, L, L), mesh, [Shard(1)])
                cs = counters(probs, 0)
            else:
                index = torch.arange(B * H * L * L).view(shape)[:, heads]
                cs = index.flatten().tolist()
            keep = reference_keep(cs, (B, H // 2, L, L))
            assert torch.equal(out.to_local() != 0, keep), rank
            # d sum(out) / d v[..., s, d] sums the dropped probabilities of column s: the same mask
            dropped = reference_attention(q[:, heads], k[:, heads], v[:, heads], keep)
            expected_gv = dropped.sum(-2).unsqueeze(-1).expand(B, H // 2, L, D)
            assert (local[2].grad.to_local() - expected_gv).abs().max() < 1e-9
    assert len(be.plans) == 1


FUSED_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _fused(q, k, v, p):
    return FUSED_CPU(q, k, v, dropout_p=p)[0]


@pytest.mark.parametrize("where", ["compiled", "eager_stream"])
def test_fused_attention_with_dropout_names_the_fix(where):
    """The fused CPU kernel called with ``dropout_p > 0`` would draw its own mask from
    torch's generator: the graph pass (compiled) and the dispatch mode (eager stream)
    refuse it with an error naming the op and the math backend. At ``dropout_p=0`` the
    same kernel draws nothing and runs untouched."""
    q, k, v = inputs(torch.float32)
    compile_rng.manual_seed(SEED)
    if where == "compiled":
        torch._dynamo.reset()
        run = torch.compile(_fused, backend=compile_rng.backend(inner="aot_eager"))
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="math backend") as info:
            run(q, k, v, 0.1)
        assert isinstance(info.value.inner_exception, NotImplementedError)
        assert str(FUSED_CPU) in str(info.value.inner_exception)
        torch._dynamo.reset()
        run = torch.compile(_fused, backend=compile_rng.backend(inner="aot_eager"))
        assert torch.equal(run(q, k, v, 0.0), _fused(q, k, v, 0.0))
    else:
        with compile_rng.eager.dispatch_modes.eager_stream():
            with pytest.raises(NotImplementedError, match="math backend") as info:
                _fused(q, k, v, 0.1)
            assert str(FUSED_CPU) in str(info.value)
            assert torch.equal(_fused(q, k, v, 0.0), FUSED_CPU(q, k, v)[0])
    assert compile_rng.get_state() == (SEED, 0)  # nothing drawn either way
