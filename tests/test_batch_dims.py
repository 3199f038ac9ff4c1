"""Sequence-major models in a step: the batch dim is read from torch's own modules (or the
step's ``batch_dim=``), never guessed from a size.

torch's ``nn.TransformerEncoderLayer(batch_first=False)`` runs ``(seq, batch, d)``
activations and ``nn.LSTM``'s dropout between layers runs on ``(seq, batch, hidden)``
(with ``batch_first=True`` too). The cases below make the sequence exactly as long as a
rank's batch, where taking dim 0 for the batch raised nothing before and drew sequence
positions as rows. Eagerly, ranks holding halves of the batch (rows dealt explicitly,
no process group) must produce the one process's output, and without the module rules
they refuse or differ (the test can fail); on real gloo ranks, 3 training steps under
DDP=2 with 2 microbatches give the one process's losses.

The batch is outermost in the counters whichever dim holds it (contract §3.5): a
sequence-major draw is its batch-first transpose's, against the scalar reference. Compiled
batched graphs draw the step's declared dim too (a constant of the graph, refused in a
step that declares another) and give the eager step's values for halves of the batch,
interleaved rows and, on gloo ranks, DDP=2 with microbatches. They read torch's modules
(a layer's ``batch_first``) from the frame Dynamo compiled; where they cannot, the shapes
they cannot tell apart are refused at compile time or, with dynamic sizes, per call.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
from dtensor_reference import fake_rank
from torch.distributed.device_mesh import DeviceMesh
import torch.nn.functional as F
from torch import nn

import compile_rng
from compile_rng._torch import dynamo_internals
from compile_rng.eager import batch_dims
from compile_rng.launch import spawn

SEQ, BATCH, D = 4, 8, 8  # the sequence as long as a rank's half of the batch


class SequenceMajor(nn.Module):
    """torch's sequence-major building blocks, float64: a Transformer encoder
    (``batch_first=False``; its attention's dropout is batch-major), a 2-layer LSTM with
    dropout between layers (``batch_first=True``: its dropout is sequence-major anyway),
    and the user's own dropout on ``(seq, batch, d)`` (the step's ``batch_dim=1``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.2, batch_first=False, dtype=torch.float64)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lstm = nn.LSTM(D, D, num_layers=2, dropout=0.3, batch_first=True, dtype=torch.float64)
        self.head = nn.Linear(D, 1, dtype=torch.float64)

    def forward(self, x):  # x: (seq, batch, d)
        h = self.encoder(x)
        h, _ = self.lstm(h.transpose(0, 1))  # batch-first for the LSTM's input
        h = F.dropout(h.transpose(0, 1), 0.25)  # the user's own: (seq, batch, d)
        return self.head(h).squeeze(-1)  # (seq, batch)


