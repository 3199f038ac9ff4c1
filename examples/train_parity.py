"""Same loss curve under any parallelism: a small GPT trained with dropout everywhere.

A GPT-style model (token + position embedding, pre-norm blocks with
``F.scaled_dot_product_attention`` and attention dropout, residual and MLP dropout, LM
head) trains with AdamW on a fixed synthetic global batch: on one process, under DDP=2,
FSDP2=2, TP=2 with sequence parallelism, FSDP2=2 x TP=2 (4 gloo ranks), and on one
process with 2 microbatches of gradient accumulation. Each block is compiled on its own
(the torchtitan pattern). The table is every step's loss difference from the
single-process run, for three random-number set-ups:

* ``invariant``: ``compile_rng.backend(layout="invariant", batched=True)`` and one
  ``compile_rng.step`` per optimizer step (microbatches through ``step.microbatch``);
* ``tracker``: ``backend="compile_rng"`` - eager DTensor semantics, the activations'
  counters follow the program and the local shapes;
* ``stock``: torch's own ``torch.compile`` (compile_rng uninstalled).

Run: ``python examples/train_parity.py [--steps 20] [--dtype float64]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import compile_rng
from compile_rng.launch import progress, spawn

SEED = 1234
DATA_SEED = 99


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16
    batch: int = 8  # global batch (rows)
    p: float = 0.1  # every dropout: attention probabilities, residual, MLP, embedding
    lr: float = 3e-3


# --- the model ---------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.p = c.p

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return F.dropout(self.tok(tokens) + self.pos(positions), self.p, self.training)


def causal_mask(q: torch.Tensor) -> torch.Tensor:
    """``is_causal=True`` as an explicit mask: on DTensor heads torch's math attention
    would add a plain-tensor mask to DTensor scores, so the mask is a replicated DTensor."""
    s = q.shape[-2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if isinstance(q, DTensor):
        mask = DTensor.from_local(mask, q.device_mesh, [Replicate()] * q.device_mesh.ndim)
    return mask


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.dim, c.dim, bias=False) for _ in range(4))
        self.head_dim, self.p = c.dim // c.heads, c.p

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        p = self.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q), dropout_p=p)
        return F.dropout(self.wo(out.transpose(1, 2).reshape(b, s, -1)), self.p, self.training)


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.up, self.down = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)
        self.p = c.p

    def forward(self, x):
        return F.dropout(self.down(F.dropout(F.gelu(self.up(x)), self.p, self.training)), self.p, self.training)


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(c.dim), Attention(c)
        self.norm2, self.mlp = nn.LayerNorm(c.dim), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(c.dim), nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class GPT(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed = Embed(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.head = Head(c)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def compiled_parts(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]


def make_model(c: Config, dtype: torch.dtype) -> GPT:
    """The same weights on every process (torch's own init from a fixed seed)."""
    torch.manual_seed(SEED)
    return GPT(c).to(dtype)


def global_batches(c: Config, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic (tokens, targets) of the whole global batch, one per step."""
    g = torch.Generator().manual_seed(DATA_SEED)
    data = torch.randint(0, c.vocab, (steps, c.batch, c.seq + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


# --- parallelisms ------------------------------------------------------------------

PARALLELISMS = {
    # name: (world size, data-parallel ranks, tensor-parallel ranks, microbatches, wrapper)
    "single": (1, 1, 1, 1, None),
    "accum=2": (1, 1, 1, 2, None),
    "DDP=2": (2, 2, 1, 1, "ddp"),
    "FSDP2=2": (2, 2, 1, 1, "fsdp"),
    "TP=2+SP": (2, 1, 2, 1, None),
    "FSDP2=2xTP=2": (4, 2, 2, 1, "fsdp"),
}


def _tensor_parallel(model: GPT, tp_mesh) -> None:
    """Megatron-style TP with sequence parallelism: the residual stream is sharded on the
    sequence dim; attention runs on DTensor heads (``use_local_output=False``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    col = lambda: ColwiseParallel(input_layouts=Shard(1), use_local_output=False)  # noqa: E731
    parallelize_module(model.embed, tp_mesh, {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(use_local_output=False),
            "attn.wq": col(), "attn.wk": col(), "attn.wv": col(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "norm2": SequenceParallel(use_local_output=False),
            "mlp.up": col(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    parallelize_module(model.head, tp_mesh, {
        "norm": SequenceParallel(use_local_output=False),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })


def parallelize(model: GPT, name: str, rank: int, backend=None) -> tuple[nn.Module, object, int]:
    """Apply ``name``'s parallelism, compiling each part with ``backend`` (if given) first;
    returns (model to call, dp mesh or None, this rank's dp coordinate)."""
    world, dp, tp, _, wrapper = PARALLELISMS[name]
    for part in model.compiled_parts() if backend is not None else ():
        part.compile(backend=backend)
    if world == 1:
        return model, None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        _tensor_parallel(model, mesh["tp"])
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for part in model.compiled_parts():
            fully_shard(part, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    dp_mesh = mesh["dp"] if dp > 1 else None
    return model, dp_mesh, mesh["dp"].get_local_rank()


# --- training ----------------------------------------------------------------------

MODES = ("invariant", "tracker", "stock")


def _backend(mode: str):
    if mode == "invariant":
        return compile_rng.backend(layout="invariant", batched=True)
    if mode == "tracker":
        return compile_rng.backend()
    return "inductor"


@contextlib.contextmanager
def _stock_caches_off(on: bool):
    """Stock Inductor's FX-graph / AOTAutograd caches hand a process a graph compiled in
    another one with that process's process-group *names* baked into its collectives
    (seen here on the 2-D mesh: "Could not resolve the process group registered under
    the name 4"; pytorch #188390 is the same class of bug). compile_rng keys its DTensor
    graphs' AOTAutograd entries per rank and groups; the stock baseline runs uncached."""
    if not on:
        yield
        return
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def train(name: str, mode: str, steps: int, dtype: torch.dtype, c: Config = Config(), rank: int = 0) -> list[float]:
    """Per-step global loss of ``steps`` AdamW steps under ``name`` and ``mode``."""
    torch._dynamo.reset()
    if mode == "stock":
        compile_rng.uninstall()
    else:
        compile_rng.install()
    try:
        with warnings.catch_warnings(), _stock_caches_off(mode == "stock"):
            # stock DTensor on a CPU mesh warns at every random op that its support is incomplete
            warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
            return _train(name, mode, steps, dtype, c, rank)
    finally:
        compile_rng.install()


def _train(name, mode, steps, dtype, c, rank):
    world, dp, tp, micro, _ = PARALLELISMS[name]
    model, dp_mesh, dp_coord = parallelize(make_model(c, dtype), name, rank, _backend(mode))
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr)
    torch.manual_seed(SEED)  # every rank, every set-up: the same stream position at step 0
    losses = []
    for tokens, targets in global_batches(c, steps):
        tokens, targets = tokens.chunk(dp)[dp_coord], targets.chunk(dp)[dp_coord]
        step = compile_rng.step(tokens.shape[0], data_parallel=dp_mesh) if mode == "invariant" else None
        with step if step is not None else contextlib.nullcontext() as s:
            total = torch.zeros((), dtype=dtype)
            for mb_tokens, mb_targets in zip(tokens.chunk(micro), targets.chunk(micro)):
                with s.microbatch(mb_tokens.shape[0]) if s is not None and micro > 1 else contextlib.nullcontext():
                    logits = model(mb_tokens)
                    loss = F.cross_entropy(logits.reshape(-1, c.vocab), mb_targets.reshape(-1)) / micro
                    loss.backward()
                total += loss.detach()
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(total)
            total /= world  # tp replicas hold the same loss: the mean over dp ranks
        losses.append(total.item())
    return losses


# --- the table ---------------------------------------------------------------------


def _rank_body(rank: int, world: int, name: str, steps: int, dtype_name: str, out: str) -> None:
    results = {mode: train(name, mode, steps, getattr(torch, dtype_name), rank=rank) for mode in MODES}
    if rank == 0:
        torch.save(results, out)


def run(name: str, steps: int, dtype_name: str) -> dict[str, list[float]]:
    """``{mode: losses}`` of one parallelism, on its own gloo ranks (or this process)."""
    world = PARALLELISMS[name][0]
    if world == 1:
        return {mode: train(name, mode, steps, getattr(torch, dtype_name)) for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.pt")
        spawn(_rank_body, world, name, steps, dtype_name, out)
        return torch.load(out)


def relative_differences(curve: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(curve, reference)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--only", nargs="*", default=list(PARALLELISMS), help="parallelisms to run")
    args = parser.parse_args(argv)
    results = {}
    for name in ["single", *[n for n in args.only if n != "single"]]:
        progress(f"train_parity: {name}, {args.steps} steps, {args.dtype}")
        results[name] = run(name, args.steps, args.dtype)
    reference = results["single"]
    print(f"max relative loss difference from the single process over {args.steps} steps ({args.dtype}):")
    print(f"  {'parallelism':<16}" + "".join(f"{m:>14}" for m in MODES))
    for name, curves in results.items():
        if name == "single":
            continue
        row = [max(relative_differences(curves[m], reference[m])) for m in MODES]
        print(f"  {name:<16}" + "".join(f"{v:>14.2e}" for v in row))
    print(f"single-process loss, invariant: first {reference['invariant'][0]:.6f}, "
          f"last {reference['invariant'][-1]:.6f}")


if __name__ == "__main__":
    sys.exit(main())
