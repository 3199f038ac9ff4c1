"""Sharding-invariant initialization of a Llama-style model on 4 CPU ranks.

Initializes the same small Llama-style model (embedding, attention, SwiGLU MLP, RMS
norms, output head; torchtitan-style ``init_weights`` with ``trunc_normal_``) on one
device and under (a) TP=2, (b) FSDP=2, (c) FSDP=2 x TP=2, (d) two pipeline stages,
each built on the meta device and materialized with ``to_empty``, then gathers the
full weights and compares them with the single-device ones, bitwise:

* ``tracker``: eager DTensor semantics - sharded weights differ from single-device;
* ``invariant``: every element's counter is its global index - identical everywhere
  except across pipeline stages (a stage does not know the earlier stages' counters);
* ``invariant, streams=fqn``: every parameter's stream is derived from its name -
  identical everywhere, pipeline stages included, with no seed checkpoint.

Run: ``python examples/llama_init.py`` (or ``torchrun --nproc-per-node 4 examples/llama_init.py``)
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from compile_rng.launch import progress, results_dict, spawn

WORLD = 4
SEED = 1234


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


def init_weights(model: Transformer) -> None:
    """torchtitan-style init; pipeline stages hold a subset (missing parts are None)."""
    if model.tok_embeddings is not None:
        nn.init.normal_(model.tok_embeddings.weight)
    for i, layer in model.layers.items():
        depth_std = 0.02 / math.sqrt(2 * (int(i) + 1))
        for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        for lin in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=depth_std)
        layer.attention_norm.reset_parameters()
        layer.ffn_norm.reset_parameters()
    if model.norm is not None:
        model.norm.reset_parameters()
    if model.output is not None:
        dim = model.output.weight.shape[1]
        nn.init.trunc_normal_(model.output.weight, std=dim**-0.5, a=-3 * dim**-0.5, b=3 * dim**-0.5)


def build(meta: bool, args: argparse.Namespace) -> Transformer:
    with torch.device("meta" if meta else "cpu"):
        return Transformer(args.vocab, args.dim, args.layers, args.heads, args.hidden)


def tp_plan() -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()}
    for name in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{name}"] = ColwiseParallel()
    plan["layers.*.attention.wo"] = RowwiseParallel()
    plan["layers.*.feed_forward.w1"] = ColwiseParallel()
    plan["layers.*.feed_forward.w3"] = ColwiseParallel()
    plan["layers.*.feed_forward.w2"] = RowwiseParallel()
    return plan


def parallel_model(config: str, mesh, args) -> Transformer:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = build(meta=True, args=args)
    if config == "pp":  # stage r % 2 keeps half the layers, names unchanged
        stage, n = dist.get_rank() % 2, args.layers // 2
        for i in range(args.layers):
            if (i >= n) != bool(stage):
                del model.layers[str(i)]
        if stage == 0:
            model.norm = model.output = None
        else:
            model.tok_embeddings = None
    if config in ("tp", "fsdp_tp"):
        parallelize_module(model, mesh["tp"], tp_plan())
    if config in ("fsdp", "fsdp_tp"):
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    return model


def full_state(model: Transformer) -> dict:
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def run_rank(rank: int, world: int, args: argparse.Namespace, results: dict) -> None:
    import compile_rng
    from torch.distributed.tensor import init_device_mesh

    warnings.filterwarnings("ignore", message=".*does not compile as one graph.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    variants = {
        "tracker": compile_rng.init(init_weights, layout="tracker"),
        "invariant": compile_rng.init(init_weights, layout="invariant"),
        "invariant, streams=fqn": compile_rng.init(init_weights, layout="invariant", streams="fqn"),
    }
    table, timings = {}, {}
    for variant, init in variants.items():
        progress(f"{variant}: single-device init, then TP, FSDP, FSDP x TP and 2 pipeline stages")
        torch.manual_seed(SEED)
        single = build(meta=False, args=args)
        start = time.perf_counter()
        init(single)
        timings[variant] = time.perf_counter() - start
        reference = full_state(single)
        for config in ("tp", "fsdp", "fsdp_tp", "pp"):
            model = parallel_model(config, mesh, args)
            torch.manual_seed(SEED)
            init(model)
            state = full_state(model)
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, state)
            merged = {k: v for g in gathered for k, v in g.items()}  # PP: union of both stages
            same = sorted(merged) == sorted(reference) and all(torch.equal(merged[k], reference[k]) for k in reference)
            table[(variant, config)] = same
    if rank == 0:
        results["table"] = table
        results["timings"] = timings
        results["params"] = sum(p.numel() for p in build(meta=True, args=args).parameters())


def run(args: argparse.Namespace) -> dict:
    """Spawn the 4 ranks; returns rank 0's results (table, timings, parameter count)."""
    progress(f"starting {WORLD} gloo ranks")
    results = results_dict()
    if not spawn(run_rank, WORLD, args, results):
        return {}  # another torchrun rank: rank 0 reports
    return dict(results)


#: The model's size arguments and the example's (small) defaults.
MODEL_ARGS = {"vocab": 256, "dim": 64, "layers": 4, "heads": 4, "hidden": 192}
#: The size the benchmarks use: 134M parameters.
BENCH_MODEL_ARGS = {"vocab": 32000, "dim": 768, "layers": 12, "heads": 12, "hidden": 2048}


def add_model_args(parser: argparse.ArgumentParser, defaults: dict[str, int] = MODEL_ARGS) -> None:
    """``--vocab --dim --layers --heads --hidden`` (what :func:`build` reads)."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    return parser.parse_args(argv)


def main() -> None:
    results = run(parse_args())
    if not results:
        return
    configs = {"tp": "TP=2", "fsdp": "FSDP=2", "fsdp_tp": "FSDP=2 x TP=2", "pp": "PP=2 stages"}
    print(f"Llama-style model, {results['params']:,} parameters, {WORLD} gloo ranks; "
          "full weights vs single-device init, bitwise:")
    print(f"  {'mode':<22}" + "".join(f"{c:>16}" for c in configs.values()))
    for variant in ("tracker", "invariant", "invariant, streams=fqn"):
        cells = ["identical" if results["table"][(variant, c)] else "differs" for c in configs]
        print(f"  {variant:<22}" + "".join(f"{c:>16}" for c in cells))
    print("  single-device init time: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in results["timings"].items()))
    ok = all(results["table"][("invariant, streams=fqn", c)] for c in configs) and all(
        results["table"][("invariant", c)] for c in ("tp", "fsdp", "fsdp_tp")
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
