"""Training-step time of examples/train_parity.py's GPT: invariant vs tracker vs stock.

One process. Each part of the model (embedding, every block, head) is compiled on its
own, as in the example: with ``compile_rng.backend(layout="invariant", batched=True)``
inside ``compile_rng.step`` (invariant), with ``backend="compile_rng"`` (tracker), and
with stock Inductor (compile_rng uninstalled). After warm-up steps (compilation), the
median of ``--repeat`` timed forward + backward + AdamW steps; prints seconds per step
and the ratio to stock Inductor from the same run; writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import compile_rng  # noqa: E402
from compile_rng.launch import progress  # noqa: E402
from train_parity import MODES, Config, _backend, make_model  # noqa: E402


def step_times(mode: str, c: Config, warmup: int, repeat: int) -> list[float]:
    torch._dynamo.reset()
    compile_rng.install() if mode != "stock" else compile_rng.uninstall()
    try:
        model = make_model(c, torch.float32)
        for part in model.compiled_parts():
            part.compile(backend=_backend(mode))
        opt = torch.optim.AdamW(model.parameters(), lr=c.lr)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)
        tokens, targets = data[:, :-1], data[:, 1:]
        times = []
        for i in range(warmup + repeat):
            start = time.perf_counter()
            step = compile_rng.step(c.batch) if mode == "invariant" else contextlib.nullcontext()
            with step:
                loss = F.cross_entropy(model(tokens).reshape(-1, c.vocab), targets.reshape(-1))
                loss.backward()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return times
    finally:
        compile_rng.install()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    c = Config(vocab=512, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq, batch=args.batch)
    rows = {}
    for mode in MODES:
        progress(f"bench_train_step: {mode}")
        times = step_times(mode, c, args.warmup, args.repeat)
        rows[mode] = {"median_s": statistics.median(times), "min_s": min(times)}
    stock = rows["stock"]["median_s"]
    print(f"training step, GPT dim={c.dim} layers={c.layers} seq={c.seq} batch={c.batch}, "
          f"dropout p={c.p} everywhere, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"  {'mode':<12}{'median s/step':>15}{'min s/step':>13}{'vs stock':>10}")
    for mode, r in rows.items():
        r["vs_stock"] = r["median_s"] / stock
        print(f"  {mode:<12}{r['median_s']:>15.4f}{r['min_s']:>13.4f}{r['vs_stock']:>9.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": c.__dict__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
