"""PyTorch Lightning keeps one device's curve: ``compile_rng.LightningCallback``.

The slow test trains ``examples/lightning_parity.py``'s MLP with dropout (float64) with
``lightning.Trainer``: one device with ``accumulate_grad_batches=2``, ``strategy="ddp"``
on 2 CPU ranks (Lightning's own launcher and ``DistributedSampler``: interleaved rows),
with and without accumulation. Every step's loss within 1e-9 of one device's with the
callback; stock Lightning under DDP draws other masks (the test can fail). Resumed from a
Lightning checkpoint after the first epoch in a fresh process (one device, DDP=2), the
second epoch's losses equal the uninterrupted run's bitwise, and differ with the
callback's state taken out of the checkpoint; without ``resume_without_state`` such a
checkpoint is refused.
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import lightning_parity as lp  # noqa: E402


@pytest.mark.slow
def test_ddp_and_accumulation_keep_one_devices_curve():
    cells = lp.table(lp.RUNS)
    for (name, parity, resume), difference in sorted(cells.items()):
        print(f"lightning {name:30} {'compile_rng' if parity else 'stock':12} {resume:24} {difference:.1e}")
    assert all(d < 1e-9 for (_, parity, resume), d in cells.items() if parity and not resume)
    # stock Lightning under DDP: each rank draws from its own generator (on one device,
    # torch's CPU generator draws two half batches as one batch, so accumulation agrees)
    assert all(d > 1e-6 for (name, parity, _), d in cells.items() if not parity and "DDP" in name)
    assert all(d == 0.0 for (_, _, resume), d in cells.items() if resume == "load")
    assert all(d > 1e-6 for (_, _, resume), d in cells.items() if resume == "load without the stream")


def test_a_checkpoint_without_the_stream_is_refused(tmp_path, monkeypatch):
    import lightning
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import compile_rng
    from compile_rng.stream.checkpointing import MissingStreamState

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monkeypatch.chdir(tmp_path)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)
    stock = lightning.Trainer(max_epochs=1, **quiet)
    stock.fit(Model(), loader)
    stock.save_checkpoint(tmp_path / "stock.ckpt")
    resumed = lightning.Trainer(max_epochs=2, callbacks=[compile_rng.LightningCallback()], **quiet)
    with pytest.raises(MissingStreamState, match="holds no compile_rng state"):
        resumed.fit(Model(), loader, ckpt_path=tmp_path / "stock.ckpt")


def test_the_steps_rows_are_the_distributed_samplers():
    """Rank 1 of 2, batches of 2, two per step: rows 1, 3 of the first batch's 4 and
    5, 7 of the second's, in a global batch of 8."""
    from compile_rng.integrations.lightning_callback import LightningCallback

    callback = LightningCallback()
    callback._sizes, callback._world, callback._rank, callback._every = [2, 2, 2], 2, 1, 2
    rows = callback._open(0).rows  # 1, 3, 5, 7: evenly spaced, so one stride
    assert (rows.start, rows.count, rows.total, rows.stride) == (1, 4, 8, 2)
    assert [(r.start, r.count, r.stride) for r in (rows.sub(0, 2), rows.sub(2, 2))] == [(1, 2, 2), (5, 2, 2)]
    last = callback._open(2)  # the epoch's last, shorter group
    assert (last.rows.start, last.rows.count, last.rows.total, last.rows.stride) == (1, 2, 4, 2)
