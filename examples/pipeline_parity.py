"""Pipeline parallelism keeps the loss curve: stages draw the single process's masks.

A GPT with attention, residual and MLP dropout (``train_parity.py``'s blocks) and a
transformers Llama with attention dropout are split into pipeline stages the way
torchtitan splits a model - each stage a module that keeps the unsplit model's names
(layers in a ``ModuleDict`` keyed by their original index) - and trained with
``torch.distributed.pipelining``'s schedules on gloo ranks:

* ``GPipe`` and ``1F1B``: 2 stages on 2 ranks; ``Interleaved1F1B`` and
  ``InterleavedZeroBubble`` (each backward in an input and a weight half): 4 stages, 2 per rank;
* ``PP=2`` (eager), ``+AC`` (every block in ``checkpoint_wrapper``: torchtitan's full AC),
  ``+SAC`` (torchtitan's selective AC: the same wrapper with torch's op-level policy),
  ``+compile`` (every block compiled with ``fullgraph=True`` by
  ``compile_rng.backend(layout="invariant", batched=True)``, after AC as torchtitan does),
  ``+compile(modules)`` (every block replaced by ``torch.compile(block)``, graph breaks
  allowed: ``_orig_mod`` in every name below it), ``+compile(stage)`` (the stage's whole
  module compiled, graph breaks allowed), each with full or selective AC too, on 2 ranks;
  ``PP=2xDP=2`` (FSDP2 inside each stage) and ``PP=2xTP=2`` (the plain
  ``ColwiseParallel()`` / ``RowwiseParallel()`` plan, local outputs), also with AC and
  compile (torchtitan's whole recipe: TP, AC, compile, then FSDP2), on 4 ranks;
* any number of microbatches.

Every step runs in ``compile_rng.step(local_batch, names=stages, microbatches=n)``: each
random op draws from the stream named by its module in the unsplit model, at its rows
of the step's global batch, so a stage needs nothing from the stages before it. The
single process runs the unsplit model in ``compile_rng.step(batch, names=model)``.
Weights come from ``@compile_rng.init(streams="fqn")`` (each stage draws its own layers'
single-process values), and every rank is seeded alike (``seed + pp_rank`` is refused).

Run: ``python examples/pipeline_parity.py [--steps 3] [--only llama/GPipe/PP=2 ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import compile_rng
from compile_rng.launch import progress, spawn

sys.path.insert(0, str(Path(__file__).parent))
from train_parity import Block, Config, Embed, Head, global_batches  # noqa: E402

SEED = 1234
CONFIG = Config(layers=4)  # 4 stages of one block for the interleaved schedule

# --- the models, whole and as stages ---------------------------------------------------


class PipeGPT(nn.Module):
    """``train_parity``'s GPT as torchtitan writes a pipelined model: the parts a stage
    does not hold are ``None``, the blocks a ``ModuleDict`` keyed by their index."""

    def __init__(self, c: Config, blocks: range, first: bool = True, last: bool = True):
        super().__init__()
        self.embed = Embed(c) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(c) for i in blocks})
        self.head = Head(c) if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


@compile_rng.init(layout="invariant", streams="fqn", seed=SEED)
def init_weights(model: nn.Module) -> None:
    """Every parameter from its own named stream: a stage built alone gets the values of
    its layers in the unsplit model."""
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)
        else:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)


def llama(dtype: torch.dtype = torch.float64) -> nn.Module:
    """A transformers Llama (SDPA attention with dropout), 4 decoder layers."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=CONFIG.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONFIG.seq,
        attention_dropout=0.1, use_cache=False, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.train()
    return model


