"""Compiled graphs in a step with ``names=`` draw from the streams their modules name
(``compile_rng.compiled.named_keys``): eager, compiled and mixed models draw one set of masks.

* a small model of dropouts: per-module compile (``module.compile()``, also
  ``fullgraph=True``, and with a graph break inside the module), ``torch.compile(module)``
  replacing a module, the whole model
  compiled (slow), a module called twice, two forwards over the same rows - outputs and
  input gradients bitwise equal to the eager model's, and different from a compiled model
  drawing in the step's sequence (the comparison can fail); no recompile for another
  microbatch or step;
* (slow) the pipeline example's GPT, float64: per-block compile, with ``checkpoint_wrapper``
  (torchtitan's full AC) inside or outside the compiled region and torch's selective AC
  policy, keeps the eager model's loss and gradients (1e-9);
* a checkpointed, compiled attention without dropout (torchtitan's models: torch wraps
  SDPA in ``run_with_rng_state``) runs in a named step and equals eager;
* what the graph cannot name is refused with an error naming the fix.
"""

import copy
import sys
from pathlib import Path

import pytest
from helpers import FX_CACHE_BYPASSED_ON_212
import torch
import torch.nn.functional as F
from torch import nn

import compile_rng

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import pipeline_parity as pp  # noqa: E402

TOLERANCE = 1e-9
BATCH = 8


# one backend object for every compile: Dynamo recompiles a function compiled before by
# another backend object
BACKEND = compile_rng.backend(layout="invariant", batched=True)


class Noise(nn.Module):
    """Two draws in one module: ``dropout`` and ``rand_like``."""

    def forward(self, x):
        return F.dropout(x, 0.5, self.training) + 0.25 * torch.rand_like(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Noise(), Noise()
        self.scale = nn.Parameter(torch.ones(6, dtype=torch.float64))

    def forward(self, x):
        return self.b(self.a(x) * self.scale) + F.dropout(x, 0.25, self.training)


class BreakingBlock(Block):
    """``Block`` with a graph break between its modules: Dynamo compiles two graphs, the
    second in a resume function of the same call."""

    def forward(self, x):
        y = self.a(x) * self.scale
        torch._dynamo.graph_break()
        return self.b(y) + F.dropout(x, 0.25, self.training)


class Model(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): block() for i in range(2)})
        self.shared = Noise()  # runs twice per forward

    def forward(self, x):
        for block in self.blocks.values():
            x = self.shared(block(x))
        return self.shared(x)


def _compiled(how: str) -> Model:
    model = Model(BreakingBlock if how == "blocks with a graph break" else Block)
    if how in ("blocks", "blocks with a graph break"):
        for block in model.blocks.values():
            block.compile(backend=BACKEND)
    elif how == "blocks fullgraph":
        for block in model.blocks.values():
            block.compile(backend=BACKEND, fullgraph=True)
    elif how == "torch.compile(module)":  # the OptimizedModule replaces the module
        for key in list(model.blocks):
            model.blocks[key] = torch.compile(model.blocks[key], backend=BACKEND)
    elif how == "whole model":
        model.compile(backend=BACKEND)
    return model


def _run(model: nn.Module, forwards: int = 1, names: bool = True):
    """Outputs and input gradients of ``forwards`` forwards over one batch in a step."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 3, 6, dtype=torch.float64, requires_grad=True)
    outputs = []
    with compile_rng.step(BATCH, names=model if names else None):
        for _ in range(forwards):
            out = model(x)
            out.backward(torch.ones_like(out))
            outputs.append(out.detach())
    return outputs, x.grad


@pytest.fixture(scope="module")
def eager():
    return _run(Model(), forwards=2)


@pytest.fixture(scope="module")
def compiled():
    """``compiled(how)``: the model compiled ``how``, once for the module's tests."""
    models = {}

    def get(how: str) -> Model:
        if how not in models:
            models[how] = _compiled(how)
        return models[how]

    return get


@pytest.mark.parametrize(
    "how",
    ["blocks", "blocks fullgraph", "torch.compile(module)", "blocks with a graph break",
     pytest.param("whole model", marks=pytest.mark.slow)],
)
def test_compiled_modules_draw_the_eager_masks_bitwise(how, eager, compiled):
    model = compiled(how)
    outputs, grad = _run(model, forwards=2)
    for got, want in zip(outputs, eager[0]):
        assert torch.equal(got, want), how
    assert torch.equal(grad, eager[1]), how  # dropout's backward regenerates the named mask
    assert not torch.equal(outputs[0], outputs[1])  # a second forward draws new masks
    # the same compiled graphs drawing in the step's sequence (no names=): other values
    sequence, _ = _run(model, names=False)
    assert not torch.equal(sequence[0], eager[0][0])


