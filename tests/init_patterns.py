"""A module tree initialized the way real stacks do it (torchtitan, Megatron, HF):
buffers re-assigned during init, a fused QKV weight drawn into a temporary allocated
from it and copied in, chunks of a fused weight initialized one by one, ``.data``
draws, ``nn.init`` helpers that allocate (``orthogonal_``), nested helper methods, and
a pipeline split that keeps the names (``nn.ModuleDict`` of layers)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, orthogonal: bool = True):
        super().__init__()
        self.orthogonal = orthogonal  # nn.init.orthogonal_ needs a QR, which DTensor lacks
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Parameter(torch.empty(2 * dim, dim))  # fused gate/up
        self.w2 = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("freqs", torch.zeros(dim // 2), persistent=False)

    def _init_linear(self, w: torch.Tensor, std: float) -> None:  # nested helper
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def init_weights(self, std: float) -> None:
        # RoPE-style cache rebuilt on every init: frees the old buffer's tensor.
        self.freqs = 1.0 / (10000 ** (torch.arange(0, self.freqs.numel() * 2, 2).float() / self.freqs.numel()))
        # Fused QKV: a temporary allocated from the weight, drawn, then copied in.
        tmp = self.wqkv.weight.new_empty(self.wqkv.weight.shape)
        tmp.normal_(0.0, 0.02)
        with torch.no_grad():
            self.wqkv.weight.copy_(tmp)
        self._init_linear(self.wo.weight, std)
        for chunk in self.w13.chunk(2, dim=1):  # chunks of a fused weight
            self._init_linear(chunk, 0.02)
        if self.orthogonal:
            nn.init.orthogonal_(self.w2.weight)  # allocates a temporary from the weight
        else:
            self._init_linear(self.w2.weight, std)
        self.w2.bias.data.uniform_(-0.1, 0.1)  # .data draw
        self.norm.reset_parameters()


class Model(nn.Module):
    """``layers`` is a ModuleDict so a pipeline stage keeps the single-device names."""

    def __init__(self, vocab: int = 64, dim: int = 16, n_layers: int = 4, orthogonal: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, orthogonal) for i in range(n_layers)})
        self.out = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        if self.tok is not None:
            nn.init.normal_(self.tok.weight)
        for i, layer in self.layers.items():
            layer.init_weights(0.02 / (2 * (int(i) + 1)) ** 0.5)
        if self.out is not None:
            nn.init.trunc_normal_(self.out.weight, std=0.01, a=-0.03, b=0.03)


def pipeline_stage(stage: int, n_stages: int = 2, n_layers: int = 4) -> Model:
    """The part of :class:`Model` stage ``stage`` holds, torchtitan-style: the other
    stages' layers deleted, names kept."""
    model = Model(n_layers=n_layers)
    per = n_layers // n_stages
    for i in range(n_layers):
        if not stage * per <= i < (stage + 1) * per:
            del model.layers[str(i)]
    if stage != 0:
        model.tok = None
    if stage != n_stages - 1:
        model.out = None
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, as full plain tensors."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone()
    return out


def parallelize(model: Model, config: str, mesh) -> Model:
    """``config`` in ``tp``, ``fsdp``, ``fsdp_tp`` on a ``("dp", "tp")`` mesh, the way
    torchtitan applies its plans (TP first, then FSDP2 per layer and at the root)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if "tp" in config.split("_"):
        tp = mesh["tp"]
        plan = {"tok": RowwiseParallel(input_layouts=Replicate()), "out": ColwiseParallel()}
        for i in model.layers:
            plan.update({f"layers.{i}.wqkv": ColwiseParallel(), f"layers.{i}.wo": RowwiseParallel(),
                         f"layers.{i}.w2": ColwiseParallel()})
        parallelize_module(model, tp, plan)
        for layer in model.layers.values():  # a raw fused parameter, sharded by hand
            w = layer.w13
            local = w.new_empty(w.shape[0] // tp.size(), w.shape[1])
            layer.w13 = nn.Parameter(DTensor.from_local(local, tp, [Shard(0)], run_check=False))
    if "fsdp" in config.split("_"):
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model
