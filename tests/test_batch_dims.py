"""Sequence-major models in a step: the batch dim is read from torch's own modules (or the
step's ``batch_dim=``), never guessed from a size.

torch's ``nn.TransformerEncoderLayer(batch_first=False)`` runs ``(seq, batch, d)``
activations and ``nn.LSTM``'s dropout between layers runs on ``(seq, batch, hidden)``
(with ``batch_first=True`` too). The cases below make the sequence exactly as long as a
rank's batch, where taking dim 0 for the batch raised nothing before and drew sequence
positions as rows. Eagerly, ranks holding halves of the batch (rows dealt explicitly,
no process group) must produce the one process's output, and without the module rules
they refuse or differ (the test can fail); compiled batched graphs refuse the shape they
cannot tell; on real gloo ranks, 3 training steps under DDP=2 with 2 microbatches give
the one process's losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_rng
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


def _input(batch: int = BATCH) -> torch.Tensor:
    return torch.randn(SEQ, batch, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _in_step(model, x, rows=None):
    compile_rng.manual_seed(3)
    local = x.shape[1]
    arguments = {} if rows is None else {"global_batch": BATCH, "rows": rows}
    with compile_rng.step(local, batch_dim=1, **arguments):
        return model(x)


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


def test_a_compiled_batched_graph_refuses_what_it_cannot_tell():
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.2, batch_first=False, dtype=torch.float64).train()
    compiled = torch.compile(layer, backend=compile_rng.backend(layout="invariant", batched=True))
    torch._dynamo.reset()
    square, x = _input(SEQ), torch.ones(SEQ, BATCH)
    with pytest.raises(Exception, match="cannot tell which dim is the batch"):
        with compile_rng.step(SEQ):
            compiled(square)
    dropout = torch.compile(lambda t: F.dropout(t, 0.5), backend=compile_rng.backend(layout="invariant", batched=True))
    with pytest.raises(NotImplementedError, match="draw batch-major .dim 0. only"):
        with compile_rng.step(BATCH, batch_dim=1):
            dropout(x)


# --- real ranks ----------------------------------------------------------------------------

STEPS = 3


def _train(rank: int, world: int, microbatches: int, out: str) -> None:
    import torch.distributed as dist

    model = SequenceMajor().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(STEPS, SEQ, BATCH, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
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
                    loss = model(x[:, m * part:(m + 1) * part]).square().sum() / (SEQ * BATCH)
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
