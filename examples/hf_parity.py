"""Same loss curve on model code nobody here wrote: Hugging Face ``transformers`` models.

GPT-2 (embedding, attention and residual dropout, SDPA) and Llama (SDPA attention
dropout, GQA, RoPE) are built from small configs (no weights), in float64, parallelized,
initialized on the stream (``@compile_rng.init(layout="invariant")``: each rank draws its
shard of the single device's weights), and train with AdamW on a fixed synthetic global batch, with ``compile_rng.step`` around each
optimizer step and ``compile_rng.backend(layout="invariant", batched=True)`` where
something is compiled. Each configuration is a parallelism and a way of compiling:

* ``whole``: ``model.compile(backend=...)`` - Dynamo splits the model where it cannot
  trace (FSDP2's hooks, transformers' Python) and runs those parts eagerly;
* ``layers``: each decoder layer compiled on its own (the torchtitan pattern);
* ``eager``: not compiled at all.

Every configuration's per-step loss is compared with one process running the same
model compiled the same way; the table is the largest relative difference over the
steps (compiled and eager code draw the same random numbers, but Inductor rounds
differently from eager, which AdamW amplifies to ~1e-10 in three steps).

Run: ``python examples/hf_parity.py [--steps 3] [--only gpt2/DDP=2/whole ...]``; one
configuration on torchrun's ranks: ``torchrun --nproc-per-node 2 examples/hf_parity.py
--only gpt2/DDP=2/whole`` (its world size must be torchrun's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import compile_rng
from compile_rng.launch import progress, reporting, spawn, torchrun_world

SEED = 4321
DATA_SEED = 7
BATCH, SEQ, VOCAB = 8, 16, 96
LR = 3e-3


def build(family: str) -> nn.Module:
    """The model in float64 (its weights are drawn again by :func:`init_weights`)."""
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0,
        )
        cls = transformers.GPT2LMHeadModel
    elif family == "llama":
        config = transformers.LlamaConfig(
            # 70 MLP features: FSDP2 x TP=2x2 shards them 18/17 rows per piece (uneven _StridedShard)
            vocab_size=VOCAB, hidden_size=32, intermediate_size=70, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            attention_dropout=0.1, use_cache=False, bos_token_id=0, eos_token_id=0,
        )
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown model family {family!r}")
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float64)
    model.train()
    return model


@compile_rng.init(layout="invariant", seed=SEED)
def init_weights(model: nn.Module) -> None:
    """torchtitan-style init on the stream, after parallelizing: every rank draws its own
    shard of the single device's weights (uneven FSDP2 x TP pieces included)."""
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)
        else:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)


def layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@dataclass(frozen=True)
class Parallelism:
    world: int
    dp: int = 1
    tp: int = 1
    micro: int = 1
    wrapper: str | None = None  # "ddp" or "fsdp"


PARALLELISMS = {
    "single": Parallelism(1),
    "accum=2": Parallelism(1, micro=2),
    "DDP=2": Parallelism(2, dp=2, wrapper="ddp"),
    "FSDP2=2": Parallelism(2, dp=2, wrapper="fsdp"),
    "TP=2": Parallelism(2, tp=2),
    "FSDP2xTP=2x2": Parallelism(4, dp=2, tp=2, wrapper="fsdp"),
}
COMPILES = ("whole", "layers", "eager")

#: (family, parallelism, compile) configurations the table runs by default.
CONFIGS = [
    ("gpt2", "DDP=2", "whole"),
    ("gpt2", "FSDP2=2", "whole"),
    ("gpt2", "FSDP2=2", "layers"),
    ("gpt2", "accum=2", "whole"),
    ("llama", "DDP=2", "eager"),
    ("llama", "FSDP2=2", "layers"),
    ("llama", "accum=2", "eager"),
    ("llama", "TP=2", "layers"),
    ("llama", "TP=2", "whole"),
    ("llama", "TP=2", "eager"),
    ("llama", "FSDP2xTP=2x2", "layers"),
]


def _tensor_parallel(model: nn.Module, tp_mesh: object) -> None:
    """The plain plan of torch's TP tutorial and transformers' own TP classes (Llama):
    ``ColwiseParallel()`` on q/k/v/gate/up, ``RowwiseParallel()`` on o/down, default
    (local) outputs - attention runs on this rank's heads as plain tensors."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
             "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in layers(model):
        parallelize_module(layer, tp_mesh, plan)


def _parallelize(model: nn.Module, how: Parallelism) -> tuple[nn.Module, object, int]:
    """``(model to call, data-parallel mesh or None, this rank's dp coordinate)``."""
    if how.world == 1:
        return model, None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (how.dp, how.tp), mesh_dim_names=("dp", "tp"))
    if how.tp > 1:
        _tensor_parallel(model, mesh["tp"])
    if how.wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in layers(model):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif how.wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    return model, (mesh["dp"] if how.dp > 1 else None), mesh["dp"].get_local_rank()


