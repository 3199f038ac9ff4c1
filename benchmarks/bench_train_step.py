"""Training-step time and backward memory of examples/train_parity.py's GPT: compile_rng
(invariant, tracker) vs stock Inductor and eager torch.

One process. Each part of the model (embedding, every block, head) is compiled on its
own, as in the example: with ``compile_rng.backend(layout="invariant", batched=True)``
inside ``compile_rng.step`` (invariant), with ``backend="compile_rng"`` (tracker), and
with stock Inductor (compile_rng uninstalled); "eager" is stock torch uncompiled, and
"eager-step" the same model uncompiled inside ``compile_rng.step`` (invariant values on
the eager path: only random ops reach compile_rng; the per-op cost is its difference from
"eager" over the aten ops a forward + backward runs, and a plain op's and a dropout's
cost in a step are measured on their own). After
warm-up steps (compilation), the median of ``--repeat`` timed forward + backward + AdamW
steps, for each ``--threads`` count; prints seconds per step and the ratio to stock
Inductor from the same run, and the bytes the forward saves for backward (measured with
``saved_tensors_hooks``: stock torch saves dropout masks, compile_rng regenerates them);
writes JSON. Prints the instruction sets in use: compile_rng's CPU kernel build
(``COMPILE_RNG_CPU_ISA`` forces one), ATen's CPU capability and Inductor's vector ISA;
``--baseline-isa avx2`` forces torch's side (``ATEN_CPU_CAPABILITY``), so with
``COMPILE_RNG_CPU_ISA=avx2`` an AVX-512 machine measures what an AVX2-only one runs.
``--modes`` measures a subset. Then ``bench_random_ops.py``'s table: a random op outside
any stream in a process that never imported compile_rng, after a step, after
``uninstall()``, the GIL stall of a background draw in each, and the op inside a step
(``--no-random-ops`` leaves it out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_random import BASELINE_ISAS, torch_isas  # noqa: E402  (its import sets ATEN_CPU_CAPABILITY first)
import bench_random_ops  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import compile_rng  # noqa: E402
from compile_rng.stream import cpu_kernel  # noqa: E402
from compile_rng.launch import progress  # noqa: E402
from train_parity import MODES, Config, _backend, make_model  # noqa: E402

ALL_MODES = (*MODES, "eager", "eager-step")


def _saved_bytes() -> tuple[Any, list[int]]:
    """A ``saved_tensors_hooks`` context that sums the distinct storages saved for backward."""
    seen: dict[int, int] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
            total[0] += storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def step_times(mode: str, c: Config, warmup: int, repeat: int) -> tuple[list[float], int]:
    """Seconds of the timed steps, and the bytes the last step's forward saved."""
    torch._dynamo.reset()
    compile_rng.install() if mode not in ("stock", "eager") else compile_rng.uninstall()
    try:
        model = make_model(c, torch.float32)
        if mode not in ("eager", "eager-step"):
            backend = _backend(mode)  # one backend for every part: Dynamo recompiles on a new one
            for part in model.compiled_parts():
                part.compile(backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=c.lr)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)
        tokens, targets = data[:, :-1], data[:, 1:]
        times = []
        for i in range(warmup + repeat):
            start = time.perf_counter()
            step = compile_rng.step(c.batch) if mode in ("invariant", "eager-step") else contextlib.nullcontext()
            hooks, saved = _saved_bytes() if i == warmup + repeat - 1 else (contextlib.nullcontext(), [0])
            with step:
                with hooks:
                    loss = F.cross_entropy(model(tokens).reshape(-1, c.vocab), targets.reshape(-1))
                loss.backward()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return times, saved[0]
    finally:
        compile_rng.install()


