"""Any data sharding keeps the single process's curve: ``compile_rng.step(rows=...)``.

``DistributedSampler`` (PyTorch's DDP tutorial; shuffle off and on) and
``datasets.distributed.split_dataset_by_node`` on a streaming dataset deal rank ``r`` of
``W`` the samples ``r, r + W, ...``: interleaved, not a contiguous block. On 2 gloo ranks,
eager GPT of ``examples/train_parity.py`` (attention, residual and MLP dropout), float64,
AdamW, one epoch whose last batch is uneven (the stream's: 3 rows on one rank, 2 on the
other): with ``rows="interleaved"`` every step's loss is within 1e-9 relative of one
process reading the same data in batches of the global size; with the default
(contiguous) rows each sample draws another row's masks and the curve drifts (the test
can fail). The model compiled as a batched graph keeps the curve too (shuffle on).
Explicit positions (this rank's global rows) are checked to cover the batch once, and a
compiled batched graph draws them as eager code does.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import compile_rng
from compile_rng.launch import spawn
from compile_rng.semantics.rows import Rows

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import train_parity as tp  # noqa: E402

WORLD, BATCH = 2, 4  # data-parallel ranks, rows per rank per step
SAMPLES = {"sampler": 22, "sampler-shuffle": 22, "stream": 21}  # 21: the stream's last batch is 3 + 2 rows
TOLERANCE = 1e-9


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = tp.Config()
    data = torch.randint(0, c.vocab, (n, c.seq + 1), generator=torch.Generator().manual_seed(7))
    return data[:, :-1], data[:, 1:]


class Interleaved(IterableDataset):
    """A stream split as ``datasets.distributed.split_dataset_by_node`` splits an iterable
    dataset: rank ``r`` keeps examples ``r, r + world, ...``."""

    def __init__(self, tokens, targets, rank: int, world: int):
        self.tokens, self.targets, self.rank, self.world = tokens, targets, rank, world

    def __iter__(self):
        for i in range(self.rank, len(self.tokens), self.world):
            yield self.tokens[i], self.targets[i]


def _loader(kind: str, rank: int, world: int) -> DataLoader:
    tokens, targets = _data(SAMPLES[kind])
    if kind == "stream":
        return DataLoader(Interleaved(tokens, targets, rank, world), batch_size=BATCH * WORLD // world)
    data = TensorDataset(tokens, targets)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=kind == "sampler-shuffle", seed=0)
    return DataLoader(data, batch_size=BATCH * WORLD // world, sampler=sampler)  # drop_last=False


def train(kind: str, rank: int, world: int, rows: str = "contiguous", compiled: bool = False) -> list[float]:
    """One epoch; per step the global batch's mean loss. Each rank's loss is its rows' sum
    over the global row count and gradients are summed over ranks, so uneven batches give
    the single process's gradient. ``compiled``: the model compiled as a batched graph."""
    model = tp.make_model(tp.Config(), torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=tp.Config().lr)
    run = torch.compile(model, backend=compile_rng.backend(layout="invariant", batched=True)) if compiled else model
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(tp.SEED)
    losses = []
    for tokens, targets in _loader(kind, rank, world):
        count = torch.tensor(float(tokens.shape[0]), dtype=torch.float64)
        if group is not None:
            dist.all_reduce(count)
        with compile_rng.step(tokens.shape[0], data_parallel=group, rows=rows):
            logits = run(tokens)
            per_row = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
            loss = per_row.sum() / count
            loss.backward()
        total = loss.detach().clone()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
            dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return losses


def _body(rank: int, world: int, out: str) -> None:
    results = {(kind, rows): train(kind, rank, world, rows) for kind in SAMPLES for rows in ("interleaved", "contiguous")}
    if rank == 0:
        torch.save(results, out)


def _relative(curve, reference) -> float:
    assert len(curve) == len(reference) == 3  # 22 or 21 samples in global batches of 8: 8, 8, 6 / 5
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


@pytest.fixture(scope="module")
def on_two_ranks() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curves.pt")
        spawn(_body, WORLD, out)
        return torch.load(out)


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_interleaved_loaders_keep_the_single_process_curve(kind, on_two_ranks):
    reference = train(kind, 0, 1)
    interleaved = _relative(on_two_ranks[(kind, "interleaved")], reference)
    contiguous = _relative(on_two_ranks[(kind, "contiguous")], reference)
    print(f"data_loaders {kind}: rows='interleaved' {interleaved:.2e}, contiguous (wrong for this loader) {contiguous:.2e}")
    assert interleaved < TOLERANCE
    assert contiguous > 1e-6  # the masks of other rows: the comparison can fail


