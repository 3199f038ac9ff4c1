"""torchao's bf16 stochastic-rounding AdamW step: torchao's own against the same step inside
``compile_rng.library_compiles(layout="invariant")`` (the one line), in one run.

A stack of bf16 ``nn.Linear`` weights (``--layers`` of ``--dim`` x ``--dim``) on one process,
plain and under FSDP2 on a one-rank gloo group (DTensor parameters, as FSDP2 gives every
rank). After warm-up steps (torchao compiles its per-parameter step; the block compiles it
with compile_rng's backend), the median of ``--repeat`` optimizer steps; the ratio to
torchao's own is the cost of the line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
from torch import nn

import compile_rng


def _model(layers: int, dim: int, fsdp: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(layers)))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if not fsdp else p.detach().clone().normal_()
    return model


def step_time(layers: int, dim: int, fsdp: bool, line: bool, warmup: int, repeat: int) -> float:
    from torchao.optim import _AdamW

    torch._dynamo.reset()
    model = _model(layers, dim, fsdp)
    opt = _AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    block = (lambda: compile_rng.library_compiles(layout="invariant")) if line else contextlib.nullcontext
    times = []
    for i in range(warmup + repeat):
        start = time.perf_counter()
        with block():
            opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torchao _AdamW(bf16_stochastic_round=True) step, {args.layers} bf16 weights of {args.dim}x{args.dim}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeat} steps")
    print(f"  {'parameters':<22}{'torchao (ms)':>14}{'with the line (ms)':>20}{'ratio':>8}")
    for fsdp in (False, True):
        stock = step_time(args.layers, args.dim, fsdp, False, args.warmup, args.repeat)
        line = step_time(args.layers, args.dim, fsdp, True, args.warmup, args.repeat)
        name = "FSDP2 (1 rank)" if fsdp else "plain"
        print(f"  {name:<22}{stock * 1e3:>14.2f}{line * 1e3:>20.2f}{line / stock:>7.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
