"""Plain tensor-parallel plans: random ops on a TP rank's local tensors, compiled
(``local_shards``) and eager (``eager_shards``).

``ColwiseParallel()`` with its default local outputs hands attention this rank's heads as
plain tensors. Fake process-group ranks (the forward below has no collective, so its
values are real); every case runs compiled and eagerly (inside ``eager_stream`` and in a
``compile_rng.step``), and eager must draw the compiled graph's masks:

* tracker layout: the ranks' attention-dropout masks differ, and each is the scalar
  reference's stream at the tracker's counters of the attention matrix's ``Shard(1)``;
* invariant layout: the ranks' heads assemble to the single device's masks bitwise, also
  when the program reshapes with sizes read off the local shape (``flat``), when the
  module is checkpointed inside the compiled code (the region is a subgraph);
* transformers' Llama attention under its plain plan: the attention dropout is drawn as
  a DTensor op on the head-sharded attention matrix;
* a shard whose layout DTensor's rules cannot describe: the random op is refused, with
  its line and the fix; so is one in a graph with symbolic sizes (what Dynamo compiles
  once a shape changed), while ``dynamic=False`` and a graph without dropout run;
* a piece that crosses a graph break: eager code after the graph draws its layout; a
  graph that receives it as an input and draws on it refuses it.

Real gloo ranks (loss curves, eager and compiled): ``test_hf_parity.py``.
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
from compile_rng._torch.dtensor_internals import dtensor_views_flatten_sharded_dims
from compile_rng.eager.dispatch_modes import eager_stream

#: The attention scores of heads sharded over TP flatten a sharded dim (q @ k's view):
#: torch 2.11's DTensor has no rule for it, and compile_rng refuses such a draw there
#: (test_scores_are_refused_where_dtensor_cannot_describe_them).
needs_view_rule = pytest.mark.skipif(not dtensor_views_flatten_sharded_dims(),
                                     reason="this torch's DTensor cannot flatten a sharded dim (torch 2.12+)")

SEED = 5
B, S, D, H = 2, 4, 8, 4  # heads of 2 features: 2 heads per rank on 2 ranks
P = 0.5
HOWS = ("compiled", "eager", "step", "checkpointed")


class Scores(nn.Module):
    """Attention probabilities with dropout, on whatever heads this rank's q/k hold.

    ``variant``: ``"scores"`` the probabilities; ``"checkpointed_core"`` the same computed
    in ``checkpoint(self.core, q, k)`` (Megatron's order: the local pieces enter the
    checkpointed region); ``"flat"`` this rank's q flattened per sample with literal sizes
    read off its local shape; ``"first_head"`` the first of this rank's heads (a piece
    DTensor's rules cannot describe without moving data)."""

    def __init__(self, variant: str = "scores"):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(D, D, dtype=torch.float64), nn.Linear(D, D, dtype=torch.float64)
        self.variant = variant

    def forward(self, x):
        b, s, _ = x.shape
        q, k = (w(x).view(b, s, -1, D // H).transpose(1, 2) for w in (self.q, self.k))
        if self.variant == "flat":
            return F.dropout(q.reshape(b, q.shape[1] * s * (D // H)), P)
        if self.variant == "first_head":
            return F.dropout(q[:, :1], P)
        if self.variant == "checkpointed_core":
            return torch.utils.checkpoint.checkpoint(self.core, q, k, use_reentrant=False)
        return self.core(q, k)

    def core(self, q, k):
        scores = (q @ k.transpose(-1, -2)).softmax(-1)
        if self.variant == "noise":  # float32 noise like the scores (torch's factory kernels)
            scores = scores.float()
            return torch.cat([torch.rand_like(scores), torch.randn_like(scores)], dim=-1)
        return F.dropout(scores, P)


def _input():
    return torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _tensor_parallel(model: nn.Module, rank: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (2,))
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    parallelize_module(model, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
    with torch.no_grad():  # the fake group's scatter sends nothing: put the rank's rows in
        for name, p in model.named_parameters():
            p.to_local().copy_(full[name].chunk(2)[rank])
    return model


def _run(model: nn.Module, x: torch.Tensor, layout: str, how: str):
    """``model(x)`` compiled with ``layout``, eagerly on the stream, or eagerly in a step."""
    compile_rng.manual_seed(SEED)
    if how == "compiled":
        return torch.compile(model, backend=compile_rng.backend(layout=layout))(x)
    if how == "checkpointed":  # AC, then compile (torchtitan's order): the region is a subgraph
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        return torch.compile(checkpoint_wrapper(model), backend=compile_rng.backend(layout=layout))(x)
    if how == "step":  # a step's layout is invariant: element (i, ...) at its row of the batch
        assert layout == "invariant"
        with compile_rng.step(x.shape[0]):
            return model(x)
    with compile_rng.layout(layout), eager_stream():
        return model(x)


def _on_rank(rank: int, layout: str, how: str = "compiled", variant: str = "scores"):
    """This rank's local output of the plain-plan model, and the state after it."""
    with fake_rank(rank, 2):
        torch._dynamo.reset()
        out = _run(_tensor_parallel(Scores(variant), rank), _input(), layout, how)
        return out, compile_rng.get_state()


def _keep(start: int, n: int) -> torch.Tensor:
    return torch.tensor([ref.keep_bernoulli(SEED, start + i, 1 - P) for i in range(n)])


LOCAL = (B, H // 2, S, S)
GLOBAL_NUMEL = B * H * S * S


@needs_view_rule
@pytest.mark.parametrize("variant", ["scores", "checkpointed_core"])
@pytest.mark.parametrize("how", ["compiled", "eager"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tracker_layout_ranks_draw_their_shard_counters(rank, how, variant):
    out, state = _on_rank(rank, "tracker", how, variant)
    n = B * (H // 2) * S * S
    # the tracker's layout of Shard(1) on (B, H, S, S): shard_linear_idx * numel(first shard)
    expected = _keep(ceil4(rank * n), n).view(LOCAL)
    assert torch.equal(out != 0, expected)
    assert state == (SEED, ceil4(GLOBAL_NUMEL))


@needs_view_rule
@pytest.mark.parametrize("how", ["compiled", "eager"])
def test_tracker_layout_masks_differ_across_ranks(how):
    masks = [_on_rank(rank, "tracker", how)[0] != 0 for rank in range(2)]
    assert not torch.equal(masks[0], masks[1])


def _single_device(variant: str) -> torch.Tensor:
    model, x = Scores(variant), _input()
    compile_rng.manual_seed(SEED)
    with eager_stream():  # a plain tensor: counters at its row-major index
        return model(x)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("variant, dim", [("scores", 1), ("checkpointed_core", 1), ("flat", 1)])
def test_invariant_layout_assembles_to_the_single_device(variant, dim, how):
    if variant != "flat" and not dtensor_views_flatten_sharded_dims():
        pytest.skip("this torch's DTensor cannot flatten a sharded dim (torch 2.12+)")
    full = _single_device(variant)
    expected = _keep(0, full.numel()).view(full.shape)
    assert torch.equal(full != 0, expected)
    pieces = [_on_rank(rank, "invariant", how, variant)[0] for rank in range(2)]
    assembled = torch.cat(pieces, dim=dim)
    assert torch.equal(assembled != 0, expected)
    assert (assembled - full).abs().max() < 1e-12


@needs_view_rule
@pytest.mark.parametrize("how", ["eager", "step"])
def test_noise_like_a_piece_is_its_piece_of_the_single_devices(how):
    """``rand_like``/``randn_like`` of a rank's float32 piece of the scores, eagerly, where
    the stream's piece mode follows the piece: the ranks' noise assembles to the single
    device's."""
    full = _single_device("noise")
    pieces = [_on_rank(rank, "invariant", how, "noise")[0] for rank in range(2)]
    assert torch.equal(torch.cat(pieces, dim=1), full)


#: a draw of a piece: ``draw(tensor)``
_PIECE_DRAWS = {
    "bernoulli_": lambda t: t.bernoulli_(0.5).clone(), "rand_like": torch.rand_like, "randn_like": torch.randn_like,
}


@pytest.mark.parametrize("first", list(_PIECE_DRAWS))
def test_draws_of_a_piece_recorded_in_an_earlier_step(first):
    """A piece recorded in one step: ``bernoulli_``, ``rand_like`` and ``randn_like`` of it in
    the next step draw its piece of the global tensor's, not a replica. The first draw of
    the step is the one the C++ kernels' lane must leave to the Python kernel (a draw of a
    piece enters the piece mode, which keeps the lane off for the rest of the step)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    order = [first] + [name for name in _PIECE_DRAWS if name != first]
    full = torch.zeros(B, 4, 3)
    compile_rng.manual_seed(SEED)
    with compile_rng.step(B):
        expected = [_PIECE_DRAWS[name](full.clone()) for name in order]
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = init_device_mesh("cpu", (2,))
            compile_rng.manual_seed(SEED)
            with compile_rng.step(B):
                piece = distribute_tensor(full, mesh, [Shard(1)]).to_local()
            with compile_rng.step(B):
                drawn = [_PIECE_DRAWS[name](piece) for name in order]
        for got, want in zip(drawn, expected):
            assert torch.equal(got, want[:, 2 * rank:2 * rank + 2])


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


@pytest.mark.parametrize("how, op, lost", [
    ("compiled", r"native_dropout.default in dropout", "getitem"), ("eager", r"aten.bernoulli_.float", "aten.slice.Tensor"),  # eager dropout: bernoulli_
])
def test_a_shard_without_a_layout_is_refused(how, op, lost):
    line = r"test_local_shards.py:\d+"
    pattern = rf"(?s){op} at .*{line}.*cannot be recovered: {lost} at .*{line}.*use_local_output=False"
    with pytest.raises(Exception, match=pattern):
        _on_rank(0, "invariant", how, "first_head")


def _second_shape(p: float, dynamic: bool | None) -> torch.Tensor:
    """Rank 0's output for a second batch size: Dynamo recompiles, with a symbolic batch
    size unless ``dynamic=False``."""
    global P
    kept, P = P, p
    try:
        with fake_rank(0, 2):
            torch._dynamo.reset()
            fn = torch.compile(_tensor_parallel(Scores(), 0), backend=compile_rng.backend(layout="invariant"),
                               dynamic=dynamic)
            x = _input()
            fn(x)
            return fn(torch.cat([x, x[:1]]))
    finally:
        P = kept


@needs_view_rule
def test_a_graph_with_symbolic_sizes_refuses_a_draw_on_a_local_piece():
    """Dynamo's graph for a changed shape has a symbolic batch size: a draw on a TP rank's
    local piece is refused with the fix (``dynamic=False``, which works); without a draw
    the symbolic graph runs."""
    with pytest.raises(Exception, match=r"(?s)native_dropout.*sizes are symbolic.*dynamic=False"):
        _second_shape(P, None)
    assert _second_shape(P, False).shape == (B + 1, *LOCAL[1:])
    assert _second_shape(0.0, None).shape == (B + 1, *LOCAL[1:])


class _Broken(Scores):
    """The attention scores, with a graph break between ``to_local()`` and the dropout:
    the dropout runs in eager code after the graph, or (``in_graph``) in the next graph."""

    def __init__(self, in_graph: bool):
        super().__init__()
        self.in_graph = in_graph

    def forward(self, x):
        b, s, _ = x.shape
        q, k = (w(x).view(b, s, -1, D // H).transpose(1, 2) for w in (self.q, self.k))
        probs = (q @ k.transpose(-1, -2)).softmax(-1)
        torch._dynamo.graph_break()
        return F.dropout(probs, P) if self.in_graph else torch._dynamo.disable(F.dropout)(probs, P)


@needs_view_rule
@pytest.mark.parametrize("rank", [0, 1])
def test_a_piece_returned_by_a_graph_is_drawn_on_its_layout_in_eager_code(rank):
    expected, _ = _on_rank(rank, "invariant", "compiled")
    with fake_rank(rank, 2):
        torch._dynamo.reset()
        model = _tensor_parallel(_Broken(in_graph=False), rank)
        compiled = compile_rng.compile(model, layout="invariant")
        compile_rng.manual_seed(SEED)
        with compile_rng.layout("invariant"):
            out = compiled(_input())
    assert torch.equal(out != 0, expected != 0)


def test_a_graph_refuses_a_piece_it_would_draw_as_a_replica():
    with fake_rank(0, 2):
        torch._dynamo.reset()
        model = _tensor_parallel(_Broken(in_graph=True), 0)
        compiled = compile_rng.compile(model, layout="invariant")
        with pytest.raises(NotImplementedError, match=r"(?s)native_dropout.*input \d+, a plain tensor that is this rank's piece.*graph break"):
            compiled(_input())


@pytest.mark.skipif(dtensor_views_flatten_sharded_dims(), reason="this torch's DTensor describes the scores")
@pytest.mark.parametrize("how", HOWS)
def test_scores_are_refused_where_dtensor_cannot_describe_them(how):
    """torch 2.11: the heads' scores (a view that flattens a sharded dim) have no layout in
    DTensor's rules, so a draw on them is refused, eager or compiled - never drawn as a
    replica."""
    layout = "invariant" if how == "step" else "tracker"
    with pytest.raises(Exception, match="sharding rules do not describe"):
        _on_rank(1, layout, how)