class LlamaLogits(nn.Module):
    """The unsplit Llama returning logits (the single process's model)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.lm_head = model.model, model.lm_head

    def forward(self, tokens):
        return self.lm_head(self.model(input_ids=tokens).last_hidden_state)


class LlamaStage(nn.Module):
    """Decoder layers ``layers`` of a transformers Llama (plus the embedding on the
    first stage, the norm and head on the last), under the unsplit model's names."""

    def __init__(self, whole: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        whole = copy.deepcopy(whole)
        self.model = nn.Module()
        self.model.embed_tokens = whole.model.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): whole.model.layers[i] for i in layers})
        self.model.rotary_emb = whole.model.rotary_emb
        self.model.norm = whole.model.norm if last else None
        self.lm_head = whole.lm_head if last else None
        self.config = whole.config

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.model.rotary_emb(h, position_ids=positions)
        # transformers' own mask, as LlamaModel.forward makes it
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=positions
        )
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        if self.lm_head is None:
            return h
        return self.lm_head(self.model.norm(h))


def whole_model(family: str) -> nn.Module:
    """The unsplit model, initialized on the per-name streams, float64."""
    if family == "gpt":
        model = PipeGPT(CONFIG, range(CONFIG.layers)).to(torch.float64)
        init_weights(model)
        return model
    model = llama()
    init_weights(model)
    return LlamaLogits(model)