def _input(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(seq, batch, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _in_step(model, x, rows=None):
    compile_rng.manual_seed(3)
    local = x.shape[1]
    arguments = {} if rows is None else {"global_batch": BATCH, "rows": rows}
    with compile_rng.step(local, batch_dim=1, **arguments):
        return model(x)


def _batched():
    return compile_rng.backend(layout="invariant", batched=True)


def test_ranks_holding_halves_of_the_batch_compute_the_one_process_output():
    model = SequenceMajor().train()
    x = _input()
    whole = _in_step(model, x)
    half = BATCH // 2
    halves = [_in_step(model, x[:, r * half:(r + 1) * half], list(range(r * half, (r + 1) * half))) for r in range(2)]
    assert (torch.cat(halves, dim=1) - whole).abs().max() < 1e-12
    # every dropout drew: without them the halves would agree by construction
    compile_rng.manual_seed(3)
    assert not torch.equal(model.eval()(x), whole)


def test_without_the_modules_rules_the_step_refuses_or_differs(monkeypatch):
    model = SequenceMajor().train()
    x = _input()
    whole = _in_step(model, x)
    monkeypatch.setattr(batch_dims, "RULES_BY_CODE", {})
    # the user's batch_dim=1 now applies to the LSTM's dropout (dim 1 of its (seq, batch, h)
    # still the batch) and to the encoder's attention dropout ((batch, heads, L, S): not)
    with pytest.raises(NotImplementedError, match="dim 1 must be the batch .the step's batch_dim."):
        _in_step(model, x)
    # dim 0 for everything: the sequence is taken for the rows of the half batch (S == 4
    # rows), silently, as before - the values differ from the one process's
    half = BATCH // 2
    compile_rng.manual_seed(3)
    with compile_rng.step(half, global_batch=BATCH, rows=list(range(half))):
        guessed = model(x[:, :half])
    assert not torch.allclose(guessed, whole[:, :half])


def test_a_declared_batch_dim_is_checked():
    with pytest.raises(ValueError, match="batch_dim must be 0 or 1"):
        with compile_rng.step(2, batch_dim=2):
            pass
    with pytest.raises(NotImplementedError, match=r"shape \(3, 5\).*dim 1 must be the batch .the step's batch_dim."):
        with compile_rng.step(2, batch_dim=1):
            F.dropout(torch.ones(3, 5), 0.5)


P = 0.5


def draws(x):
    """Two dropouts and a uniform: the second op's base depends on the global batch."""
    return F.dropout(F.dropout(torch.ones_like(x), P), P) + torch.rand_like(x)


def _draws_in_step(fn, x, batch_dim, rows=None, mesh=None):
    compile_rng.manual_seed(5)
    batch = x.shape[batch_dim]
    arguments = {} if rows is None else {"global_batch": BATCH, "rows": rows}
    if mesh is not None:
        arguments = {"global_batch": BATCH, "data_parallel": mesh, "rows": "interleaved"}
    with compile_rng.step(batch, batch_dim=batch_dim, **arguments):
        return fn(x)


@pytest.fixture(scope="module")
def compiled_draws():
    """One batched backend for every call below (halves, interleaved ranks, both dims)."""
    torch._dynamo.reset()
    return torch.compile(draws, backend=_batched())


def test_a_sequence_major_draw_is_its_batch_first_transpose_at_the_reference_counters(compiled_draws):
    seq = 3
    x = torch.zeros(seq, BATCH, D, dtype=torch.float64)
    eager = _draws_in_step(draws, x, 1)
    # the scalar reference: element (s, b, d) takes counter b * seq * D + s * D + d of each op's range
    n = BATCH * seq * D
    keep = [torch.tensor([ref.keep_bernoulli(5, k * n + i, 1 - P) for i in range(n)]).view(BATCH, seq, D) for k in (0, 1)]
    uniform = torch.tensor([ref.uniform01(5, 2 * n + i, "float64") for i in range(n)], dtype=torch.float64)
    expected = (keep[0] & keep[1]) * (1 / (1 - P)) ** 2 + uniform.view(BATCH, seq, D)
    assert torch.equal(eager, expected.transpose(0, 1))
    assert compile_rng.get_state() == (5, 3 * n)
    assert torch.equal(_draws_in_step(draws, x.transpose(0, 1).contiguous(), 0), expected)
    assert torch.equal(_draws_in_step(compiled_draws, x, 1), eager)


def test_compiled_sequence_major_ranks_assemble_to_the_eager_step(compiled_draws):
    seq = 3
    x = torch.zeros(seq, BATCH, D, dtype=torch.float64)
    whole = _draws_in_step(draws, x, 1)
    half = BATCH // 2
    halves = [_draws_in_step(compiled_draws, x[:, r * half:(r + 1) * half], 1, list(range(r * half, (r + 1) * half)))
              for r in range(2)]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    interleaved = []
    for rank in range(2):  # DistributedSampler's rows: every other one
        with fake_rank(rank, 2):
            interleaved.append(_draws_in_step(compiled_draws, x[:, rank::2], 1, mesh=DeviceMesh("cpu", [0, 1])))
    assert torch.equal(torch.stack(interleaved, dim=2).flatten(1, 2), whole)


def test_torch_sequence_major_modules_compiled_give_the_eager_step():
    torch._dynamo.reset()
    model = SequenceMajor().train()
    compiled = torch.compile(model, backend=_batched())
    x = _input(seq=5)  # a sequence of another length than the batch or a half of it
    whole = _in_step(model, x)
    assert (_in_step(compiled, x) - whole).abs().max() < 1e-12
    half = BATCH // 2
    halves = [_in_step(compiled, x[:, r * half:(r + 1) * half], list(range(r * half, (r + 1) * half))) for r in range(2)]
    assert (torch.cat(halves, dim=1) - whole).abs().max() < 1e-12
    compile_rng.manual_seed(3)
    assert not torch.equal(model.eval()(x), whole)  # the dropouts drew


def test_a_compiled_batched_graph_reads_torchs_layer_or_refuses_what_it_cannot_tell(monkeypatch):
    """A sequence as long as the batch: the graph reads the layer from the compiled frame
    and draws the eager step's values. Where it cannot read it (no frame), it cannot tell
    the batch dim from the sizes and refuses, at compile time or, dynamic, per call."""
    torch._dynamo.reset()
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.2, batch_first=False, dtype=torch.float64).train()
    x = _input(seq=BATCH)
    steps = []
    for model in (layer, torch.compile(layer, backend=_batched())):
        compile_rng.manual_seed(3)
        with compile_rng.step(BATCH, batch_dim=1):
            steps.append((model(x), compile_rng.get_state()))
    assert steps[0][1] == steps[1][1] and (steps[0][0] - steps[1][0]).abs().max() < 1e-12
    monkeypatch.setattr(dynamo_internals, "compiling_scopes", lambda: None)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=_batched())
    with pytest.raises(Exception, match="cannot tell which dim is the batch"):
        with compile_rng.step(BATCH, batch_dim=1):
            compiled(_input(seq=BATCH))
    # dynamic sizes: the sequence differs from the batch when the graph compiles, not later
    torch._dynamo.reset()
    dynamic = torch.compile(layer, backend=_batched(), dynamic=True)
    with compile_rng.step(BATCH, batch_dim=1):
        dynamic(_input(seq=5))
    with pytest.raises(Exception, match="cannot tell which dim is the batch.*this call's sizes"):
        with compile_rng.step(BATCH, batch_dim=1):
            dynamic(_input(seq=BATCH))
    # SDPA's (batch, heads, L, S) dropout in a step that declares batch_dim=1
    torch._dynamo.reset()
    attention = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), backend=_batched())
    with pytest.raises(Exception, match="cannot tell whether this op is sequence-major"):
        with compile_rng.step(BATCH, batch_dim=1):
            attention(torch.ones(BATCH, BATCH, 3, 4))


