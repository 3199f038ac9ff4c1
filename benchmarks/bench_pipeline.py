"""Step time of a 2-stage pipeline (examples/pipeline_parity.py's GPT, 1F1B, 2 gloo
ranks), eager and with compiled blocks, and the per-op cost of naming a random op's stream.

Modes, measured in one run on the same ranks:

* ``names``   - eager stages in ``compile_rng.step(local_batch, names=stages,
  microbatches=n)``: every random op on its named stream (the single process's masks);
* ``tracker`` - compile_rng installed, no step: the stages' eager ops draw from torch's
  generator in schedule order (what compile_rng gives a pipeline without ``names=``);
* ``stock``   - compile_rng uninstalled, eager stages;
* ``names+compile`` - torchtitan's recipe (every block in ``checkpoint_wrapper``, then
  ``block.compile(fullgraph=True)`` with ``compile_rng.backend(layout="invariant",
  batched=True)``) in the named step;
* ``stock+compile`` - compile_rng uninstalled, the same blocks compiled by stock Inductor.

Prints the median step time of each and its ratio to the stock run of its kind (eager or
compiled); the modes take turns step by step, and the compiled modes' first steps (the
compiles) are not timed. Then, in this process, what a plain op (a 4x4 ``addmm``) and a
random op (``dropout`` on 4x4) cost stock, in a step and in a step with ``names=`` (only
random ops reach compile_rng in a step: a plain op's cost is torch's); the cost of naming one op: ``ActivationNames.position`` (module lookup, ordinal, the
seed from its cache) against ``state.advance`` (the step's sequence), and the uncached
SHA-256 of a name (paid once per name and run seed), next to the time one dropout of
``--elements`` elements takes: the key is computed per op, not per element; and, with the
compiled modes, the step time of compiled blocks with ``names=`` against the same step
without (the cost of a compiled graph's key table).

With ``--separate ROUNDS`` each mode runs alone on fresh ranks instead, the modes taking
turns ROUNDS times: what a job that runs one mode sees, without the other modes' state in
its processes (compile_rng installed and uninstalled between steps, their compiled graphs
and memory); the machine's drift between runs then hits the modes unevenly, so take
several rounds.

Run: ``python benchmarks/bench_pipeline.py [--steps 8] [--dim 256] [--elements 1048576]
[--modes names stock ...] [--separate 2]`` (a mode's baseline always runs).
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

MODES = ("names", "tracker", "stock", "names+compile", "stock+compile")


def _baseline(mode: str) -> str:
    return "stock+compile" if mode.endswith("+compile") else "stock"


def _installed_for(mode: str) -> None:
    if mode.startswith("stock"):
        compile_rng.uninstall()
    else:
        compile_rng.install()


def _time_steps(modes: list[str], steps: int, dim: int, microbatches: int) -> dict[str, list[float]]:
    """Seconds per step of each mode, the modes taking turns step by step: the drift of a
    shared machine's speed (several percent within a minute here) hits every mode alike."""
    import dataclasses

    import pipeline_parity as pp

    pp.CONFIG = dataclasses.replace(pp.CONFIG, dim=dim, seq=64, batch=16)
    runs = {}
    for mode in modes:
        _installed_for(mode)
        compiled = mode.endswith("+compile")
        pipe = pp.Pipeline("gpt", "1F1B", "PP=2+AC+compile" if compiled else "PP=2", microbatches,
                           backend="inductor" if mode == "stock+compile" else None)
        runs[mode] = (pipe, torch.optim.AdamW(pipe.parameters(), lr=pp.CONFIG.lr))
    times = {mode: [] for mode in modes}
    torch.manual_seed(pp.SEED)
    try:
        for tokens, targets in pp.global_batches(pp.CONFIG, steps + 2):
            for mode, (pipe, opt) in runs.items():
                _installed_for(mode)
                torch.distributed.barrier()
                start = time.perf_counter()
                pipe.step(tokens, targets, named=mode.startswith("names"))
                opt.step()
                opt.zero_grad()
                torch.distributed.barrier()
                times[mode].append(time.perf_counter() - start)
    finally:
        compile_rng.install()
    return {mode: t[2:] for mode, t in times.items()}  # the first steps infer the stages' shapes (and compile)