def stage_module(family: str, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` (equal numbers of layers), with its layers' values
    in the unsplit model."""
    per = CONFIG.layers // stages
    layers = range(stage * per, (stage + 1) * per)
    first, last = stage == 0, stage == stages - 1
    if family == "gpt":
        module = PipeGPT(CONFIG, layers, first, last).to(torch.float64)
        init_weights(module)  # drawn by name: this stage's layers only
        return module
    whole = llama()
    init_weights(whole)
    return LlamaStage(whole, layers, first, last)


def _block_dict(module: nn.Module) -> nn.ModuleDict:
    return module.blocks if isinstance(module, PipeGPT) else module.model.layers


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    return list(_block_dict(module).children())


def checkpoint_blocks(module: nn.Module) -> None:
    """Full activation checkpointing as torchtitan applies it: each block replaced by its
    ``checkpoint_wrapper`` (which puts ``_checkpoint_wrapped_module`` into every name below)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _block_dict(module)
    for key, block in list(blocks.named_children()):  # a ModuleDict (stages) or ModuleList (whole)
        setattr(blocks, key, checkpoint_wrapper(block))


def selective_checkpoint_blocks(module: nn.Module) -> None:
    """torchtitan's selective (op-level) AC: each block in ``checkpoint_wrapper`` with
    torch's selective checkpoint policy (matmuls saved, the rest - dropout included -
    recomputed in backward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    blocks = _block_dict(module)
    for key, block in list(blocks.named_children()):
        setattr(blocks, key, checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, policy)))


AC = {"full": checkpoint_blocks, "selective": selective_checkpoint_blocks}


@functools.cache
def block_backend():
    """The backend of compiled blocks (one object: Dynamo recompiles a function it
    compiled with another backend object)."""
    return compile_rng.backend(layout="invariant", batched=True)


def compile_parts(module: nn.Module, compiled: str, backend: Any = None, dynamic: bool | None = None) -> None:
    """Compile a stage as ``compiled`` says: ``"blocks"``, torchtitan's per-block compile
    (``block.compile(fullgraph=True)`` in place: no ``_orig_mod`` in a name); ``"modules"``,
    each block replaced by ``torch.compile(block)``, graph breaks allowed (``_orig_mod`` in
    every name below it); ``"stage"``, the whole stage module, graph breaks allowed.
    ``backend``: another than compile_rng's (``"inductor"``: stock torch, for benchmarks);
    ``dynamic``: ``torch.compile``'s (the plain TP plan's local pieces need ``False`` once
    shapes change: compile_rng refuses a draw on a local piece in a graph of symbolic sizes)."""
    options = {"backend": backend or block_backend(), "dynamic": dynamic}
    if compiled == "stage":
        module.compile(**options)
        return
    blocks = _block_dict(module)
    for key, block in list(blocks.named_children()):
        if compiled == "blocks":
            block.compile(fullgraph=True, **options)
        else:
            setattr(blocks, key, torch.compile(block, **options))


# --- parallelisms ----------------------------------------------------------------------


@dataclass(frozen=True)
class Composition:
    pp: int = 2
    dp: int = 1
    tp: int = 1
    ac: str = ""  # "full": every block in checkpoint_wrapper (torchtitan's full AC); "selective": op-level
    # "blocks": each block compiled in place, fullgraph (torchtitan: after AC, before FSDP2);
    # "modules": each block replaced by torch.compile(block); "stage": the whole stage
    compiled: str = ""

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


COMPOSITIONS = {
    "PP=2": Composition(), "PP=2+AC": Composition(ac="full"), "PP=2+SAC": Composition(ac="selective"),
    "PP=2+compile": Composition(compiled="blocks"), "PP=2+AC+compile": Composition(ac="full", compiled="blocks"),
    "PP=2+SAC+compile": Composition(ac="selective", compiled="blocks"),
    "PP=2+compile(modules)": Composition(compiled="modules"),
    "PP=2+AC+compile(modules)": Composition(ac="full", compiled="modules"),
    "PP=2+SAC+compile(modules)": Composition(ac="selective", compiled="modules"),
    "PP=2+compile(stage)": Composition(compiled="stage"), "PP=2+AC+compile(stage)": Composition(ac="full", compiled="stage"),
    "PP=2+SAC+compile(stage)": Composition(ac="selective", compiled="stage"),
    "PP=2xDP=2": Composition(dp=2), "PP=2xTP=2": Composition(tp=2),
    # torchtitan's whole recipe: TP, AC, per-block compile, then FSDP2 - on pipeline stages
    "PP=2xDP=2+AC+compile": Composition(dp=2, ac="full", compiled="blocks"),
    "PP=2xTP=2+compile": Composition(tp=2, compiled="blocks"),
    "PP=2xTP=2+AC+compile": Composition(tp=2, ac="full", compiled="blocks"),
}
# stages per rank; the zero-bubble schedule splits each backward into an input and a
# weight half (``backward_weight_one_chunk``)
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2}
FAMILIES = ("gpt", "llama")


def _tensor_parallel(module: nn.Module, tp_mesh) -> None:
    """torch's TP tutorial plan: ``ColwiseParallel()`` in, ``RowwiseParallel()`` out,
    local outputs (attention runs on this rank's heads as plain tensors)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if isinstance(module, PipeGPT):
        plan = {f"attn.w{p}": ColwiseParallel() for p in "qkv"}
        plan |= {"attn.wo": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    else:
        plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for block in transformer_blocks(module):
        parallelize_module(block, tp_mesh, plan)


def _schedule(name: str, stages: list, microbatches: int):
    from torch.distributed import pipelining

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    cls = getattr(pipelining, f"Schedule{name}")
    if SCHEDULES[name] > 1:  # the multi-stage schedules take this rank's stages
        return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


class Pipeline:
    """This rank's stages of one (family, schedule, composition) job."""

    def __init__(self, family: str, schedule: str, composition: str, microbatches: int, backend: Any = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage

        how = COMPOSITIONS[composition]
        inner = "tp" if how.tp > 1 else "dp"
        mesh = init_device_mesh("cpu", (how.pp, how.dp * how.tp), mesh_dim_names=("pp", inner))
        pp_rank = self.pp_rank = mesh["pp"].get_local_rank()
        per_rank = SCHEDULES[schedule]
        count = how.pp * per_rank
        ids = [pp_rank + k * how.pp for k in range(per_rank)]  # interleaved: loop-style placement
        self.modules = [stage_module(family, i, count) for i in ids]
        self.dp_mesh = mesh["dp"] if how.dp > 1 else None
        self.dp_coord = mesh[inner].get_local_rank() if how.dp > 1 else 0
        self.dp, self.tp = how.dp, how.tp
        if how.compiled:
            # stock torch's rule, compile_rng or not: a zero-bubble schedule runs a compiled
            # backward in two halves (input, then weight gradients, retain_graph=True), which
            # AOTAutograd's donated buffers refuse; set for every job, before the first
            # compile (a graph compiled with them on must not run after)
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
        for module in self.modules:
            if how.tp > 1:
                _tensor_parallel(module, mesh["tp"])
            if how.ac:
                AC[how.ac](module)
            if how.compiled:
                compile_parts(module, how.compiled, backend, dynamic=False if how.tp > 1 else None)
            if how.dp > 1:
                from torch.distributed.fsdp import fully_shard

                for block in transformer_blocks(module):
                    fully_shard(block, mesh=self.dp_mesh)
                fully_shard(module, mesh=self.dp_mesh)
        group = mesh["pp"].get_group()
        self.stages = [PipelineStage(m, i, count, torch.device("cpu"), group=group) for m, i in zip(self.modules, ids)]
        self.has_last = any(s.is_last for s in self.stages)
        self.schedule = _schedule(schedule, self.stages, microbatches)
        self.microbatches = microbatches

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]

    def run_schedule(self, tokens: torch.Tensor, targets: torch.Tensor, losses: list) -> None:
        """One run of the schedule on this rank's stages. The inputs go to the first stage
        only (torch 2.11's shape inference refuses them on another stage's rank; later
        releases ignore them there), contiguous (2.11 checks a microbatch's strides
        against the stage's expected ones)."""
        inputs = (tokens.contiguous(),) if any(s.is_first for s in self.stages) else ()
        self.schedule.step(*inputs, target=targets, losses=losses)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, named: bool = True) -> torch.Tensor:
        """One step on this rank's rows; returns the step's mean loss on the last stage's
        ranks (zero elsewhere). ``named=False``: torch's own generator, as without compile_rng."""
        losses: list[torch.Tensor] = []
        step = compile_rng.step(tokens.shape[0], data_parallel=self.dp_mesh, names=self.stages,
                                microbatches=self.microbatches)
        with step if named else contextlib.nullcontext():
            self.run_schedule(tokens, targets, losses)
        if not self.has_last:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(losses).mean().detach()


def capture_dropped(module: nn.Module, block: str, into: list) -> None:
    """Record, per microbatch, which elements block ``block``'s attention and MLP residual
    dropouts dropped: ``(kind, first row, output == 0)`` in forward and ``(kind, first
    row, gradient == 0)`` at the dropout's input in backward (GPT blocks)."""
    from compile_rng.semantics.rows import current_rows

    def record(kind: str, value: torch.Tensor) -> None:
        rows = current_rows()
        if rows is not None:  # None: the schedule's shape inference, outside any microbatch
            into.append((kind, rows.start, (value == 0).clone()))

    target = module.blocks[block] if block in module.blocks else None
    if target is None:
        return
    def on_gradient(part: str):
        def hook(module, args, out) -> None:  # returns None: the output stays
            if out.requires_grad:  # not in torch 2.11's shape inference, which runs without grad
                out.register_hook(lambda g: record(f"{part} backward", g))

        return hook

    for part, projection in (("attn", target.attn.wo), ("mlp", target.mlp.down)):
        getattr(target, part).register_forward_hook(lambda m, a, out, part=part: record(f"{part} forward", out))
        projection.register_forward_hook(on_gradient(part))


# --- training --------------------------------------------------------------------------


def single_step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, microbatches: int = 1) -> float:
    """One step's forward and backward of the unsplit model on one process, in
    ``compile_rng.step(names=model)``, gradients accumulated over ``microbatches``; the loss."""
    total = torch.zeros((), dtype=torch.float64)
    with compile_rng.step(tokens.shape[0], names=model) as s:
        for rows, labels in zip(tokens.tensor_split(microbatches), targets.tensor_split(microbatches)):
            with s.microbatch(rows.shape[0]):
                logits = model(rows)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) / microbatches
                loss.backward()
            total += loss.detach()
    return total.item()


def train_single(family: str, steps: int, microbatches: int = 1) -> list[float]:
    """The unsplit model on one process: per-step loss (gradient accumulation over
    ``microbatches``)."""
    model = whole_model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG.lr)
    torch.manual_seed(SEED)
    losses = []
    for tokens, targets in global_batches(CONFIG, steps):
        losses.append(single_step(model, tokens, targets, microbatches))
        opt.step()
        opt.zero_grad()
    return losses


def train_pipeline(
    family: str, schedule: str, composition: str, steps: int, microbatches: int = 4, named: bool = True,
    seed_per_stage: bool = False,
) -> list[float]:
    """Per-step global loss of the pipelined job (this rank's part). ``seed_per_stage``:
    torchtitan's seeding (``seed + pp_rank``), with the run's seed declared to compile_rng."""
    pipe = Pipeline(family, schedule, composition, microbatches)
    opt = torch.optim.AdamW(pipe.parameters(), lr=CONFIG.lr)
    if seed_per_stage:
        compile_rng.run_seed(SEED)  # once per run; compile_rng.step(names=) refuses seed + pp_rank without it
        torch.manual_seed(SEED + pipe.pp_rank)
    else:
        torch.manual_seed(SEED)  # every rank alike
    losses = []
    for tokens, targets in global_batches(CONFIG, steps):
        tokens, targets = tokens.chunk(pipe.dp)[pipe.dp_coord], targets.chunk(pipe.dp)[pipe.dp_coord]
        total = pipe.step(tokens, targets, named)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)  # the last stage's ranks hold the loss of their rows
        losses.append(total.item() / (pipe.dp * pipe.tp))
    return losses


def _rank_body(rank: int, world: int, job: tuple, steps: int, microbatches: int, named: bool, out: str) -> None:
    losses = train_pipeline(*job, steps, microbatches, named)
    if rank == 0:
        torch.save(losses, out)


def run(job: tuple[str, str, str], steps: int, microbatches: int = 4, named: bool = True) -> list[float]:
    """``(family, schedule, composition)``'s per-step losses, on its own gloo ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.pt")
        spawn(_rank_body, COMPOSITIONS[job[2]].world, job, steps, microbatches, named, out)
        return torch.load(out)


def max_relative_difference(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def torch_limit(schedule: str, composition: str) -> str | None:
    """Why stock torch itself refuses a cell or cannot give it the single process's curve
    (compile_rng or not, dropout or not), or None."""
    how = COMPOSITIONS[composition]
    if schedule == "InterleavedZeroBubble" and how.ac == "selective" and not how.compiled:
        return ("refused: an eager selective-AC region may be backwarded once only, and a zero-bubble "
                "schedule backwards it twice (input, then weight gradients)")
    if schedule == "InterleavedZeroBubble" and how.compiled == "modules":
        return ("refused: torch's zero-bubble schedules refuse stages that hold a torch.compile(module) "
                "(\"not supported with stage modules that have used torch.compile\"); module.compile() in place runs")
    if schedule == "InterleavedZeroBubble" and how.dp > 1:
        return ("another curve: with FSDP2 in the stages, a zero-bubble schedule's gradients differ from one "
                "process's (8.9e-4 in the loss, torch 2.13 and 2.15) with dropout off and compile_rng "
                "uninstalled too (tests/test_pipeline.py checks that this gap is torch's own)")
    return None


JOBS = [
    (family, schedule, composition)
    for family in FAMILIES
    for schedule in SCHEDULES
    for composition in COMPOSITIONS
    if torch_limit(schedule, composition) is None
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="jobs as family/schedule/composition")
    args = parser.parse_args(argv)
    jobs = [tuple(j.split("/")) for j in args.only] if args.only else JOBS
    references = {}
    print(f"max relative loss difference from the single process, {args.steps} steps, float64, "
          f"{args.microbatches} microbatches:")
    print(f"{'model':6} {'schedule':16} {'composition':12} {'max rel. diff':>14}")
    for family, schedule, composition in jobs:
        if family not in references:
            progress(f"pipeline_parity: {family} single process")
            references[family] = train_single(family, args.steps)
        progress(f"pipeline_parity: {family} {schedule} {composition}")
        curve = run((family, schedule, composition), args.steps, args.microbatches)
        print(f"{family:6} {schedule:16} {composition:12} {max_relative_difference(curve, references[family]):14.2e}",
              flush=True)


if __name__ == "__main__":
    main()