class _Layer(nn.TransformerEncoderLayer):
    """A model's own layer class on torch's: its methods, so its layout, are torch's."""


def _layers(seq: int, cls: type = nn.TransformerEncoderLayer) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A batch-first and a sequence-first ``cls`` with one set of weights, and a ``(batch,
    seq, d)`` input."""
    torch.manual_seed(0)
    first = cls(D, 2, 16, dropout=0.3, batch_first=True, dtype=torch.float64).train()
    major = cls(D, 2, 16, dropout=0.3, batch_first=False, dtype=torch.float64).train()
    major.load_state_dict(first.state_dict())
    return first, major, torch.randn(BATCH, seq, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


def _layer_in_step(layer, x, batch_dim=0):
    compile_rng.manual_seed(3)
    with compile_rng.step(BATCH, batch_dim=batch_dim):
        return layer(x), compile_rng.get_state()


@pytest.mark.parametrize("seq, cls", [(5, nn.TransformerEncoderLayer), (BATCH, nn.TransformerEncoderLayer), (BATCH, _Layer)])
def test_a_batch_first_layer_draws_its_sequence_major_twins_masks(seq, cls):
    """``TransformerEncoderLayer(batch_first=True)`` keeps ``batch_first`` only in its
    attention: the layer's rule read the layer, found nothing and took dim 1 for the batch -
    refused for a sequence of 5, other masks silently where the sequence is as long as the
    batch. Now the batch-first layer on ``(batch, seq, d)`` is its sequence-first twin on the
    transpose, eagerly and in a batched graph (which reads the module from the compiled
    frame: the sequence as long as the batch is no longer refused). A subclass of torch's
    layer (its methods torch's) was taken for no layout module when compiled: batch-major,
    where eager code draws it sequence-major - other masks, silently."""
    first, major, x = _layers(seq, cls)
    want, state = _layer_in_step(major, x.transpose(0, 1))
    got, got_state = _layer_in_step(first, x)
    assert got_state == state and torch.equal(got, want.transpose(0, 1))
    torch._dynamo.reset()
    compiled, compiled_state = _layer_in_step(torch.compile(first, backend=_batched()), x)
    assert compiled_state == state and (compiled - got).abs().max() < 1e-12
    torch._dynamo.reset()
    compiled, compiled_state = _layer_in_step(torch.compile(major, backend=_batched()), x.transpose(0, 1))
    assert compiled_state == state and (compiled - want).abs().max() < 1e-12
    first.eval()
    assert not torch.allclose(first(x), got)  # the dropouts drew


def test_a_graph_without_batched_refuses_a_batch_not_at_dim_0():
    """A graph compiled without ``batched=True`` draws row-major at its call's counters: in a
    step over the whole batch that is eager code's draw only where the batch is dim 0. A
    step's ``batch_dim=1`` or a sequence-first torch layer drew other values, silently; both
    are refused now, and the batch-first layer still runs."""
    first, major, x = _layers(5)
    torch._dynamo.reset()
    plain = compile_rng.backend(layout="invariant")
    with pytest.raises(NotImplementedError, match=r"batch is not dim 0 \(aten.native_dropout.default at .*dim 1"):
        _layer_in_step(torch.compile(major, backend=plain), x.transpose(0, 1))
    torch._dynamo.reset()
    dropout = torch.compile(lambda t: F.dropout(t, 0.5), backend=plain)
    with pytest.raises(NotImplementedError, match="batch is not dim 0"):
        _layer_in_step(dropout, torch.ones(3, BATCH), batch_dim=1)
    torch._dynamo.reset()
    got, state = _layer_in_step(torch.compile(first, backend=plain), x)
    want, want_state = _layer_in_step(first, x)
    assert state == want_state and (got - want).abs().max() < 1e-12


def test_a_compiled_batch_dim_is_a_constant_of_the_graph():
    torch._dynamo.reset()
    dropout = torch.compile(lambda t: F.dropout(t, 0.5), backend=_batched())
    with compile_rng.step(BATCH, batch_dim=1):
        dropout(torch.ones(3, BATCH))
    with pytest.raises(NotImplementedError, match="compiled in a step with batch_dim=1 and runs in one with batch_dim=0"):
        with compile_rng.step(3):
            dropout(torch.ones(3, BATCH))


# --- real ranks ----------------------------------------------------------------------------

STEPS = 3


def _train(rank: int, world: int, microbatches: int, out: str, compiled: bool = False, seq: int = SEQ) -> None:
    import torch.distributed as dist

    model = SequenceMajor().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model, backend=_batched()) if compiled else model
    data = torch.randn(STEPS, seq, BATCH, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    local = BATCH // world
    losses = []
    compile_rng.manual_seed(7)
    for s in range(STEPS):
        x = data[s, :, rank * local:(rank + 1) * local]
        total = torch.zeros((), dtype=torch.float64)
        with compile_rng.step(local, data_parallel=dist.group.WORLD if world > 1 else None, batch_dim=1) as st:
            for m in range(microbatches):
                part = local // microbatches
                with st.microbatch(part):
                    loss = forward(x[:, m * part:(m + 1) * part]).square().sum() / (seq * BATCH)
                    loss.backward()
                    total += loss.detach()
        for p in model.parameters():
            if world > 1:
                dist.all_reduce(p.grad)
        if world > 1:
            dist.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
    if rank == 0:
        torch.save(losses, out)


def test_ddp_and_microbatches_train_the_one_process_curve(tmp_path):
    one = str(tmp_path / "one")
    _train(0, 1, 1, one)
    ddp = str(tmp_path / "ddp")
    spawn(_train, 2, 2, ddp)
    single, parallel = torch.load(one), torch.load(ddp)
    assert max(abs(a - b) / abs(b) for a, b in zip(parallel, single)) < 1e-9


@pytest.mark.slow
def test_compiled_ddp_and_microbatches_train_the_one_process_eager_curve(tmp_path):
    seq = 5  # a sequence of another length than any rank's or microbatch's rows
    one = str(tmp_path / "one")
    _train(0, 1, 1, one, False, seq)
    ddp = str(tmp_path / "ddp")
    spawn(_train, 2, 2, ddp, True, seq)
    single, parallel = torch.load(one), torch.load(ddp)
    assert max(abs(a - b) / abs(b) for a, b in zip(parallel, single)) < 1e-9