def _body(rank: int, world: int, modes: list, steps: int, dim: int, microbatches: int, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on a two-core machine
    results = _time_steps(modes, steps, dim, microbatches)
    if rank == 0:
        torch.save(results, out)


def dispatch_cost(ops: int = 2000, reps: int = 8) -> dict[str, float]:
    """Seconds per plain op (a 4x4 ``addmm``) and per random op (``dropout`` on 4x4): stock,
    in a step, and in a step with ``names=``. Best of ``reps`` interleaved runs: the
    cost, not the machine's noise."""
    x, w = torch.ones(4, 4), torch.ones(4, 4)
    drop = torch.nn.Dropout(0.1)  # the named step's model
    kinds = {"plain op": lambda y: torch.addmm(y, y, w), "random op": drop}
    contexts = {"stock": contextlib.nullcontext, "in a step": lambda: compile_rng.step(4),
                "in a named step": lambda: compile_rng.step(4, names=drop)}

    def run(op) -> float:
        y, start = x, time.perf_counter()
        for _ in range(ops):
            y = op(y)
        return (time.perf_counter() - start) / ops

    best = {f"a {kind}, {where}": float("inf") for kind in kinds for where in contexts}
    for _ in range(reps):
        for where, context in contexts.items():
            with context():
                for kind, op in kinds.items():
                    best[f"a {kind}, {where}"] = min(best[f"a {kind}, {where}"], run(op))
    return best


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


def compiled_naming_cost(blocks: int = 8, steps: int = 30) -> dict[str, float]:
    """Seconds per step of ``blocks`` compiled dropout blocks (forward and backward, one
    process) in a step with ``names=`` against the same step without: what naming a
    compiled graph's draws costs per call (its key table: names resolved, seeds looked up)."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x):
            return x + F.dropout(self.linear(x), 0.1, self.training)

    model = nn.Sequential(*(Block() for _ in range(blocks)))
    backend = compile_rng.backend(layout="invariant", batched=True)
    for block in model:
        block.compile(backend=backend)
    x = torch.randn(16, 64)

    def step(named: bool) -> float:
        start = time.perf_counter()
        with compile_rng.step(16, names=model if named else None):
            model(x).sum().backward()
        return time.perf_counter() - start

    for named in (True, False):  # compile, then warm
        step(named)
    times = {True: [], False: []}
    for _ in range(steps):  # interleaved: drift in the machine's speed hits both alike
        for named in (True, False):
            times[named].append(step(named))
    return {f"{blocks} compiled blocks, names=": statistics.median(times[True]),
            f"{blocks} compiled blocks, no names": statistics.median(times[False])}


def _spawned(modes: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step of each of ``modes``, timed on 2 fresh ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        spawn(_body, 2, modes, args.steps, args.dim, args.microbatches, out)
        return torch.load(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--separate", type=int, default=0, metavar="ROUNDS",
                        help="run each mode alone on its own ranks, the modes taking turns ROUNDS times")
    args = parser.parse_args(argv)
    wanted = set(args.modes) | {_baseline(m) for m in args.modes}
    modes = [m for m in MODES if m in wanted]
    if args.separate:
        results = {mode: [] for mode in modes}
        for _ in range(args.separate):
            for mode in modes:
                results[mode] += _spawned([mode], args)[mode]
        how = f"each mode alone on its own ranks, {args.separate} rounds of {args.steps} steps"
    else:
        results, how = _spawned(modes, args), f"the modes taking turns on the same ranks, {args.steps} steps"
    print(f"2-stage 1F1B pipeline, GPT dim {args.dim}, {args.microbatches} microbatches, median step ({how}):")
    print(f"{'mode':14} {'s/step':>9} {'x stock':>8}  (its kind's stock run)")
    for mode in modes:
        median = statistics.median(results[mode])
        print(f"{mode:14} {median:9.4f} {median / statistics.median(results[_baseline(mode)]):8.2f}")
    print()
    costs = {**dispatch_cost(), **naming_cost(args.elements)}
    print(f"{'per op':34} {'us':>9}")
    for what, seconds in costs.items():
        print(f"{what:34} {seconds * 1e6:9.2f}")
    if not any(m.endswith("+compile") for m in modes):
        return
    print()
    steps = compiled_naming_cost()
    (named, named_s), (plain, plain_s) = steps.items()
    print(f"{'per step (one process)':34} {'ms':>9}")
    print(f"{named:34} {named_s * 1e3:9.3f}  {named_s / plain_s:.3f}x")
    print(f"{plain:34} {plain_s * 1e3:9.3f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
