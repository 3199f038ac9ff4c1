"""Init's first call in a fresh process: eager torch vs ``@compile_rng.init`` per ``compile=``.

Init runs once per job, so its first call is what users wait for. Each row is a fresh
process (no Dynamo, Inductor or kernel cache in memory; Inductor's on-disk cache as the
machine has it) that builds the model and imports Dynamo (not timed: torch's ``nn.init``
imports it on first use, a training script anyway), then times the first and a second
call of one init:

* ``llama``: the examples' Llama-style ``init_weights`` (``trunc_normal_`` on matrices);
* ``torchtitan-style``: torchtitan's pattern - per-module ``init_weights`` helper methods,
  the RoPE buffer rebuilt under ``with torch.device(...)``, a fused QKV weight
  initialized chunk by chunk, norms reset.

Cases: eager torch (torch's generator), ``compile_rng.init(compile=False)`` (eager on the
stream), ``compile="auto"`` (tries one graph, falls back to eager) and, for the normal_-only
variant that does compile as one graph, ``compile=True``. Ratios are against eager torch
in the same run.

    python benchmarks/bench_init_first.py [--dim 768 --layers 12 ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from bench_init import init_normal  # noqa: E402  (the Llama init with normal_: one graph)
from llama_init import BENCH_MODEL_ARGS, add_model_args, build, init_weights  # noqa: E402


class TitanAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)  # fused QKV
        self.wo = nn.Linear(dim, dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for chunk in self.wqkv.weight.chunk(3, dim=0):
            nn.init.trunc_normal_(chunk, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TitanBlock(nn.Module):
    def __init__(self, layer_id: int, dim: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.attention, self.feed_forward = TitanAttention(dim), TitanFeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class TitanStyle(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim, self.max_seq = dim // heads, 2048
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(i, dim, hidden, layers) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        freqs = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2)[: self.head_dim // 2].float() / self.head_dim))
        t = torch.arange(self.max_seq, device=freqs.device)
        return torch.polar(torch.ones(self.max_seq, freqs.numel()), torch.outer(t, freqs).float())

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = self.output.weight.shape[1] ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std, a=-3 * final_out_std, b=3 * final_out_std)


INITS = {
    "llama": (lambda args: build(meta=False, args=args), init_weights),
    "torchtitan-style": (
        lambda args: TitanStyle(args.vocab, args.dim, args.layers, args.heads, args.hidden),
        lambda model: model.init_weights(),
    ),
    "llama normal_": (lambda args: build(meta=False, args=args), init_normal),
}
CASES = {
    "eager torch": None,
    "compile=False": False,
    "compile='auto'": "auto",
    "compile=True": True,
}


def one(args: argparse.Namespace) -> dict:
    """This process: build, then time the first and second call of one init/case."""
    import torch._dynamo  # noqa: F401  (a training script imports it anyway; torch's nn.init
    # imports it on first use, compile_rng.init when decorating: kept out of every timing)

    make, fn = INITS[args.init]
    model = make(args)
    torch.manual_seed(0)
    compile_arg = CASES[args.case]
    import compile_rng  # (imported already, by the examples' helpers)

    if compile_arg is None:
        compile_rng.uninstall()  # stock torch: its own trunc_normal_ and generator
    else:
        warnings.filterwarnings("ignore", message=".*does not compile as one graph.*")
        fn = compile_rng.init(fn, compile=compile_arg)
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            fn(model)
            times.append(time.perf_counter() - start)
    return {"first_s": times[0], "second_s": times[1], "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, BENCH_MODEL_ARGS)
    parser.add_argument("--init", choices=list(INITS), help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--json", default="bench-init-first.json")
    args = parser.parse_args()
    if args.init is not None:
        print(json.dumps(one(args)))
        return
    model_args = [f"--{k}={getattr(args, k)}" for k in BENCH_MODEL_ARGS]
    rows = {}
    for init in INITS:
        for case, compile_arg in CASES.items():
            if compile_arg is True and init != "llama normal_":
                continue  # trunc_normal_ reads values: no single graph (compile=True raises)
            out = subprocess.run(
                [sys.executable, __file__, "--init", init, "--case", case, *model_args],
                capture_output=True, text=True, check=True,
            )
            rows[(init, case)] = json.loads(out.stdout.strip().splitlines()[-1])
    params = {init: rows[(init, "eager torch")]["params"] for init in INITS}
    print(f"Init first call in a fresh process ({torch.get_num_threads()} threads); ratio = eager torch / case")
    print(f"{'init':<25}{'case':<16}{'first call':>11}{'second':>9}{'first vs eager':>16}")
    for (init, case), r in rows.items():
        base = rows[(init, "eager torch")]["first_s"]
        print(f"{init + f' ({params[init] / 1e6:.0f}M)':<25}{case:<16}{r['first_s']:>10.2f}s{r['second_s']:>8.2f}s"
              f"{base / r['first_s']:>15.2f}x")
    with open(args.json, "w") as f:
        json.dump({f"{i} | {c}": r for (i, c), r in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
