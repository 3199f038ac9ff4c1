"""Wrappers change no random number: per-name streams (``init(streams="fqn")``,
``step(names=...)``) are keyed by the names of a ``torch.distributed.checkpoint`` state
dict, which leave out ``checkpoint_wrapper``, ``torch.compile``'s ``OptimizedModule``,
FSDP1's and DDP's wrapper modules.

Each wrapper kind gets bitwise the unwrapped model's weights and masks; with the raw
``named_parameters`` / ``named_modules`` paths as names (the canonicalization taken out)
the same comparisons fail, so the tests can fail.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from init_patterns import Model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import compile_rng
from compile_rng.semantics import model_names

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import pipeline_parity as pp  # noqa: E402

SEED = 5


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group: DDP and FSDP1 need one to wrap a module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def raw_names(monkeypatch):
    """Names as the raw module paths (the wrappers' components kept): the contrast."""
    monkeypatch.setattr(model_names, "checkpoint_name", lambda model, key: key)
    monkeypatch.setattr(model_names, "checkpoint_module_name", lambda model, path: path)


def _ac(model):
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: m in list(model.layers.values()))
    return model


def _compiled_blocks(model):
    for key in list(model.layers):
        model.layers[key] = torch.compile(model.layers[key])  # an OptimizedModule in the tree
    return model


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({type(model.layers["0"])})
    return FullyShardedDataParallel(model, use_orig_params=True, auto_wrap_policy=policy, device_id=torch.device("cpu"))


WRAPPERS = {
    "checkpoint_wrapper": _ac,
    "torch.compile(block)": _compiled_blocks,
    "torch.compile(model)": torch.compile,
    "torch.compile(checkpoint_wrapper(block))": lambda m: _compiled_blocks(_ac(m)),
    "DDP": _ddp,
    "FSDP1": _fsdp1,
}


def _init_weights(wrapped, inner):
    """The weights by their names in DCP's state dict (torch's public API: the reference)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(SEED)
    compile_rng.init(layout="invariant", streams="fqn")(lambda m: inner.init_weights())(wrapped)
    return {name: t.detach().clone() for name, t in get_model_state_dict(wrapped).items()}


@pytest.fixture(scope="module")
def unwrapped_weights(one_rank_group):
    model = Model(orthogonal=False)
    return _init_weights(model, model)


def _wrapped_weights(kind):
    inner = Model(orthogonal=False)
    return _init_weights(WRAPPERS[kind](inner), inner)


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_init_draws_the_unwrapped_streams(kind, unwrapped_weights, one_rank_group):
    weights = _wrapped_weights(kind)
    assert weights.keys() == unwrapped_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, unwrapped_weights[name]), (kind, name)


@pytest.mark.parametrize("kind", ["checkpoint_wrapper", "torch.compile(model)", "DDP"])
def test_init_differs_without_the_checkpoint_names(kind, unwrapped_weights, one_rank_group, raw_names):
    weights = _wrapped_weights(kind)
    assert any(not torch.equal(w, unwrapped_weights[name]) for name, w in weights.items())


def test_module_names_keep_the_innermost_module(one_rank_group):
    model = _compiled_blocks(_ac(Model()))
    names = model_names.module_names(_ddp(model))
    held = {name: m for m in model.modules() if (name := names.get(id(m))) is not None}
    plain = {name for name, _ in Model().named_modules()}
    assert set(held) == plain
    assert type(held["layers.0"]).__name__ == "Block"  # not its CheckpointWrapper or OptimizedModule


def test_module_names_follow_a_model_wrapped_after_they_were_computed():
    """The names are kept per root between steps: wrapping a block in place afterwards
    (a new module at its path) is seen, and the wrapper gets the block's name."""
    model = Model()
    before = model_names.module_names(model)
    assert model_names.module_names(model) is before  # unchanged: kept
    block = model.layers["0"]
    apply_activation_checkpointing(model, check_fn=lambda m: m is block)
    after = model_names.module_names(model)
    wrapper = model.layers["0"]
    assert type(wrapper).__name__ == "CheckpointWrapper" and id(wrapper) not in before
    assert after[id(wrapper)] == "layers.0" == after[id(wrapper._checkpoint_wrapped_module)]


# --- activations: step(names=...) --------------------------------------------------------


def _dropped(wrap, raw=False):
    """Block 3's dropped elements (forward and backward) in one named step of the GPT."""
    model = pp.whole_model("gpt")
    captured = []
    pp.capture_dropped(model, "3", captured)
    root = wrap(model)
    tokens, targets = pp.global_batches(pp.CONFIG, 1)[0]
    torch.manual_seed(pp.SEED)
    with compile_rng.step(tokens.shape[0], names=root):
        logits = root(tokens)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    return {kind: mask for kind, _, mask in captured}


def _gpt_ac(model):
    for key in list(model.blocks):
        model.blocks[key] = checkpoint_wrapper(model.blocks[key])
    return model


def _gpt_checkpoint_inside(model):
    """A block that checkpoints its MLP (``checkpoint(self.mlp, x)``, the form HF's
    gradient checkpointing uses: the module is called, so the recomputation is named)."""
    for block in model.blocks.values():
        block.forward = (
            lambda b: lambda x: (y := x + b.attn(b.norm1(x))) + checkpoint(b.mlp, b.norm2(y), use_reentrant=False)
        )(block)
    return model


ACTIVATION_WRAPPERS = {
    "checkpoint_wrapper": _gpt_ac,
    "torch.utils.checkpoint inside a block": _gpt_checkpoint_inside,
    "DDP": _ddp,
}


@pytest.fixture(scope="module")
def unwrapped_masks():
    masks = _dropped(lambda m: m)
    assert set(masks) == {"attn forward", "attn backward", "mlp forward", "mlp backward"}
    assert all(0 < m.float().mean() < 0.3 for m in masks.values())  # dropout p=0.1 ran
    return masks


@pytest.mark.parametrize("kind", list(ACTIVATION_WRAPPERS))
def test_named_step_draws_the_unwrapped_masks(kind, unwrapped_masks, one_rank_group):
    masks = _dropped(ACTIVATION_WRAPPERS[kind])
    for part, mask in unwrapped_masks.items():
        assert torch.equal(masks[part], mask), (kind, part)


@pytest.mark.parametrize("kind", ["checkpoint_wrapper", "DDP"])
def test_named_step_differs_without_the_checkpoint_names(kind, unwrapped_masks, one_rank_group, raw_names):
    masks = _dropped(ACTIVATION_WRAPPERS[kind])
    assert not torch.equal(masks["mlp forward"], unwrapped_masks["mlp forward"])
