"""Plain tensor-parallel plans: random ops on a TP rank's local tensors (``local_shards``).

``ColwiseParallel()`` with its default local outputs hands attention this rank's heads as
plain tensors. Fake process-group ranks (the forward below has no collective, so its
values are real):

* tracker layout: the ranks' attention-dropout masks differ, and each is the scalar
  reference's stream at the tracker's counters of the attention matrix's ``Shard(1)``;
* invariant layout: the ranks' heads assemble to the single device's masks bitwise;
* transformers' Llama attention under its plain plan: the attention dropout is drawn as
  a DTensor op on the head-sharded attention matrix;
* a shard whose layout DTensor's rules cannot describe: the random op is refused, with
  its line and the fix. Real gloo ranks (loss curves): ``test_hf_parity.py``.
"""

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4, fake_rank
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import compile_rng
from compile_rng.dispatch_modes import eager_stream

SEED = 5
B, S, D, H = 2, 4, 8, 4  # heads of 2 features: 2 heads per rank on 2 ranks
P = 0.5


class Scores(nn.Module):
    """Attention probabilities with dropout, on whatever heads this rank's q/k hold."""

    def __init__(self, reshape_literally: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(D, D, dtype=torch.float64), nn.Linear(D, D, dtype=torch.float64)
        self.reshape_literally = reshape_literally

    def forward(self, x):
        b, s, _ = x.shape
        q, k = (w(x).view(b, s, -1, D // H).transpose(1, 2) for w in (self.q, self.k))
        if self.reshape_literally:  # the local shape as literal sizes: no DTensor rule fits
            q = q.reshape(b, q.shape[1] * s * (D // H))
            return F.dropout(q, P)
        return F.dropout((q @ k.transpose(-1, -2)).softmax(-1), P)


def _input():
    return torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _on_rank(rank: int, layout: str, model: nn.Module | None = None):
    """This rank's local output of the plain-plan model, compiled with ``layout``."""
    with fake_rank(rank, 2):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2,))
        model = model or Scores()
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        parallelize_module(model, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
        with torch.no_grad():  # the fake group's scatter sends nothing: put the rank's rows in
            for name, p in model.named_parameters():
                p.to_local().copy_(full[name].chunk(2)[rank])
        compiled = torch.compile(model, backend=compile_rng.backend(layout=layout))
        compile_rng.manual_seed(SEED)
        return compiled(_input()), compile_rng.get_state()


def _keep(start: int, n: int) -> torch.Tensor:
    return torch.tensor([ref.keep_bernoulli(SEED, start + i, 1 - P) for i in range(n)])


LOCAL = (B, H // 2, S, S)
GLOBAL_NUMEL = B * H * S * S


@pytest.mark.parametrize("rank", [0, 1])
def test_tracker_layout_ranks_draw_their_shard_counters(rank):
    out, state = _on_rank(rank, "tracker")
    n = B * (H // 2) * S * S
    # the tracker's layout of Shard(1) on (B, H, S, S): shard_linear_idx * numel(first shard)
    expected = _keep(ceil4(rank * n), n).view(LOCAL)
    assert torch.equal(out != 0, expected)
    assert state == (SEED, ceil4(GLOBAL_NUMEL))


def test_tracker_layout_masks_differ_across_ranks():
    masks = [_on_rank(rank, "tracker")[0] != 0 for rank in range(2)]
    assert not torch.equal(masks[0], masks[1])


def test_invariant_layout_assembles_to_the_single_device():
    single, x = Scores(), _input()
    compile_rng.manual_seed(SEED)
    with eager_stream():  # a plain tensor: counters at its row-major index
        full = single(x)
    expected = _keep(0, GLOBAL_NUMEL).view(B, H, S, S)
    assert torch.equal(full != 0, expected)
    pieces = [_on_rank(rank, "invariant")[0] for rank in range(2)]
    assembled = torch.cat(pieces, dim=1)
    assert torch.equal(assembled != 0, expected)
    assert (assembled - full).abs().max() < 1e-12


def test_transformers_llama_attention_dropout_is_drawn_on_its_heads():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=D, intermediate_size=16, num_hidden_layers=1, num_attention_heads=H,
        num_key_value_heads=2, attention_dropout=0.1,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    attention = model.model.layers[0].self_attn
    x = _input()
    position_embeddings = model.model.rotary_emb(x, torch.arange(S)[None])
    with fake_rank(1, 2):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2,))
        plan = {f"{p}_proj": ColwiseParallel() for p in "qkv"} | {"o_proj": RowwiseParallel()}
        parallelize_module(attention, mesh, plan)
        backend = compile_rng.backend(layout="invariant")
        torch.compile(attention, backend=backend)(x, position_embeddings=position_embeddings, attention_mask=None)
    ops = [op for plan in backend.plans for op in plan.ops]
    assert len(ops) == 1
    (op,) = ops
    assert op.sharding is not None and tuple(op.sharding.global_shape) == (B, H, S, S)
    assert [getattr(p, "dim", None) for p in op.sharding.placements] == [1]


def test_a_shard_without_a_layout_is_refused():
    with pytest.raises(Exception, match=r"(?s)native_dropout.default in dropout at .*test_local_shards.py:\d+.*cannot be recovered.*reshape at .*use_local_output=False"):
        _on_rank(0, "invariant", Scores(reshape_literally=True))
