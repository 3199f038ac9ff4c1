"""Start-up cost: ``import compile_rng`` and ``python -m compile_rng --help`` against
``import torch``, each in fresh interpreters, interleaved, measured in the same run.

Prints the median wall time of each and the ratios (issue target: import <= 1.3x torch,
``--help`` < 1.5 s).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "import torch": ["-c", "import torch"],
    "import compile_rng": ["-c", "import compile_rng"],
    "import torch + DTensor": ["-c", "import torch.distributed.tensor"],
    "import compile_rng + DTensor": ["-c", "import compile_rng, torch.distributed.tensor"],
    "python -m compile_rng --help": ["-m", "compile_rng", "--help"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    for argv in CASES.values():  # warm the OS file cache once
        subprocess.run([sys.executable, *argv], check=True, capture_output=True)
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for i in range(args.repeat):
        print(f"round {i + 1}/{args.repeat}", file=sys.stderr, flush=True)
        for name, argv in CASES.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], check=True, capture_output=True)
            samples[name].append(time.perf_counter() - start)
    torch_s = statistics.median(samples["import torch"])
    print(f"{'case':<32} {'median':>8} {'vs import torch':>16}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:<32} {median:>7.2f}s {median / torch_s:>15.2f}x")


if __name__ == "__main__":
    main()
