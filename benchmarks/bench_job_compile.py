"""Cold compile of a 4-rank job on this machine: compile_rng with one compile per job
(ranks queue per graph, the first compiles, the rest load: compile_rng.compiled.job_compile)
vs every rank compiling (``COMPILE_RNG_JOB_COMPILE=0``) vs stock Inductor, in one run.

Each run starts with an empty Inductor cache folder of its own and times, on every rank,
from the first compile to the end of the first compiled step; it prints the job's wall
time (the slowest rank), the Inductor compiles (FX-graph cache misses) summed over ranks,
and each mode's ratio to stock Inductor. Models: the demo's tensor-parallel MLP
(compiled init, forward and backward) and ``examples/train_parity.py``'s GPT under
FSDP2=2 x TP=2 (one optimizer step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from compile_rng.launch import results_dict, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

MODES = ("job", "each", "stock")


def _mlp(world: int, mode: str) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    from compile_rng import demo

    backend = "inductor" if mode == "stock" else "compile_rng"
    model, mesh = demo._build(world)
    torch.manual_seed(demo.SEED)
    torch.compile(demo.init_weights, backend=backend)(model)
    x = distribute_tensor(torch.ones(demo.BATCH, demo.DIM), mesh, [Replicate()])
    torch.compile(model, backend=backend)(x).to_local().sum().backward()


def _gpt(rank: int, mode: str) -> None:
    import train_parity

    # train_parity's stock mode runs with Inductor's caches off (its docstring says why):
    # cold either way here, where every run starts from an empty cache folder
    train_parity.train("FSDP2=2xTP=2", "stock" if mode == "stock" else "invariant", 1, torch.float32, rank=rank)


def run_rank(rank: int, world: int, model: str, mode: str, results: dict) -> None:
    import warnings

    from torch._dynamo.utils import counters

    import compile_rng

    warnings.filterwarnings("ignore")
    if mode == "stock":
        compile_rng.uninstall()
    start = time.perf_counter()
    _mlp(world, mode) if model == "mlp" else _gpt(rank, mode)
    results[rank] = (time.perf_counter() - start, counters["inductor"].get("fxgraph_cache_miss", 0))


def measure(model: str, mode: str, world: int) -> tuple[float, int]:
    """(the slowest rank's seconds, Inductor compiles summed over ranks) of one cold job."""
    os.environ["COMPILE_RNG_JOB_COMPILE"] = "0" if mode == "each" else "1"
    results = results_dict()
    with tempfile.TemporaryDirectory(prefix=f"bench_job_{model}_{mode}_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        spawn(run_rank, world, model, mode, results)
    return max(s for s, _ in results.values()), sum(n for _, n in results.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    print(f"cold compile of a {args.world}-rank job, torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"  {'model':<6}{'mode':<8}{'job wall s':>12}{'compiles':>10}{'vs stock':>10}")
    for model in args.models:
        seconds = {mode: measure(model, mode, args.world) for mode in MODES}
        for mode, (wall, compiles) in seconds.items():
            print(f"  {model:<6}{mode:<8}{wall:>12.1f}{compiles:>10}{wall / seconds['stock'][0]:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
