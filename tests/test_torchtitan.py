"""torchtitan's own llama3, parallelized by torchtitan's own code, initialized under
``@compile_rng.init(layout="invariant", streams="fqn", seed=...)``: every full weight is
bitwise the single device's.

The model is torchtitan 0.3.0's ``Llama3Model`` (tiny: dim 64, 4 layers, vocab 256; CPU
SDPA as inner attention), built on the meta device; its own ``init_weights`` runs after
``to_empty``, as torchtitan's trainer does. The reference is one process with the plain
model (no AC, no compile, no parallelism). On real gloo ranks, with torchtitan's seeding
(``set_determinism``: ``seed + pp_rank``) and its own ``parallelize_llama``:

* PP=2 (2 ranks): ``pipeline_llm``'s split (a copy per stage, the other layers deleted),
  each stage with full AC (``checkpoint_wrapper``: ``_checkpoint_wrapped_module`` in the
  module paths), every block compiled in place, FSDP2 on the 1-rank data mesh;
* FSDP2=2 (2 ranks): full AC and per-block compile;
* FSDP2=2 x TP=2 (4 ranks): compile on, AC off. TP + AC + compile together fails in
  torch 2.13 itself at the first compiled forward/backward (AOTAutograd's
  ``save_from_forward``: "expected all tensors_saved_with_vc_check to be Tensors", a
  DeviceMesh among them; torchtitan alone, without compile_rng), so that combination
  is left out.

Full weights: DTensors gathered with ``full_tensor()``, pipeline stages' parameters put
together, all under the names a ``torch.distributed.checkpoint`` state dict gives them
(DCP's rule: no ``_checkpoint_wrapped_module``), compared with
``torch.equal``. The init runs no forward, so the compiled blocks are never traced here;
what compile (in place) and AC change for an init is the module tree and its names.

The comparison can fail: the same PP=2 run initialized the torchtitan way, without
``@compile_rng.init`` (every drawn weight differs), and one with per-name streams but
without ``seed=`` (stages then derive their streams from ``seed + pp_rank``: the second
stage's drawn weights differ, the first stage's do not) differ from the reference.
Run with ``-s`` to see how many parameters differ in each configuration.

Resuming (the last test): torchtitan's own DCP ``CheckpointManager`` with
``compile_rng.StreamState()`` in its ``states`` saves the stream at step 3 of 6; new
processes load it and train steps 4-6 with the uninterrupted run's losses, bitwise (a
llama3 with residual dropout added by hooks, in ``compile_rng.step``; the control leaves
the stream out and differs).

torchtitan on CPU/gloo needs: ``parallel_dims.device_type = "cpu"`` (it defaults to
"cuda" on a machine without an accelerator) and ``spmd_backend="partial_dtensor"``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compile_rng
from compile_rng.launch import spawn

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow

SEED = 42
DIM, LAYERS, HEADS, VOCAB = 64, 4, 4, 256


def model_config(n_layers: int = LAYERS):
    """A tiny torchtitan llama3 (its own layer builder and init settings) with CPU SDPA."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    layers = _build_llama3_layers(
        n_layers=n_layers, dim=DIM, n_heads=HEADS, hidden_dim=4 * DIM,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
        attn_backend="flex", fuse_qkv=True,
    )
    for layer in layers:  # flex attention needs block masks; SDPA (causal) runs on CPU as is
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
    )


def titan_init(model) -> None:
    """torchtitan's trainer: ``init_weights`` on the materialized model (or stage)."""
    with torch.no_grad():
        model.init_weights(buffer_device=None)


INITS = {
    "compile_rng": compile_rng.init(layout="invariant", streams="fqn", seed=SEED)(titan_init),
    "compile_rng, no seed=": compile_rng.init(layout="invariant", streams="fqn")(titan_init),
    "torchtitan's own": titan_init,
}


