"""A random op's cost outside and inside a stream, against a process that never imported
compile_rng, in one run.

Each column runs in a fresh process: ``stock`` never imports compile_rng; ``after a step``
imports it and runs one ``compile_rng.step`` first (its random-op kernels are registered
then, and stay); ``after uninstall`` runs a step, then ``compile_rng.uninstall()``; ``in a
step`` times the op inside a step (at the step's rows: shapes with the batch as dim 0).
For each small op, microseconds per call (the best of ``--rounds`` timed loops); then how
long a background thread's ``torch.randn(2**25)`` stalls the main thread in each process
(the longest gap between the main thread's loop iterations while it runs), and the time of
``uninstall()`` plus an empty step, then of an empty step after that.

``--device cuda``: the same on the GPU, host time per call (each loop waits for the
device at its end). ``bench_train_step.py`` and ``bench_gpu.py --host`` print this table
too (:func:`measure` and :func:`table`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, threading, time
import torch
mode, reps, rounds, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
x, y = torch.ones(4, 4, device=device), torch.ones(4, 4, device=device)
p, mean, std = torch.full((4, 4), 0.5, device=device), torch.zeros(4, 4, device=device), torch.ones(4, 4, device=device)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
OPS = {
    "rand(4, 4)": lambda: torch.rand(4, 4, device=device), "randn(4, 4)": lambda: torch.randn(4, 4, device=device),
    "randint(0, 9, (4,))": lambda: torch.randint(0, 9, (4,), device=device),
    "randperm(16)": lambda: torch.randperm(16, device=device),
    "uniform_ 4x4": lambda: x.uniform_(), "bernoulli_ 4x4": lambda: y.bernoulli_(0.5),
    "dropout 4x4": lambda: torch.nn.functional.dropout(x, 0.5),
    "bernoulli(p) 4x4": lambda: torch.bernoulli(p), "normal(mean, std) 4x4": lambda: torch.normal(mean, std),
}
out = {"ops": {}}
step = None
if mode != "stock":
    import compile_rng
    with compile_rng.step(4):
        torch.nn.functional.dropout(x, 0.5)
    if mode == "after uninstall":
        start = time.perf_counter()
        compile_rng.uninstall()
        with compile_rng.step(4):
            pass
        out["uninstall and an empty step (ms)"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        with compile_rng.step(4):
            pass
        out["the next empty step (ms)"] = (time.perf_counter() - start) * 1e3
    if mode == "in a step":
        step = compile_rng.step(4)
        step.__enter__()

def timed(fn):
    best = float("inf")
    for _ in range(rounds):
        for _ in range(200):
            fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best

for name, fn in OPS.items():
    if mode == "in a step" and name == "randperm(16)":
        continue
    out["ops"][name] = timed(fn)
if step is not None:
    step.__exit__(None, None, None)
else:
    done = threading.Event()
    def background():
        torch.randn(2**25, device=device)
        sync()
        done.set()
    worker = threading.Thread(target=background)
    longest = 0.0
    start = last = time.perf_counter()
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    out["background randn(2**25): main thread stalled (ms)"] = longest * 1e3
    out["background randn(2**25): its time (ms)"] = (time.perf_counter() - start) * 1e3
print(json.dumps(out))
"""

MODES = ("stock", "after a step", "after uninstall", "in a step")
STALL = "background randn(2**25): main thread stalled (ms)"


def measure(device: str = "cpu", reps: int = 3000, rounds: int = 5) -> dict:
    """Every column's results (a fresh process each): mode -> {"ops": {op: us per call}, ...}."""
    results = {}
    for mode in MODES:
        run = subprocess.run([sys.executable, "-c", CHILD, mode, str(reps), str(rounds), device],
                             capture_output=True, text=True, check=True)
        results[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    return results


def table(results: dict, device: str = "cpu") -> str:
    """The results of :func:`measure` as the table the benches print."""
    import torch

    stock = results["stock"]["ops"]
    lines = [f"random ops on {device}, host us per call (best of several loops), torch {torch.__version__}, "
             "1 process per column; in a step: x stock"]
    lines.append(f"  {'op':<22}" + "".join(f"{m:>17}" for m in MODES) + f"{'step - stock':>15}{'in a step':>11}")
    for op, base in stock.items():
        cells = [results[m]["ops"].get(op) for m in MODES]
        after, inside = results["after a step"]["ops"][op], results["in a step"]["ops"].get(op)
        lines.append(f"  {op:<22}" + "".join(f"{c:>17.2f}" if c is not None else f"{'-':>17}" for c in cells)
                     + f"{after - base:>+15.2f}" + (f"{inside / base:>10.1f}x" if inside is not None else f"{'-':>11}"))
    for key in (STALL, "background randn(2**25): its time (ms)"):
        lines.append(f"  {key:<52}" + "".join(f"{results[m][key]:>10.1f}" for m in MODES[:3]))
    after = results["after uninstall"]
    lines.append(f"  uninstall() and an empty step: {after['uninstall and an empty step (ms)']:.1f} ms; "
                 f"the next empty step: {after['the next empty step (ms)']:.2f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    results = measure(args.device, args.reps, args.rounds)
    print(table(results, args.device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
