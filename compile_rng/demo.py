"""compile_rng demo: SPMD random numbers in a compiled tensor-parallel model on CPU ranks.

Starts WORLD gloo ranks (torch.multiprocessing). Every rank:

1. builds a small MLP on the meta device, tensor-parallelizes it (Colwise up-projection,
   Rowwise down-projection), materializes it, and initializes it with a *compiled*
   ``reset_parameters`` loop (``backend="compile_rng"``);
2. runs a compiled forward with dropout on the sharded hidden activation and on the
   replicated output, then a backward.

The ranks then compare what they hold: sharded weights and activation masks must
differ across ranks, replicated tensors must be bitwise equal, everything must equal
an eager run (compile_rng is DTensor's RNG tracker on CPU, so eager is defined too) and
the local shards must equal the canonical stream at the tracker offsets. Stock PyTorch
2.13 on a CPU mesh gives every shard the same values.

Run: ``python -m compile_rng demo [--world 4]`` (or ``python examples/demo.py``), or
``torchrun --nproc-per-node 4 examples/demo.py`` (the ranks torchrun starts).
``explain_target`` builds the same model on one process (a fake 4-rank process group)
for ``python -m compile_rng explain compile_rng.demo:explain_target``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from compile_rng.launch import progress, reporting, results_dict, spawn, torchrun_world

SEED = 2026
HIDDEN, DIM, BATCH = 64, 16, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.up(x)), p=0.25)  # h is sharded over the hidden dim
        return F.dropout(self.down(h), p=0.1)  # the output is replicated


def init_weights(model: nn.Module) -> None:
    for module in (model.up, model.down):
        module.reset_parameters()  # kaiming_uniform_ / uniform_ on DTensor parameters


def _build(world: int):
    from torch.distributed.tensor import Shard, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = MLP()
    plan = {
        "up": ColwiseParallel(use_local_output=False),  # keep h a DTensor: its dropout is sharded
        "down": RowwiseParallel(input_layouts=Shard(-1), use_local_output=False),
    }
    model = parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    return model, mesh


def _same_randomness(compiled: tuple, eager: tuple) -> bool:
    """Weights bitwise; output and gradient: the same dropout zeros and values within
    float tolerance (Inductor's matmuls sum in another order than eager's)."""
    w_c, out_c, grad_c, state_c = compiled
    w_e, out_e, grad_e, state_e = eager
    same_zeros = torch.equal(out_c == 0, out_e == 0) and torch.equal(grad_c == 0, grad_e == 0)
    close = torch.allclose(out_c, out_e, atol=1e-5) and torch.allclose(grad_c, grad_e, atol=1e-5)
    return torch.equal(w_c, w_e) and same_zeros and close and state_c == state_e


def run_rank(rank: int, world: int, results: dict) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    import compile_rng
    from compile_rng import ops

    def train_step(model, init, forward, mesh):
        torch.manual_seed(SEED)  # the habit on every rank; it also restarts compile_rng's stream
        init(model)
        x = distribute_tensor(torch.ones(BATCH, DIM), mesh, [Replicate()])
        out = forward(x)
        out.to_local().sum().backward()
        weight = model.up.weight.to_local().detach().clone()
        grad = model.up.weight.grad.to_local().clone()
        return weight, out.to_local().detach(), grad, compile_rng.get_state()

    progress(f"{world} ranks up; building the tensor-parallel MLP on each")
    start = time.perf_counter()
    model, mesh = _build(world)
    progress("compiling and running init, forward and backward with backend='compile_rng' (Inductor) ...")
    compiled = train_step(
        model, torch.compile(init_weights, backend="compile_rng"), torch.compile(model, backend="compile_rng"), mesh
    )
    elapsed = time.perf_counter() - start
    progress(f"compiled step done in {elapsed:.0f} s; running the same step eagerly for comparison")
    eager_model, _ = _build(world)
    eager = train_step(eager_model, init_weights, eager_model, mesh)
    progress("comparing what the ranks hold")

    # The canonical stream at this rank's tracker offset for up.weight: Colwise shards rows.
    w = compiled[0]
    rows = HIDDEN // world
    key = ops.make_key(SEED, ((rank * rows * DIM) + 3) // 4 * 4)
    bound = 1 / DIM**0.5  # kaiming_uniform_(a=sqrt(5)) on fan_in=DIM
    want_w = ops.uniform(key, 0, [rows, DIM], [DIM, 1], -bound, bound, torch.float32)

    gathered = [None] * world
    dist.all_gather_object(gathered, (compiled[0], compiled[1], compiled[2]))
    if rank == 0:
        weights, outs, grads = zip(*gathered)
        distinct = lambda ts: all(not torch.equal(ts[i], ts[j]) for i in range(world) for j in range(i + 1, world))  # noqa: E731
        results.update(
            weights_sharded_distinct=distinct(weights),
            hidden_masks_distinct=distinct(grads),
            outputs_replicated_equal=all(torch.equal(outs[0], o) for o in outs[1:]),
            compiled_equals_eager=_same_randomness(compiled, eager),
            weight_equals_stream=torch.equal(w, want_w),
            state=compiled[3],
            seconds=elapsed,
        )


def explain_target(world: int = 4):
    """``(forward, (x,))`` of the demo model as rank 0 of a fake ``world``-rank group
    (no communication): what ``python -m compile_rng explain`` reports on."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from compile_rng._torch.distributed_internals import fake_store

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world, store=fake_store())
    model, mesh = _build(world)
    torch.manual_seed(SEED)
    x = distribute_tensor(torch.ones(BATCH, DIM), mesh, [Replicate()])
    return model, (x,)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="number of CPU ranks (divides 64)")
    args = parser.parse_args(argv)
    args.world = torchrun_world() or args.world
    if reporting():
        print(f"compile_rng demo: {args.world} gloo ranks, tensor-parallel MLP, torch {torch.__version__}")
        print("compiling init and forward/backward on every rank (Inductor; ~1-2 min on 2 cores)", flush=True)
    progress(f"starting {args.world} gloo ranks")
    results = results_dict()
    if not spawn(run_rank, args.world, results):
        return  # another torchrun rank: rank 0 reports
    rows = [
        ("sharded weight (up.weight) differs on every rank", results["weights_sharded_distinct"]),
        ("sharded hidden dropout masks differ on every rank", results["hidden_masks_distinct"]),
        ("replicated output (incl. dropout) equal on all ranks", results["outputs_replicated_equal"]),
        ("compiled == eager (weights bitwise, same masks, state)", results["compiled_equals_eager"]),
        ("rank 0's up.weight == canonical stream at its offset", results["weight_equals_stream"]),
    ]
    width = max(len(r[0]) for r in rows)
    for name, ok in rows:
        print(f"  {name:<{width}}  {'OK' if ok else 'FAILED'}")
    print(f"  state after one step (seed, offset): {results['state']}")
    print(f"  build + compile + run on rank 0: {results['seconds']:.1f} s")
    if not all(ok for _, ok in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
