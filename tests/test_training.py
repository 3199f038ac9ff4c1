"""Dropout in training: forward and backward use one mask, also when the backward
recomputes it (activation checkpointing, the memory-budget partitioner: pytorch
#190758 re-draws it there), on plain tensors and on DTensor activations."""

import sys

import reference as ref
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import compile_rng

SEED = 77
N = (64, 64)
P = 0.5


def expected_keep(base: int = 0) -> torch.Tensor:
    n = N[0] * N[1]
    return torch.tensor([ref.keep_bernoulli(SEED, base + i, 1 - P) for i in range(n)]).view(N).float()


def block(x, w):
    return F.dropout(torch.relu(x), P) * w


def checkpointed(x, w):
    return checkpoint(block, x, w, use_reentrant=False)


def _grads(fn, x, w):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    compile_rng.manual_seed(SEED)
    out = fn(x, w)
    out.sum().backward()
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize(
    "fn,budget",
    [(block, 1.0), (checkpointed, 1.0), (block, 0.0)],
    ids=["plain", "checkpoint", "memory-budget-0"],
)
@pytest.mark.parametrize("p", [0.5, 0.09], ids=["p=0.5", "p=0.09 (1/(1-p) rounds differently in fp32)"])
def test_backward_uses_the_forward_mask(fn, budget, p, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "P", p)
    torch._dynamo.reset()
    x, w = torch.randn(N), torch.randn(N)
    with torch._functorch.config.patch(activation_memory_budget=budget):
        out, gx, gw = _grads(torch.compile(fn, backend=compile_rng.backend()), x, w)
    noise = expected_keep().div_(1 - P)
    relu = torch.relu(x)
    assert torch.equal(out, relu * noise * w)
    assert torch.equal(gw, relu * noise)
    assert torch.equal(gx, (w * noise) * (x > 0))
    assert compile_rng.get_state() == (SEED, N[0] * N[1])


def test_dtensor_dropout_forward_backward_matches_eager():
    from dtensor_reference import fake_rank
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    torch._dynamo.reset()
    compiled = torch.compile(checkpointed, backend=compile_rng.backend())
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cpu", [0, 1])
            torch.manual_seed(0)
            x_local, w_local = torch.randn(32, 64), torch.randn(32, 64)
            results = []
            for fn in (block, compiled):  # eager DTensor (the tracker) vs compiled + checkpoint
                x = DTensor.from_local(x_local.clone(), mesh, [Shard(0)]).requires_grad_()
                w = DTensor.from_local(w_local.clone(), mesh, [Shard(0)]).requires_grad_()
                compile_rng.manual_seed(SEED)
                out = fn(x, w)
                out.sum().backward()
                results.append((out.to_local().detach(), x.grad.to_local(), w.grad.to_local()))
            for e, c in zip(*results):
                assert torch.equal(e, c)
            kept = results[1][2] != 0  # relu(x) * mask: a quarter survives both
            assert 0.15 < kept.float().mean() < 0.35


def _saved_bytes(fn, x):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return total[0], out


def test_compiled_dropout_saves_no_mask_for_backward():
    torch._dynamo.reset()
    x = torch.randn(256, 256, requires_grad=True)
    fn = lambda t: F.dropout(t, 0.3)  # noqa: E731
    eager_bytes, _ = _saved_bytes(fn, x)
    compile_rng.manual_seed(SEED)
    compiled_bytes, out = _saved_bytes(torch.compile(fn, backend=compile_rng.backend()), x)
    out.sum().backward()
    keep = torch.tensor([ref.keep_bernoulli(SEED, i, 0.7) for i in range(256 * 256)]).view(256, 256).float()
    assert torch.equal(x.grad, keep.div_(0.7))  # the regenerated mask is the forward's
    assert eager_bytes >= 256 * 256  # eager keeps a bool mask
    assert compiled_bytes <= 64, compiled_bytes  # compiled keeps the key only
    print(f"\nsaved for backward: eager {eager_bytes} bytes, compiled {compiled_bytes} bytes")
