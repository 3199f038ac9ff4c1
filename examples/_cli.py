"""The command line the parity examples share: one script is both the table a person runs
and the ranks (or single processes) it launches to train each configuration."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def rank_or_table(
    doc: str, switch: str, runs_help: str, rank: Callable[..., None], table: Callable[[], None], **options: str | None
) -> None:
    """Parse the command line of the example whose module docstring is ``doc``. With
    ``switch`` (a JSON list of runs) this process is one rank of a launch, or its one
    process: ``rank(runs, **options)`` trains them, then the process ends through
    :func:`compile_rng.launch.end_of_rank`. Without it, ``table()`` launches the runs and
    prints the table. ``options``: the other options the rank reads (``out="..."`` is
    ``--out``), each with its default."""
    from compile_rng.launch import end_of_rank

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument(switch, help=runs_help)
    for name, default in options.items():
        parser.add_argument(f"--{name}", default=default)
    a = parser.parse_args()
    runs = getattr(a, switch.lstrip("-"))
    if not runs:
        table()
        return
    rank(runs, **{name: getattr(a, name) for name in options})
    end_of_rank()  # a DDP rank: gloo's threads can abort the interpreter's teardown


def launch(script: str, ranks: int, args: list[str], out: str) -> object:
    """Run ``script args`` in a fresh process - ``torchrun --standalone`` for more than one
    rank - one thread per rank, transformers quiet, and return the JSON it wrote to ``out``."""
    import json
    import os
    import subprocess
    import sys

    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run([*launcher, os.path.abspath(script), *args, "--out", out], check=True, env=env)
    with open(out) as f:
        return json.load(f)
