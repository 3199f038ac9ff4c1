"""Init scaling over ranks: the example model (134M parameters) FSDP-sharded over 1 and
2 gloo ranks, each rank on one thread (2 ranks use the 2 cores one rank leaves idle),
initialized with ``@compile_rng.init`` (``trunc_normal_``, tracker and invariant mode).

Prints each world size's warm per-rank seconds and its ratio to the 1-rank time
(ideal: 1/world), plus eager torch on the unsharded model with one thread for scale;
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compile_rng.launch import progress, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from bench_init import timed  # noqa: E402  (first call, then median of warm calls)


def run_rank(rank: int, world: int, args: argparse.Namespace, results: dict) -> None:
    import warnings

    from llama_init import init_weights, parallel_model
    from torch.distributed.tensor import init_device_mesh

    import compile_rng

    warnings.filterwarnings("ignore", message=".*does not compile as one graph.*")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = parallel_model("fsdp", mesh, args)
    torch.manual_seed(0)
    row = {}
    for mode in ("tracker", "invariant"):
        dist.barrier()
        progress(f"{world} rank(s): timing @compile_rng.init(layout={mode!r}), {args.repeat} repeats")
        row[mode] = timed(compile_rng.init(init_weights, layout=mode), model, args.repeat)[1]
    row["local_params"] = sum(p.to_local().numel() for p in model.parameters())
    results[(world, rank)] = row


def main() -> None:
    from llama_init import BENCH_MODEL_ARGS, add_model_args, build, init_weights

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, BENCH_MODEL_ARGS)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default="bench-init-ranks.json")
    args = parser.parse_args()
    results = mp.Manager().dict()
    for world in args.worlds:
        progress(f"starting {world} gloo rank(s)")
        spawn(run_rank, world, args, results)
    progress("timing eager torch init on one rank")
    torch.set_num_threads(1)
    with torch.no_grad():
        eager = timed(init_weights, build(meta=False, args=args), args.repeat)[1]
    rows = {f"{w}x{r}": v for (w, r), v in sorted(results.items())}
    print(f"\nExample model init, FSDP over gloo ranks, 1 thread per rank (eager torch, 1 rank: {eager:.2f} s)")
    print(f"{'world':>5} {'rank':>4} {'local params':>13} {'tracker':>9} {'vs 1 rank':>9} {'invariant':>10} {'vs 1 rank':>9}")
    for (world, rank), r in sorted(results.items()):
        one = results[(1, 0)] if (1, 0) in results else r
        print(f"{world:>5} {rank:>4} {r['local_params']:>13,} {r['tracker']:>8.2f}s {r['tracker'] / one['tracker']:>9.2f} "
              f"{r['invariant']:>9.2f}s {r['invariant'] / one['invariant']:>9.2f}")
    with open(args.json, "w") as f:
        json.dump({"eager_torch_1_thread_s": eager, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