def single_device() -> dict[str, torch.Tensor]:
    """The reference: the plain model on one process."""
    with torch.device("meta"):
        model = model_config().build()
    model.to_empty(device="cpu")
    INITS["compile_rng"](model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _full_weights(parts) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model parts, full, under the name a
    ``torch.distributed.checkpoint`` state dict gives it (DCP's own rule, ``_get_fqns``).
    Parameters, not the state dict: torchtitan's state-dict hooks present the fused
    ``wqkv`` as ``wq``/``wk``/``wv``."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out = {}
    for part in parts:
        for path, p in part.named_parameters():
            (name,) = _get_fqns(part, path)
            assert "_checkpoint_wrapped_module" not in name, name
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _has_ac(part) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in part.modules())


def _configuration(rank: int, world: int, *, pp: int, tp: int, ac: bool, init: str, folder: str) -> dict:
    """torchtitan's recipe on these ranks: its meshes and seeding, the meta model, the
    pipeline split (``pp > 1``) or ``parallelize_llama`` (TP, AC, per-block compile,
    FSDP2), ``to_empty``, then the init; returns this rank's full weights."""
    from dataclasses import dataclass

    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    parallelism = ParallelismConfig(
        data_parallel_shard_degree=-1, tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
        spmd_backend="partial_dtensor", pipeline_parallel_schedule="1F1B", pipeline_parallel_microbatch_size=1,
        pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0,
    )
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend("partial_dtensor")
    dist_utils.set_determinism(parallel_dims, torch.device("cpu"), DebugConfig(seed=SEED), distinct_seed_mesh_dims=["pp"])

    cfg = model_config()

    @dataclass
    class _JobConfig:  # update_from_config reads .parallelism (TP fills the sharding config)
        parallelism: ParallelismConfig

    cfg.update_from_config(config=_JobConfig(parallelism))
    with torch.device("meta"):
        model = cfg.build()
    kwargs = dict(
        parallel_dims=parallel_dims, parallelism=parallelism, dump_folder=folder,
        training=TrainingConfig(local_batch_size=2, seq_len=16, mixed_precision_param="float32"),
        compile_config=CompileConfig(enable=True, components=["model"]),
        ac_config=FullAC.Config() if ac else None,
    )
    if pp > 1:
        def loss_fn(pred, labels):  # torchtitan 0.3.0's convention: (loss, aux)
            return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1)), None

        _, parts, _, _ = pipeline_llm(model, **kwargs, device=torch.device("cpu"), model_config=cfg,
                                      parallelize_fn=parallelize_llama, loss_fn=loss_fn)
    else:
        parts = [parallelize_llama(model, **kwargs)]
    assert all(_has_ac(part) == ac for part in parts)
    assert all(block._compiled_call_impl is not None for part in parts for block in part.layers.values())
    for part in parts:
        part.to_empty(device="cpu")
        INITS[init](part)
    return _full_weights(parts)


def _body(rank: int, world: int, configurations: dict, folder: str) -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" on a machine without an accelerator
    torch.set_num_threads(1)
    results = {label: _configuration(rank, world, **kwargs, folder=folder)
               for label, kwargs in configurations.items()}
    torch.save(results, f"{folder}/rank{rank}.pt")


def _run(world: int, configurations: dict, tmp_path) -> dict[str, dict[str, torch.Tensor]]:
    """All ``configurations`` in one spawn of ``world`` ranks; each one's full weights,
    the ranks' put together (a name two ranks hold must be the same full tensor)."""
    spawn(_body, world, configurations, str(tmp_path))
    merged = {label: {} for label in configurations}
    for rank in range(world):
        for label, weights in torch.load(tmp_path / f"rank{rank}.pt").items():
            for name, t in weights.items():
                if name in merged[label]:
                    assert torch.equal(merged[label][name], t), (label, name, rank)
                merged[label][name] = t
    return merged


def _differing(expected: dict, got: dict) -> dict[str, float]:
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    return {n: (got[n] - expected[n]).abs().max().item() for n in expected if not torch.equal(got[n], expected[n])}


@pytest.fixture(scope="module")
def reference():
    expected = single_device()
    assert len(expected) == 3 + 7 * LAYERS  # embedding, norm, head; per block wqkv, wo, w1-w3, two norms
    return expected


def test_two_ranks_pipeline_and_fsdp2_with_full_ac_and_compile(reference, tmp_path):
    pipeline = dict(pp=2, tp=1, ac=True)
    got = _run(2, {
        "PP=2, full AC, compile": dict(pipeline, init="compile_rng"),
        "FSDP2=2, full AC, compile": dict(pp=1, tp=1, ac=True, init="compile_rng"),
        "PP=2, torchtitan's own init": dict(pipeline, init="torchtitan's own"),
        "PP=2, no seed=": dict(pipeline, init="compile_rng, no seed="),
    }, tmp_path)
    for label, weights in got.items():
        print(f"{label}: {len(_differing(reference, weights))} of {len(reference)} parameters differ")
    for label in ("PP=2, full AC, compile", "FSDP2=2, full AC, compile"):
        assert _differing(reference, got[label]) == {}, label
    # the comparison can fail
    assert _differing(reference, got["PP=2, torchtitan's own init"])
    stage_seeded = _differing(reference, got["PP=2, no seed="])
    assert stage_seeded and all(name.startswith(("layers.2.", "layers.3.", "norm.", "lm_head.")) for name in stage_seeded)


def test_four_ranks_fsdp2_x_tp_with_compile(reference, tmp_path):
    got = _run(4, {"FSDP2=2 x TP=2, compile": dict(pp=1, tp=2, ac=False, init="compile_rng")}, tmp_path)
    print(f"FSDP2=2 x TP=2, compile: {len(_differing(reference, got['FSDP2=2 x TP=2, compile']))} differ")
    assert _differing(reference, got["FSDP2=2 x TP=2, compile"]) == {}