def test_a_named_graph_is_compiled_once_for_every_microbatch_and_step(compiled):
    model = compiled("blocks")
    _run(model)  # compiled here unless an earlier test did
    counters = torch._dynamo.utils.counters
    counters.clear()
    for _ in range(2):  # steps of two microbatches of the first call's shape
        torch.manual_seed(0)
        x = torch.randn(2 * BATCH, 3, 6, dtype=torch.float64, requires_grad=True)
        with compile_rng.step(2 * BATCH, names=model) as s:
            for rows in x.tensor_split(2):
                with s.microbatch(rows.shape[0]):
                    model(rows).sum().backward()
    assert counters["stats"]["unique_graphs"] == 0


def test_a_graph_without_row_keys_is_refused_in_a_named_step():
    model = Model()
    model.blocks["0"].compile(backend=compile_rng.backend(layout="invariant", inner="aot_eager"))
    with pytest.raises(NotImplementedError, match="batched=True"):
        _run(model)


def test_a_compiled_function_outside_the_model_is_refused():
    model = Model()
    forward = model.blocks["0"].forward
    model.blocks["0"].forward = torch.compile(lambda x: forward(x), backend=BACKEND)
    with pytest.raises(RuntimeError, match="not the forward of a module of the model"):
        _run(model)


# --- the pipeline example's GPT ---------------------------------------------------------


def _gpt_step(model: nn.Module):
    """One step's loss and gradients (float64, 2 microbatches), gradients in parameter order."""
    tokens, targets = pp.global_batches(pp.CONFIG, 1)[0]
    torch.manual_seed(pp.SEED)
    return pp.single_step(model, tokens, targets, microbatches=2), [p.grad for p in model.parameters()]


def _compile_blocks(model: nn.Module) -> None:
    for block in pp.transformer_blocks(model):
        block.compile(backend=BACKEND)


STACKS = {  # torchtitan's order is AC, then per-block compile
    "blocks compiled": [_compile_blocks],
    "AC, then blocks compiled": [pp.checkpoint_blocks, _compile_blocks],
    "blocks compiled, then AC": [_compile_blocks, pp.checkpoint_blocks],
    "selective AC, then blocks compiled": [pp.selective_checkpoint_blocks, _compile_blocks],
}


@pytest.fixture(scope="module")
def gpt_eager():
    return _gpt_step(pp.whole_model("gpt"))


@pytest.mark.slow
@pytest.mark.parametrize("stack", STACKS)
def test_compiled_gpt_blocks_keep_the_eager_loss_and_gradients(stack, gpt_eager):
    model = pp.whole_model("gpt")
    for apply in STACKS[stack]:
        apply(model)
    loss, grads = _gpt_step(model)
    assert abs(loss - gpt_eager[0]) <= TOLERANCE * abs(gpt_eager[0]), stack
    for got, want in zip(grads, gpt_eager[1]):
        assert torch.allclose(got, want, rtol=TOLERANCE, atol=1e-12), stack


class Attention(nn.Module):
    """Attention without dropout (torchtitan's models): SDPA is random-tagged, so torch's
    activation checkpointing wraps it in ``run_with_rng_state`` in the compiled region."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(6, 18, dtype=torch.float64)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 3)).permute(2, 0, 3, 1, 4).unbind(0)  # [batch, head, token, dim]
        return x + F.scaled_dot_product_attention(q, k, v, dropout_p=0.0).transpose(1, 2).flatten(-2)


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.11's and 2.12's Inductor fail this float64 "
                    "flash-attention backward under checkpointing, without compile_rng too (expected scalar type Double)")
def test_checkpointed_compiled_attention_without_dropout_runs_in_a_named_step():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    eager = nn.Sequential(Attention(), Noise())
    wrapped = copy.deepcopy(eager)
    wrapped[0] = checkpoint_wrapper(wrapped[0])
    wrapped[0].compile(backend=BACKEND)
    (want, _), (got, _) = _run(eager), _run(wrapped)
    assert torch.equal(got[0], want[0])


# --- a backward in two halves (zero-bubble schedules) ------------------------------------


def _block_gradients(split: bool) -> list[torch.Tensor]:
    """Block 1 of the pipeline example's GPT compiled alone, in a named step: its weights'
    gradients from one backward, or (``split``) from a zero-bubble schedule's two halves -
    torch's own ``stage_backward_input``, then ``stage_backward_weight``, which runs the
    compiled backward a second time on the same saved tensors."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    model = pp.whole_model("gpt")
    block = model.blocks["1"]
    block.compile(backend=BACKEND)
    params = list(block.parameters())
    x = torch.randn(BATCH, pp.CONFIG.seq, pp.CONFIG.dim, dtype=torch.float64, requires_grad=True)
    grad = torch.linspace(0, 1, x.numel(), dtype=x.dtype).reshape(x.shape)
    with compile_rng.step(BATCH, names=model):
        y = block(x)
        if split:
            _, groups = stage_backward_input([y], [grad], [x], iter(params))
            stage_backward_weight(iter(params), groups)
        else:
            y.backward(grad)
    return [p.grad for p in params]


