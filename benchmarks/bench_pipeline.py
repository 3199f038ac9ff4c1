"""Step time of a 2-stage pipeline (examples/pipeline_parity.py's GPT, 1F1B, eager
stages, 2 gloo ranks) and the per-op cost of naming a random op's stream.

Modes, measured in one run on the same ranks:

* ``names``   - ``compile_rng.step(local_batch, names=stages, microbatches=n)``: every
  random op on its named stream (the single process's masks);
* ``tracker`` - compile_rng installed, no step: the stages' eager ops draw from torch's
  generator in schedule order (what compile_rng gives a pipeline without ``names=``);
* ``stock``   - compile_rng uninstalled.

Prints the median step time of each and its ratio to ``stock``. Then, in this process,
the cost of naming one op: ``ActivationNames.position`` (module lookup, ordinal, the
seed from its cache) against ``state.advance`` (the step's sequence), and the uncached
SHA-256 of a name (paid once per name and run seed), next to the time one dropout of
``--elements`` elements takes: the key is computed per op, not per element.

Run: ``python benchmarks/bench_pipeline.py [--steps 8] [--dim 256] [--elements 1048576]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import compile_rng  # noqa: E402
from compile_rng.launch import spawn  # noqa: E402

MODES = ("names", "tracker", "stock")


def _time_steps(mode: str, steps: int, dim: int, microbatches: int) -> list[float]:
    import dataclasses

    import pipeline_parity as pp

    pp.CONFIG = dataclasses.replace(pp.CONFIG, dim=dim, seq=64, batch=16)
    if mode == "stock":
        compile_rng.uninstall()
    else:
        compile_rng.install()
    try:
        pipe = pp.Pipeline("gpt", "1F1B", "PP=2", microbatches)
        opt = torch.optim.AdamW(pipe.parameters(), lr=pp.CONFIG.lr)
        torch.manual_seed(pp.SEED)
        times = []
        for tokens, targets in pp.global_batches(pp.CONFIG, steps + 2):
            torch.distributed.barrier()
            start = time.perf_counter()
            pipe.step(tokens, targets, named=mode == "names")
            opt.step()
            opt.zero_grad()
            torch.distributed.barrier()
            times.append(time.perf_counter() - start)
        return times[2:]  # the first steps infer the stages' shapes
    finally:
        compile_rng.install()


def _body(rank: int, world: int, steps: int, dim: int, microbatches: int, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on a two-core machine
    results = {mode: _time_steps(mode, steps, dim, microbatches) for mode in MODES}
    if rank == 0:
        torch.save(results, out)


def naming_cost(elements: int) -> dict[str, float]:
    """Seconds per op: naming a draw, reserving it from the sequence, hashing a new name,
    and one dropout of ``elements`` elements on the stream (for scale)."""
    from compile_rng.eager.activation_names import ActivationNames
    from compile_rng.semantics import named_draws
    from compile_rng.stream import state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    names = ActivationNames([model], state.snapshot(), split=False)
    names.enter(model, ())
    names.enter(model[1], ())
    cpu = torch.device("cpu")
    n = 20000
    position = timeit.timeit(lambda: names.position("aten.bernoulli_", 1024, cpu), number=n) / n
    names.ordinals.clear()
    advance = timeit.timeit(lambda: state.advance(1024, cpu), number=n) / n
    fresh = iter(range(10**9))
    hashing = timeit.timeit(lambda: named_draws.activation_seed(7, f"blocks.{next(fresh)}:0:0"), number=n) / n
    drop, rows = torch.nn.Dropout(0.1), torch.ones(elements, 1)
    dropout = []
    for _ in range(6):
        with compile_rng.step(elements, names=drop):
            start = time.perf_counter()
            drop(rows)
            dropout.append(time.perf_counter() - start)
    return {"name a draw (cached seed)": position, "reserve from the sequence": advance,
            "hash a new name (once per name)": hashing, f"dropout of {elements} elements": statistics.median(dropout)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--elements", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        spawn(_body, 2, args.steps, args.dim, args.microbatches, out)
        results = torch.load(out)
    stock = statistics.median(results["stock"])
    print(f"2-stage 1F1B pipeline, GPT dim {args.dim}, {args.microbatches} microbatches, eager stages, "
          f"median of {args.steps} steps:")
    print(f"{'mode':10} {'s/step':>9} {'x stock':>8}")
    for mode in MODES:
        median = statistics.median(results[mode])
        print(f"{mode:10} {median:9.4f} {median / stock:8.2f}")
    print()
    costs = naming_cost(args.elements)
    print(f"{'per op':34} {'us':>9}")
    for what, seconds in costs.items():
        print(f"{what:34} {seconds * 1e6:9.2f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