def _compiled_body(rank: int, world: int, out: str) -> None:
    losses = train("sampler-shuffle", rank, world, "interleaved", compiled=True)
    if rank == 0:
        torch.save(losses, out)


@pytest.mark.slow
def test_a_compiled_model_under_a_shuffling_sampler_keeps_the_single_process_curve():
    """GPT compiled as a batched graph (Inductor) on 2 gloo ranks under
    ``DistributedSampler(shuffle=True)``: each rank's graph draws every other row of the
    global batch (a stride it compiled with), the uneven last batch included."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curve.pt")
        spawn(_compiled_body, WORLD, out)
        curve = torch.load(out)
    difference = _relative(curve, train("sampler-shuffle", 0, 1))
    print(f"data_loaders sampler-shuffle, compiled, rows='interleaved': {difference:.2e}")
    assert difference < TOLERANCE


# --- the rows a step assigns (fake process group: no communication needed) ----------------


def test_dealt_rows_with_a_given_global_batch():
    from dtensor_reference import fake_rank

    for coord in range(3):
        with fake_rank(coord, 3):
            interleaved = compile_rng.step(4 if coord < 2 else 3, data_parallel=dist.group.WORLD,
                                           global_batch=11, rows="interleaved")
            with interleaved as s:
                assert s.rows == Rows(coord, 4 if coord < 2 else 3, 11, 3)
                with s.microbatch(2) as first:
                    pass
                with s.microbatch(s.rows.count - 2) as second:
                    pass
                assert (first.start, second.start) == (coord, coord + 6)  # local rows 0-1, then 2-


def test_explicit_positions_and_what_is_refused():
    with compile_rng.step(3, global_batch=9, rows=[2, 5, 8]) as s:
        assert s.rows == Rows(2, 3, 9, 3)
    # positions that are not evenly spaced draw one evenly spaced microbatch at a time
    x = torch.ones(4, 16, dtype=torch.float64)
    compile_rng.manual_seed(0)
    with compile_rng.step(4, global_batch=8, rows=[0, 1, 4, 5]) as s:
        with pytest.raises(NotImplementedError, match="not evenly spaced"):
            F.dropout(x, 0.5)
        with s.microbatch(2) as first:
            first_mask = F.dropout(x[:2], 0.5)
        with s.microbatch(2) as second:
            second_mask = F.dropout(x[2:], 0.5)
    assert (first, second) == (Rows(0, 2, 8), Rows(4, 2, 8))
    compile_rng.manual_seed(0)
    with compile_rng.step(8):  # the same rows of one step over the whole batch
        everything = F.dropout(torch.ones(8, 16, dtype=torch.float64), 0.5)
    assert torch.equal(first_mask, everything[:2]) and torch.equal(second_mask, everything[4:6])
    assert not torch.equal(first_mask, everything[2:4])  # the comparison can fail
    with pytest.raises(ValueError, match="not distinct rows"):
        with compile_rng.step(3, global_batch=9, rows=[0, 1, 1]):
            pass
    with pytest.raises(ValueError, match="not distinct rows"):
        with compile_rng.step(3, global_batch=6, rows=[2, 5, 8]):
            pass
    with pytest.raises(ValueError, match="rows='sideways'"):
        with compile_rng.step(3, rows="sideways"):
            pass
    # a compiled batched graph draws explicit, evenly spaced positions as eager code does
    torch._dynamo.reset()
    fn = torch.compile(lambda x: F.dropout(x, 0.5), backend=compile_rng.backend(layout="invariant", batched=True))
    x = torch.ones(3, 16, dtype=torch.float64)
    for run in (fn, lambda t: F.dropout(t, 0.5)):
        compile_rng.manual_seed(0)
        with compile_rng.step(3, global_batch=9, rows=[2, 5, 8]):
            got = run(x)
        compile_rng.manual_seed(0)
        with compile_rng.step(9):
            whole = F.dropout(torch.ones(9, 16, dtype=torch.float64), 0.5)
        assert torch.equal(got, whole[2::3])