@pytest.mark.slow
def test_a_backward_in_two_halves_regenerates_the_forward_masks():
    """A zero-bubble schedule needs ``donated_buffer=False`` (stock torch's rule); a graph
    compiled and cached before with donated buffers must not be reused then: its backward
    overwrites the saved tensors its second half reads (the attention's dropout-mask path:
    q, k and norm weights 1e-5 off)."""
    import torch._functorch.config as functorch_config

    once = _block_gradients(split=False)  # donated buffers on (torch's default): compiled, cached
    torch._dynamo.reset()  # the next compile looks the graph up in the caches
    with functorch_config.patch(donated_buffer=False):
        halves = _block_gradients(split=True)
    for name, got, want in zip([n for n, _ in pp.whole_model("gpt").blocks["1"].named_parameters()], halves, once):
        assert torch.equal(got, want), name


@FX_CACHE_BYPASSED_ON_212
def test_a_change_of_the_donated_buffer_setting_compiles_again(tmp_path, monkeypatch):
    """A graph compiled and cached with donated buffers is not served to a compile without
    them (its backward would overwrite the saved tensors a second half reads), nor the
    other way round; an unchanged setting is served from the caches."""
    import torch._functorch.config as functorch_config
    from helpers import cache_outcome

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def run():
        compiled = torch.compile(lambda x: (F.dropout(x, 0.5) * x).sum(), backend=compile_rng.backend())
        return lambda: compiled(torch.ones(8, requires_grad=True)).backward()

    with functorch_config.patch(donated_buffer=True):
        assert cache_outcome(run()) == "compiled"
    with functorch_config.patch(donated_buffer=False):
        assert cache_outcome(run()) == "compiled"
        assert cache_outcome(run()) == "served"
    with functorch_config.patch(donated_buffer=True):
        assert cache_outcome(run()) == "served"
    torch._dynamo.reset()


def test_a_graph_compiled_with_donated_buffers_refuses_to_run_without_them():
    import torch._functorch.config as functorch_config

    compiled = torch.compile(lambda x: F.dropout(x, 0.5) * x, backend=compile_rng.backend())
    x = torch.ones(8, requires_grad=True)
    with functorch_config.patch(donated_buffer=True):
        compiled(x)
    with functorch_config.patch(donated_buffer=False), pytest.raises(RuntimeError, match="donated buffers on"):
        compiled(x)


def test_named_draws_at_interleaved_rows_are_the_one_process_masks():
    """Interleaved rows (``DistributedSampler``'s) in a named step: each of 2 fake ranks'
    compiled blocks (a graph compiled with the rows' spacing) draws its rows of one
    process's named masks over the whole batch, as its eager blocks do."""
    from dtensor_reference import fake_rank
    from torch.distributed.device_mesh import DeviceMesh

    backend = compile_rng.backend(layout="invariant", batched=True)  # its own graphs: spacing 2
    eager_model, compiled_model = Model(), Model()
    for block in compiled_model.blocks.values():
        block.compile(backend=backend)
    x = torch.randn(BATCH, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    compile_rng.manual_seed(0)
    with compile_rng.step(BATCH, names=eager_model):
        whole = eager_model(x)
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cpu", [0, 1])
            for model in (eager_model, compiled_model):
                compile_rng.manual_seed(0)
                with compile_rng.step(BATCH // 2, names=model, data_parallel=mesh, global_batch=BATCH,
                                      rows="interleaved"):
                    got = model(x[rank::2])
                assert torch.equal(got, whole[rank::2]), (rank, model is compiled_model)
    assert not torch.equal(whole[0::2], whole[1::2])  # rows differ: the comparison can fail