def _compile(model: nn.Module, compile: str) -> nn.Module:
    backend = compile_rng.backend(layout="invariant", batched=True)
    if compile == "layers":
        for layer in layers(model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model):
            layer.compile(backend=backend)
    elif compile == "whole":
        model.compile(backend=backend)
    return model


def global_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    return list(torch.randint(0, VOCAB, (steps, BATCH, SEQ), generator=g))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next token, in the logits' dtype (transformers' own
    ``labels=`` loss casts the logits to float32, which would hide float64 parity)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(family: str, parallelism: str, compile: str, steps: int) -> list[float]:
    """Per-step global loss of ``steps`` AdamW steps (this rank's part of the job)."""
    torch._dynamo.reset()
    how = PARALLELISMS[parallelism]
    model, dp_mesh, dp_coord = _parallelize(build(family), how)
    init_weights(model)
    model = _compile(model, compile)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    torch.manual_seed(SEED)  # every rank: the same stream position at step 0
    losses = []
    for tokens in global_batches(steps):
        tokens = tokens.chunk(how.dp)[dp_coord]
        total = torch.zeros((), dtype=torch.float64)
        with compile_rng.step(tokens.shape[0], data_parallel=dp_mesh) as step:
            for rows in tokens.chunk(how.micro):
                with step.microbatch(rows.shape[0]) if how.micro > 1 else contextlib.nullcontext():
                    loss = next_token_loss(model(input_ids=rows).logits, rows) / how.micro
                    loss.backward()
                total += loss.detach()
        opt.step()
        opt.zero_grad()
        if how.world > 1:
            dist.all_reduce(total)
            total /= how.dp * how.tp  # tp replicas hold the same loss: the mean over dp ranks
        losses.append(total.item())
    return losses


def _rank_body(rank: int, world: int, configs: list, steps: int, out: str) -> None:
    curves = {}
    for config in configs:
        progress(f"hf_parity: {'/'.join(config)}")
        try:
            curves[config] = train(*config, steps)
        except Exception as e:  # name the configuration in spawn's report
            raise RuntimeError(f"hf_parity {'/'.join(config)} failed on rank {rank}: {e}") from e
    if rank == 0:
        torch.save(curves, out)


def run_many(configs: list[tuple[str, str, str]], steps: int) -> dict[tuple, list[float]]:
    """Losses of each configuration: one process runs those of world 1, and one set of gloo
    ranks per world size runs the others one after another (the ranks' imports and process
    group serve them all; each configuration resets Dynamo and builds its own meshes).
    Empty on torchrun's ranks other than 0."""
    curves: dict[tuple, list[float]] = {}
    for world in sorted({PARALLELISMS[c[1]].world for c in configs}):
        group = [c for c in configs if PARALLELISMS[c[1]].world == world]
        if world == 1:
            curves.update((c, train(*c, steps)) for c in group)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "losses.pt")
            if spawn(_rank_body, world, group, steps, out):
                curves.update(torch.load(out))
    return curves


def max_relative_difference(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="configurations as family/parallelism/compile")
    args = parser.parse_args(argv)
    configs = [tuple(c.split("/")) for c in args.only] if args.only else CONFIGS
    launched = torchrun_world()
    if launched is not None:
        configs = [c for c in configs if PARALLELISMS[c[1]].world == launched]
    print_ = print if reporting() else (lambda *a, **k: None)
    print_(f"max relative loss difference from one process compiled alike, {args.steps} steps, float64:")
    print_(f"  {'model':<6} {'parallelism':<12} {'compile':<7} {'difference':>10}")
    references = {(f, c): train(f, "single", c, args.steps) for f, c in dict.fromkeys((f, c) for f, _, c in configs)}
    curves = run_many(configs, args.steps)
    for family, parallelism, compile in configs:
        if (family, parallelism, compile) in curves:
            diff = max_relative_difference(curves[family, parallelism, compile], references[family, compile])
            print_(f"  {family:<6} {parallelism:<12} {compile:<7} {diff:10.2e}", flush=True)
    for family, compile in references:
        if compile != "eager" and (family, "eager") in references:
            gap = max_relative_difference(references[family, compile], references[family, "eager"])
            print_(f"  one process, {family} {compile} vs eager: {gap:.2e} (Inductor's float rounding)")


if __name__ == "__main__":
    sys.exit(main())
