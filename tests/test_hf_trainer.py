"""The Hugging Face Trainer and plain accelerate loops keep one process's curve.

``compile_rng.TrainerMixin`` (one line: a base class before ``transformers.Trainer``) and
``compile_rng.accelerate_batches`` (the loader, wrapped) put every optimizer step in a
``compile_rng.step`` whose microbatches draw at the rows accelerate's loader dealt. The
slow test trains transformers' BERT classifier (float64, dropout 0.1) with the Trainer
(also with ``gradient_checkpointing=True``) and with an ``accelerator.accumulate`` loop, under ``torchrun --nproc-per-node 2`` and on
one process, with and without gradient accumulation (``examples/hf_trainer_parity.py``):
every step's loss within 1e-9 of the loop's one process with the integration, and apart
without it (the test can fail). The fast tests check the rows against accelerate's own
``BatchSamplerShard`` - an independent derivation - and the refusals.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

import compile_rng
from compile_rng.integrations import accelerate_rows

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_trainer_parity as hf  # noqa: E402

TOLERANCE = 1e-9


@pytest.mark.slow
def test_trainer_and_accelerate_loops_keep_the_single_process_curve():
    configs = list(hf.CONFIGS)
    runs = [(loop, name, True) for loop in hf.LOOPS for name in configs]
    runs += [(loop, name, False) for loop in hf.LOOPS for name in ("one process", "DDP=2", "DDP=2, accumulation 2")]
    cells = hf.table(runs)
    for (loop, name, parity), difference in sorted(cells.items()):
        print(f"hf_trainer {loop:10} {name:30} {'compile_rng' if parity else 'stock':12} {difference:.1e}")
    assert all(d < TOLERANCE for (_, _, parity), d in cells.items() if parity)
    assert all(d > 1e-6 for (_, _, parity), d in cells.items() if not parity)  # other masks: it can fail


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_the_forwards_masks(tmp_path):
    """The checkpointed Trainer's curves above are compared with its own one process; this
    ties that one process to the Trainer without checkpointing: the same curve (a
    recomputation drawing other masks would change every gradient, hence every later loss)."""
    runs = [("Trainer", "one process", True), ("Trainer (ckpt)", "one process", True)]
    losses = hf.run(1, runs, str(tmp_path))
    assert hf.relative(losses[runs[1]], losses[runs[0]]) < TOLERANCE


def _accelerate_order(samples: int, batch: int, world: int, accumulation: int, **shard) -> list[list[list[int]]]:
    """Per optimizer step, per rank: the sample indices accelerate's ``BatchSamplerShard``
    deals each rank, ``accumulation`` batches a step."""
    from accelerate.data_loader import BatchSamplerShard

    per_rank = []
    for rank in range(world):
        sampler = BatchSampler(SequentialSampler(range(samples)), batch * (world if shard.get("split_batches") else 1), False)
        per_rank.append(list(BatchSamplerShard(sampler, world, rank, **shard)))
    steps = -(-max(len(b) for b in per_rank) // accumulation)
    return [[sum(b[s * accumulation:(s + 1) * accumulation], []) for b in per_rank] for s in range(steps)]


@pytest.mark.parametrize("shard", [{}, {"split_batches": True}, {"even_batches": False}])
def test_positions_are_where_accelerate_deals_the_samples(shard):
    """One process reading the sampler in order reads sample ``v mod N`` ``v``-th (the
    wrap-around is accelerate's padding of the last round); every rank's positions must
    name the samples accelerate really dealt it."""
    samples, world, batch, accumulation = 23, 3, 2, 2
    read = 0  # samples one process has read before this step
    for step in _accelerate_order(samples, batch, world, accumulation, **shard):
        sizes = [[len(dealt[i:i + batch]) for i in range(0, len(dealt), batch)] for dealt in step]
        for rank, dealt in enumerate(step):
            positions = accelerate_rows.positions(sizes, rank)
            assert [(read + p) % samples for p in positions] == dealt, (shard, rank)
        read += sum(map(len, step))
    assert read >= samples


class _Loop:
    """What TrainerMixin needs of ``transformers.Trainer`` (one process): its batch fetch
    and a training step that draws dropout."""

    accelerator = type("Accelerator", (), {"num_processes": 1, "process_index": 0, "device": "cpu"})()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return [b for _, b in zip(range(num_batches), epoch_iterator)], None

    def training_step(self, model, inputs, num_items_in_batch=None):
        return torch.nn.functional.dropout(inputs["x"], 0.5)


def test_the_mixin_draws_each_microbatch_at_its_rows_of_the_step():
    trainer = type("Trainer", (compile_rng.TrainerMixin, _Loop), {})()
    x = torch.ones(8, 16, dtype=torch.float64)
    batches = iter([{"x": x[:3]}, {"x": x[3:]}, {"x": x[:4]}])
    compile_rng.manual_seed(0)
    step, _ = trainer.get_batch_samples(batches, 2, "cpu")  # an optimizer step of 3 + 5 rows
    masks = torch.cat([trainer.training_step(None, b) for b in step])
    compile_rng.manual_seed(0)
    with compile_rng.step(8):
        whole = torch.nn.functional.dropout(x, 0.5)  # one process, the step's 8 rows at once
    assert torch.equal(masks, whole)
    (last,), _ = trainer.get_batch_samples(batches, 2, "cpu")  # the last, short step
    trainer.training_step(None, last)
    assert trainer.get_batch_samples(batches, 2, "cpu")[0] == []  # no data left: no step stays open
    assert trainer._compile_rng_step is None


def test_refusals():
    data = TensorDataset(torch.zeros(10, 3))
    with pytest.raises(NotImplementedError, match="not sharded by accelerate"):
        accelerate_rows.check_dealt_by_rounds(DataLoader(data, batch_size=2), world=2)
    accelerate_rows.check_dealt_by_rounds(DataLoader(data, batch_size=2), world=1)
    from accelerate.data_loader import BatchSamplerShard

    per_rank = DistributedSampler(data, num_replicas=2, rank=0)  # a custom sampler that shards by itself
    sharded = DataLoader(data, batch_sampler=BatchSamplerShard(BatchSampler(per_rank, 2, False), 2, 0))
    with pytest.raises(NotImplementedError, match="DistributedSampler"):
        accelerate_rows.check_dealt_by_rounds(sharded, world=2)
    plain = DataLoader(data, batch_sampler=BatchSamplerShard(BatchSampler(SequentialSampler(data), 2, False), 2, 0))
    accelerate_rows.check_dealt_by_rounds(plain, world=2)
    from accelerate.data_loader import SkipBatchSampler

    resumed = DataLoader(data, batch_sampler=SkipBatchSampler(plain.batch_sampler, 2))  # skip_first_batches
    accelerate_rows.check_dealt_by_rounds(resumed, world=2)
    rebalanced = BatchSamplerShard(BatchSampler(SequentialSampler(data), 2, False), 2, 0)
    rebalanced.num_processes = 1  # the Trainer's batch_rebalance: its sampler picks each rank's samples
    with pytest.raises(NotImplementedError, match="batch_rebalance"):
        accelerate_rows.check_dealt_by_rounds(DataLoader(data, batch_sampler=rebalanced), world=2)
    uneven = BatchSamplerShard(BatchSampler(SequentialSampler(data), 2, False), 2, 0, even_batches=False)
    accelerate_rows.check_dealt_by_rounds(DataLoader(data, batch_sampler=uneven), world=2)  # the Trainer's gather copes
    with pytest.raises(NotImplementedError, match="even_batches=False"):  # accelerate_batches cannot
        accelerate_rows.check_dealt_by_rounds(DataLoader(data, batch_sampler=uneven), world=2, even=True)

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(data, batch_size=4))  # 10 rows: the last batch holds 2
    with pytest.raises(NotImplementedError, match="batch 2 holds 2 rows"):
        for _ in compile_rng.accelerate_batches(accelerator, loader):
            pass
    with pytest.raises(RuntimeError, match="outside the Trainer's training loop"):
        type("T", (compile_rng.TrainerMixin, object), {})().training_step(None, {})
    assert accelerate_rows.rows_of({"input_ids": torch.zeros(5, 2), "labels": torch.zeros(5)}) == 5
    from transformers import BatchEncoding  # the Trainer's DataCollatorWithPadding: a UserDict

    assert accelerate_rows.rows_of(BatchEncoding({"input_ids": torch.zeros(3, 2)})) == 3
