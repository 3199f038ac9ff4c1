"""Randomness in the optimizer step: bf16 stochastic rounding under FSDP2 (and FSDP2 x TP).

Every rank trains on the same full batch, on bf16 ``nn.Linear``s whose inputs are data (no
backward between layers), so the gradients are bitwise equal in every configuration and
only the rounding's draws can make the weights differ. Two optimizers that round: the
pattern written out in eager code (``copy_stochastic_``: float32 update, ``randint_like``
bits on the DTensor parameter, under ``compile_rng.layout("invariant")``), and torchao's
``_AdamW(bf16_stochastic_round=True)``, whose step torchao compiles with stock
``torch.compile`` on the local shard (under ``compile_rng.library_compiles(layout=
"invariant")``: one line). After 6 steps the full weights of 1, 2 and 4 FSDP2 ranks and of
FSDP2=2 x TP=2 must be bitwise equal; stock torch's are not (the test can fail). A resumed
run (weights, optimizer state and stream saved after 3 steps) continues bitwise. A stock
``torch.compile`` graph that draws inside ``compile_rng.layout(...)`` is refused.
"""

from __future__ import annotations

import contextlib
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_rng
from compile_rng.launch import spawn

STEPS, DIM, OUT = 6, 16, 32


class Heads(nn.Module):
    """Two bf16 linear heads on the data: each weight's gradient is one GEMM of data."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(DIM, OUT, bias=False, dtype=torch.bfloat16)
        self.b = nn.Linear(DIM, OUT, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.a(x).float().square().mean() + self.b(x).float().sin().mean()


def copy_stochastic_(target: torch.Tensor, source: torch.Tensor) -> None:
    """The eager pattern fine-tuning scripts carry: ``source`` (float32) into ``target``
    (bf16), rounded up or down at random by the 16 bits it drops."""
    r = torch.randint_like(source, 0, 1 << 16, dtype=torch.int32)
    target.copy_(((source.view(torch.int32) + r) & -(1 << 16)).view(torch.float32))


class EagerSR(torch.optim.Optimizer):
    """SGD with momentum in float32, written back to the bf16 weights stochastically."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                momentum = state.setdefault("momentum", torch.zeros_like(p, dtype=torch.float32))
                momentum.mul_(0.9).add_(p.grad.float())
                copy_stochastic_(p, p.float() - group["lr"] * momentum)


