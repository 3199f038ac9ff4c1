"""Load check: initialize a >= 1B-parameter model sharded over 2 CPU ranks (FSDP) in
invariant mode and report each rank's peak RSS against its local shard bytes.

Not part of the default test run (it needs ~6 GB of RAM and a minute): run it with
``make load`` or ``python benchmarks/load_init.py``. It exits non-zero if a rank's peak
RSS exceeds ``1.3 x local shard bytes + fixed overhead``, where the fixed overhead is
the rank's RSS just before the parameters are allocated (interpreter, torch, process
group), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

from compile_rng.launch import progress, spawn


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(rank: int, world: int, args: argparse.Namespace, results: dict) -> None:
    import compile_rng
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.ModuleList(nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers))
    for layer in model:
        fully_shard(layer, mesh=mesh)

    @compile_rng.init(layout="invariant")
    def init_weights(m: nn.ModuleList) -> None:
        for layer in m:
            nn.init.normal_(layer.weight, std=0.02)

    overhead = _rss_bytes()
    model.to_empty(device="cpu")
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    torch.manual_seed(0)
    progress(f"initializing {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters on {world} ranks")
    start = time.perf_counter()
    init_weights(model)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    results[rank] = {
        "params_total": sum(p.numel() for p in model.parameters()),
        "local_shard_bytes": local_bytes,
        "fixed_overhead_bytes": overhead,
        "peak_rss_bytes": peak,
        "peak_over_shard_plus_overhead": (peak - overhead) / local_bytes,
        "init_seconds": seconds,
        "compiled": init_weights.compiled(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=16)  # 16 x 8192^2 = 1.07B parameters
    parser.add_argument("--json", default="load-init.json")
    args = parser.parse_args()
    results = mp.Manager().dict()
    progress("starting 2 gloo ranks")
    spawn(run_rank, 2, args, results)
    results = dict(results)
    gib = 2**30
    ok = True
    for rank, r in sorted(results.items()):
        limit = 1.3 * r["local_shard_bytes"] + r["fixed_overhead_bytes"]
        ok &= r["peak_rss_bytes"] <= limit
        print(
            f"rank {rank}: {r['params_total'] / 1e9:.2f}B params, local shard {r['local_shard_bytes'] / gib:.2f} GiB, "
            f"fixed overhead {r['fixed_overhead_bytes'] / gib:.2f} GiB, peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB "
            f"= overhead + {r['peak_over_shard_plus_overhead']:.3f} x shard (limit 1.3), "
            f"init {r['init_seconds']:.1f} s ({'compiled' if r['compiled'] else 'eager'})"
        )
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