def aten_ops_per_step(c: Config) -> int:
    """The aten ops one eager forward + backward of the model dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    model = make_model(c, torch.float32)
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq + 1))
    with Count():
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, c.vocab), tokens[:, 1:].reshape(-1)).backward()
    return Count.n


def per_op_costs(reps: int = 3000) -> dict[str, float]:
    """Microseconds per call of a small plain aten op (``addmm`` 4x16 @ 16x16) and of a small
    random op (``dropout`` on 4x16), outside a step (stock) and inside ``compile_rng.step(4)``,
    interleaved in one run: what a step adds to every op, and to a random one."""
    a, b, bias = torch.randn(4, 16), torch.randn(16, 16), torch.randn(16)
    ops = {"plain": lambda: torch.addmm(bias, a, b), "random": lambda: F.dropout(a, 0.1)}

    def timed(fn) -> float:
        for _ in range(200):
            fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6

    costs: dict[str, list[float]] = {}
    for _ in range(3):  # interleaved rounds, the best of each: the machine's noise is one-sided
        for kind, fn in ops.items():
            costs.setdefault(f"{kind} stock", []).append(timed(fn))
            with compile_rng.step(a.shape[0]):
                costs.setdefault(f"{kind} in a step", []).append(timed(fn))
    return {name: min(values) for name, values in costs.items()}


def step_overhead(step: dict, eager: dict, ops: int) -> str:
    """What a step adds to the eager run (rows with ``median_s`` and ``min_s``): a cost
    per aten op, a saving, or within noise - the two runs' own spread (median - min),
    which a smaller difference either way does not exceed."""
    extra = step["median_s"] - eager["median_s"]
    noise = (step["median_s"] - step["min_s"]) + (eager["median_s"] - eager["min_s"])
    if abs(extra) <= noise:
        return f"within noise ({extra * 1e3:+.2f} ms/step against a spread of {noise * 1e3:.2f} ms)"
    return f"{abs(extra) / ops * 1e6:.1f} us per aten op {'more' if extra > 0 else 'less'} than eager"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--no-random-ops", action="store_true",
                        help="leave out bench_random_ops.py's table (a fresh process per column, ~1 min)")
    parser.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(ALL_MODES),
                        help="modes to measure (stock is always measured: the ratios need it)")
    parser.add_argument("--baseline-isa", choices=BASELINE_ISAS,
                        help="force eager torch (ATen) and Inductor to this instruction set (ATEN_CPU_CAPABILITY, "
                             "set before torch starts)")
    args = parser.parse_args(argv)
    modes = [m for m in ALL_MODES if m in args.modes or m == "stock"]
    c = Config(vocab=512, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq, batch=args.batch)
    rows = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mode in modes:
            progress(f"bench_train_step: {mode}, {threads} thread(s)")
            times, saved = step_times(mode, c, args.warmup, args.repeat)
            rows[f"{threads}/{mode}"] = {
                "threads": threads, "mode": mode, "median_s": statistics.median(times), "min_s": min(times),
                "saved_for_backward_bytes": saved,
            }
    isas = torch_isas()
    print(f"training step, GPT dim={c.dim} layers={c.layers} seq={c.seq} batch={c.batch}, "
          f"dropout p={c.p} everywhere, torch {torch.__version__}")
    print(f"  instruction sets: compile_rng CPU kernel {cpu_kernel.isa()}, eager ATen {isas['eager']}, "
          f"Inductor C++ {isas['inductor']}"
          + (f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})" if os.environ.get("ATEN_CPU_CAPABILITY") else ""))
    print(f"  {'threads':<8}{'mode':<12}{'median s/step':>15}{'min s/step':>13}{'vs stock':>10}{'saved for bw':>15}")
    for r in rows.values():
        r["vs_stock"] = r["median_s"] / rows[f"{r['threads']}/stock"]["median_s"]
        print(f"  {r['threads']:<8}{r['mode']:<12}{r['median_s']:>15.4f}{r['min_s']:>13.4f}{r['vs_stock']:>9.3f}x"
              f"{r['saved_for_backward_bytes'] / 2**20:>12.1f} MiB")
    ops = aten_ops_per_step(c)
    for threads in args.threads:
        if {f"{threads}/eager-step", f"{threads}/eager"} <= set(rows):
            step, eager = rows[f"{threads}/eager-step"], rows[f"{threads}/eager"]
            print(f"  eager code inside compile_rng.step, {threads} thread(s): {step_overhead(step, eager, ops)} "
                  f"({ops} aten ops per forward + backward)")
    costs = per_op_costs() if "eager-step" in modes else {}
    if costs:
        print(f"  per op, 1 thread's caller: plain addmm {costs['plain stock']:.2f} us stock, "
              f"{costs['plain in a step']:.2f} us in a step ({costs['plain in a step'] - costs['plain stock']:+.2f}); "
              f"dropout {costs['random stock']:.2f} us stock, {costs['random in a step']:.2f} us in a step "
              f"({costs['random in a step'] / costs['random stock']:.1f}x)")
    random_ops = None
    if not args.no_random_ops:  # outside a stream (never imported, after a step, uninstalled), GIL, inside
        progress("bench_train_step: random ops outside and inside a stream (bench_random_ops.py)")
        random_ops = bench_random_ops.measure("cpu")
        print(bench_random_ops.table(random_ops, "cpu"))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": c.__dict__, "rows": rows, "aten_ops": ops, "per_op_us": costs, "random_ops": random_ops,
             "isas": {"compile_rng": cpu_kernel.isa(), **isas}}, indent=1))


if __name__ == "__main__":
    main()