# --- resuming with torchtitan's own checkpointer ----------------------------------------
#
# torchtitan's CheckpointManager (DCP) with compile_rng.StreamState() in its ``states``, the
# one line a torchtitan user adds where trainer.py builds it:
#
#     -            states={"train_state": self},
#     +            states={"train_state": self, "compile_rng": compile_rng.StreamState()},
#
# torchtitan's llama3 has no dropout, so residual dropout (p=0.1, GPT-2's resid_dropout)
# is added by forward hooks on every block's attention and feed_forward (module tree,
# names and sharding plans unchanged); each step runs in compile_rng.step, FSDP2 over the
# 2 gloo ranks by torchtitan's parallelize_llama, its set_determinism seeding, optimizer
# and LR scheduler containers. float32: torchtitan's dtype table has no float64.

STEPS, SAVED_AT, LOCAL_BATCH, SEQ = 6, 3, 2, 16


def _dropout_hook(module, args, output):
    return F.dropout(output, 0.1, training=module.training)


class TrainState:
    """The trainer's own ``states={"train_state": self}`` entry (its step)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def _train(rank: int, world: int, resume: bool, with_stream: bool, folder: str, out: str) -> None:
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" on a machine without one
    torch.set_num_threads(1)
    parallelism = ParallelismConfig(data_parallel_shard_degree=-1, spmd_backend="partial_dtensor")
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend("partial_dtensor")
    dist_utils.set_determinism(parallel_dims, torch.device("cpu"), DebugConfig(seed=SEED), distinct_seed_mesh_dims=["pp"])

    # the trainer's order: meta model, parallelize, to_empty, init_weights, optimizer, ...
    with torch.device("meta"):
        model = model_config(n_layers=2).build()
    model = parallelize_llama(
        model, parallel_dims=parallel_dims, parallelism=parallelism, dump_folder=folder,
        training=TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ, mixed_precision_param="float32"),
        compile_config=CompileConfig(enable=False), ac_config=None,
    )
    for module in model.modules():  # gloo has no PREMUL_SUM (torchtitan's divide factor 1.0 asks for it)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    for block in model.layers.values():  # residual dropout, without touching the model's code
        block.attention.register_forward_hook(_dropout_hook)
        block.feed_forward.register_forward_hook(_dropout_hook)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    train_state = TrainState()
    states = {"train_state": train_state}
    if with_stream:
        states["compile_rng"] = compile_rng.StreamState()  # the one line a torchtitan user adds
    checkpointer = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVED_AT).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states=states, sd_adapter=None, base_folder=folder,
    )
    if resume:
        assert checkpointer.load(step=SAVED_AT) and train_state.step == SAVED_AT
        assert states.get("compile_rng", compile_rng.StreamState()).loaded == with_stream

    # the data: a fixed global batch per step, rank r holding rows [r*b, (r+1)*b)
    tokens = torch.randint(0, VOCAB, (STEPS, world * LOCAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens[:, rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    dp_mesh = parallel_dims.get_mesh("fsdp")
    losses = []
    while train_state.step < STEPS:
        train_state.step += 1
        x, y = tokens[train_state.step - 1, :, :-1], tokens[train_state.step - 1, :, 1:]
        optimizers.zero_grad()
        with compile_rng.step(LOCAL_BATCH, data_parallel=dp_mesh):
            # torchtitan's loss: a token sum over the global token count (FSDP does not divide)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / (world * y.numel())
            loss.backward()
        optimizers.step()
        lr_schedulers.step()
        checkpointer.save(train_state.step, last_step=train_state.step == STEPS)
        losses.append(loss.detach().double())
    checkpointer.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, compile_rng.get_state())
    assert all(s == everyone[0] for s in everyone), everyone  # the ranks stay in step
    torch.save(torch.stack(losses), f"{out}.{rank}")



def test_torchtitans_checkpointer_resumes_the_stream_bitwise(tmp_path):
    """6 steps with a checkpoint at step 3; new processes load it and train steps 4-6:
    every loss equals the uninterrupted run's, and differs with the stream left out of
    ``states`` (the control)."""
    from torch.distributed.checkpoint import FileSystemReader

    runs = {}
    for with_stream in (True, False):
        folder = str(tmp_path / ("with" if with_stream else "without"))
        for resume in (False, True):
            out = f"{folder}-{'resume' if resume else 'whole'}"
            spawn(_train, 2, resume, with_stream, folder, out)
            runs[with_stream, resume] = [torch.load(f"{out}.{r}") for r in range(2)]
        # the stream is in torchtitan's checkpoint, under DCP's flattened keys of the entry
        saved = FileSystemReader(f"{folder}/checkpoint/step-{SAVED_AT}").read_metadata().state_dict_metadata
        assert ("compile_rng.streams.cpu.offset" in saved) == with_stream, sorted(saved)
    for rank in range(2):
        whole, resumed = runs[True, False][rank], runs[True, True][rank]
        assert whole.shape == (STEPS,) and resumed.shape == (STEPS - SAVED_AT,)
        assert torch.equal(whole[SAVED_AT:], resumed), (whole, resumed)
        assert torch.equal(runs[False, False][rank], whole)  # the stream in states changes no step
        assert not torch.equal(runs[False, True][rank], whole[SAVED_AT:])  # the control: it can fail