def _sharded(model: Heads, world: int, tp: int) -> Heads:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if world == 0:  # one device, no FSDP: plain parameters
        return model
    if tp == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        dp = mesh
    else:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        plan = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh["tp"], {"a": plan, "b": plan})
    fully_shard(model.a, mesh=dp)
    fully_shard(model.b, mesh=dp)
    return model


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def _train(rank: int, world: int, tp: int, optimizer: str, rounding: str, out: str, resume: int = 0) -> None:
    if rounding == "stock":
        compile_rng.uninstall()
    world = 0 if tp == 0 else world  # tp=0: the plain model on one device
    model = _sharded(Heads(), world, tp)
    if optimizer == "eager":
        opt = EagerSR(model.parameters())
    else:
        from torchao.optim import _AdamW

        opt = _AdamW(model.parameters(), lr=0.05, bf16_stochastic_round=True)
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1)).bfloat16()
    torch.manual_seed(5)  # every rank alike, as training scripts seed (compile_rng's stream too)

    def block():
        if rounding == "stock":
            return contextlib.nullcontext()
        if optimizer == "torchao":
            return compile_rng.library_compiles(layout="invariant")  # the one line
        return compile_rng.layout("invariant")

    saved = None
    for step in range(STEPS):
        if resume and step == resume:  # a checkpoint, then the same run from a fresh model
            saved = ({k: _full(v) for k, v in model.state_dict().items()}, compile_rng.state_dict())
            old = [opt.state[p] for p in model.parameters()]
            model = _sharded(Heads(), world, tp)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(_shard_like(saved[0][name], p))
            opt = type(opt)(model.parameters(), **({"lr": 0.05} if optimizer == "eager" else
                                                   {"lr": 0.05, "bf16_stochastic_round": True}))
            for p, state in zip(model.parameters(), old):  # as saved (load_state_dict would cast
                opt.state[p] = {k: v.clone() for k, v in state.items()}  # float32 state to bf16)
            torch.manual_seed(123)  # a fresh process's stream: the checkpoint's must replace it
            compile_rng.load_state_dict(saved[1])
        model(x).backward()
        with block():
            opt.step()
        opt.zero_grad()
    weights = {name: _full(p).float().tolist() for name, p in model.named_parameters()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(weights, f)


def _shard_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def _run(tmp_path, world: int, tp: int, optimizer: str, rounding: str, resume: int = 0) -> dict:
    out = tmp_path / f"{world}-{tp}-{optimizer}-{rounding}-{resume}.json"
    spawn(_train, max(world, 1), tp, optimizer, rounding, str(out), resume)
    return {k: torch.tensor(v) for k, v in json.loads(out.read_text()).items()}


def _differing(a: dict, b: dict) -> int:
    return sum(int((a[k] != b[k]).sum()) for k in a)


#: (ranks, tp): FSDP2=2, FSDP2=4, FSDP2=2 x TP=2 against FSDP2=1 (one rank, a 1-rank mesh)
CONFIGS = [(2, 1), (4, 1), (4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["eager", "torchao"])
def test_stochastic_rounding_gives_the_one_device_weights_at_any_fsdp_size(tmp_path, optimizer):
    if optimizer == "torchao":
        pytest.importorskip("torchao")
    one = _run(tmp_path, 1, 1, optimizer, "invariant")
    configs = CONFIGS + ([(1, 0)] if optimizer == "torchao" else [])  # torchao compiles: plain parameters too
    differing = {f"{w}x{tp}": _differing(_run(tmp_path, w, tp, optimizer, "invariant"), one) for w, tp in configs}
    stock = _differing(_run(tmp_path, 2, 1, optimizer, "stock"), _run(tmp_path, 1, 1, optimizer, "stock"))
    print(f"{optimizer}: weights differing from one device, invariant {differing}; stock FSDP2=2 {stock}",
          file=sys.stderr)
    assert differing == {k: 0 for k in differing}
    assert stock > 0


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["eager", "torchao"])
def test_a_resumed_run_continues_bitwise(tmp_path, optimizer):
    if optimizer == "torchao":
        pytest.importorskip("torchao")
    assert _differing(_run(tmp_path, 2, 1, optimizer, "invariant", resume=3),
                      _run(tmp_path, 2, 1, optimizer, "invariant")) == 0


def test_a_stock_compiled_draw_inside_a_layout_block_is_refused():
    """torchao's step compiled by stock torch.compile under ``compile_rng.layout(...)`` drew
    torch's per-rank values silently; now such a graph is refused, naming the fix."""
    torch._dynamo.reset()
    fn = torch.compile(lambda t: t + torch.randint_like(t, 0, 9))
    x = torch.ones(4)
    fn(x)  # outside: stock torch
    with pytest.raises(NotImplementedError, match="compiled by another backend.*library_compiles"):
        with compile_rng.layout("invariant"):
            fn(x)

    @compile_rng.init(compile=False)
    def init(t):
        return fn(t)

    with pytest.raises(NotImplementedError, match="compiled by another backend"):
        init(x)


def test_library_compiles_sends_a_librarys_own_compile_to_the_stream():
    """Inside ``library_compiles`` a ``torch.compile`` with torch's default backend compiles
    with compile_rng's: the graph draws from the stream (the eager values), and
    ``torch.compile`` is torch's again after the block."""
    stock_compile = torch.compile
    torch._dynamo.reset()

    def fn(t):
        return F.dropout(t, 0.5) + torch.rand_like(t)

    x = torch.ones(6, 4)
    compile_rng.manual_seed(3)
    with compile_rng.layout("tracker"):
        from compile_rng.eager.dispatch_modes import eager_stream

        with eager_stream():
            want = fn(x)
    compile_rng.manual_seed(3)
    with compile_rng.library_compiles():
        got = torch.compile(fn, fullgraph=True)(x)
    assert torch.compile is stock_compile
    assert torch.equal(got, want)


def _compiled_and_eager(rank: int, world: int, out: str) -> None:
    from unittest import mock

    from torchao.optim import _AdamW

    from compile_rng.integrations import torchao_rounding

    def trained(compiled: bool) -> list:
        torch._dynamo.reset()
        model = _sharded(Heads(), world, 1)
        opt = _AdamW(model.parameters(), lr=0.05, bf16_stochastic_round=True)
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1)).bfloat16()
        torch.manual_seed(5)
        for _ in range(4):
            model(x).backward()
            if compiled:
                with compile_rng.library_compiles(layout="invariant"):
                    opt.step()
            else:  # torchao's own step, run eagerly, drawing its bits on the DTensors too
                with compile_rng.layout("invariant"), torchao_rounding.on_dtensors(), \
                        mock.patch("torch.compile", lambda fn, **kwargs: fn):
                    opt.step()
            opt.zero_grad()
        return [_full(p).float().tolist() for p in model.parameters()]

    if rank == 0:
        with open(out, "w") as f:
            json.dump([trained(True), trained(False)], f)
    else:
        trained(True), trained(False)


@pytest.mark.slow
def test_torchaos_step_compiled_by_compile_rng_equals_it_run_eagerly(tmp_path):
    """The same rounding bits and the same float32 Adam arithmetic: Inductor's kernel for
    torchao's step gives the eager step's weights bitwise (FSDP2 on 2 ranks, 4 steps)."""
    pytest.importorskip("torchao")
    out = tmp_path / "both.json"
    spawn(_compiled_and_eager, 2, str(out))
    compiled, eager = json.loads(out.read_text())
    assert compiled == eager
