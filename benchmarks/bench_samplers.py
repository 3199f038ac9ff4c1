"""Samplers inside a stream against torch's own, in the same run: ns/element and the ratio.

For each sampler compile_rng draws from counters (``randperm``, ``multinomial`` with and
without replacement, ``poisson`` below and above rate 10, ``binomial`` by inversion and by
BTRS, ``_standard_gamma`` below and above 1, ``_sample_dirichlet``): torch eager outside any
stream, then the same call inside ``eager_stream()`` (compile_rng's counter-based form).
One thread and all threads; the best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import compile_rng
from compile_rng.eager.dispatch_modes import eager_stream


def cases(n: int) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    """name -> (the call, its elements)."""
    rows = max(1, n // 1000)
    probs = torch.rand(rows, 1000) + 0.01
    return {
        "randperm": (lambda: torch.randperm(n), n),
        "multinomial, replacement": (lambda: torch.multinomial(probs, 1000, replacement=True), rows * 1000),
        "multinomial, 100 of 1000": (lambda: torch.multinomial(probs, 100), rows * 1000),
        "poisson, rate 3": (lambda: torch.poisson(torch.full((n,), 3.0)), n),
        "poisson, rate 300": (lambda: torch.poisson(torch.full((n,), 300.0)), n),
        "binomial, n p = 4": (lambda: torch.binomial(torch.full((n,), 20.0), torch.full((n,), 0.2)), n),
        "binomial, n p = 400": (lambda: torch.binomial(torch.full((n,), 2000.0), torch.full((n,), 0.2)), n),
        "gamma, alpha 0.5": (lambda: torch._standard_gamma(torch.full((n,), 0.5)), n),
        "gamma, alpha 4": (lambda: torch._standard_gamma(torch.full((n,), 4.0)), n),
        "dirichlet, 10 categories": (lambda: torch._sample_dirichlet(torch.full((n // 10, 10), 2.0)), n),
    }


def best(fn: Callable[[], torch.Tensor], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 20, help="elements per call")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    compile_rng.manual_seed(0)
    print(f"samplers, {args.size} elements a call, torch {torch.__version__}, ns/element (best of {args.repeat})")
    print(f"{'threads':>7}  {'sampler':28} {'torch eager':>12} {'compile_rng':>12} {'ratio':>7}")
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        for name, (fn, elements) in cases(args.size).items():
            stock = best(fn, args.repeat)
            with eager_stream():
                mine = best(fn, args.repeat)
            print(f"{threads:>7}  {name:28} {stock / elements * 1e9:12.2f} {mine / elements * 1e9:12.2f} "
                  f"{mine / stock:6.2f}x")


if __name__ == "__main__":
    main()
