"""PyTorch Lightning keeps one device's loss curve under DDP and gradient accumulation.

A small MLP with dropout (p=0.3, float64) trains for 10 optimizer steps of a global batch
of 8 samples (two epochs of 40, shuffled) with ``lightning.Trainer`` on the CPU. Under DDP
Lightning gives the loader a ``DistributedSampler`` (shuffled with the seed
``seed_everything`` set, reshuffled per epoch); the one-device runs read the same order
through a one-replica ``DistributedSampler``, so every configuration sees the same global
batches:

* ``one device``: batches of 8;
* ``one device, accumulation 2``: ``accumulate_grad_batches=2``, batches of 4;
* ``DDP=2`` (``strategy="ddp"``, ``devices=2``, gloo): 4 samples per rank, dealt by the
  ``DistributedSampler`` Lightning gives the loader (rank ``r`` reads samples ``r, r + 2,
  ...``: interleaved rows of each global batch);
* ``DDP=2, accumulation 2``: 2 samples per rank and batch.

The user's one line: ``callbacks=[compile_rng.LightningCallback()]``. With it every
configuration trains the one device's curve (every step's loss, float64); without it
(stock Lightning) each draws other dropout masks and the curves part.

Run: ``python examples/lightning_parity.py`` (the table; about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

from _cli import rank_or_table

SAMPLES, GLOBAL_BATCH, STEPS, DIM = 40, 8, 10, 16
CONFIGS = {  # name: (devices, per-device batch, accumulate_grad_batches)
    "one device": (1, 8, 1),
    "one device, accumulation 2": (1, 4, 2),
    "DDP=2": (2, 4, 1),
    "DDP=2, accumulation 2": (2, 2, 2),
}


def _losses(name: str, parity: bool, resume: str = "") -> list[float]:
    """Every optimizer step's loss, the mean over the global batch. ``resume``: "save"
    trains the first epoch and saves a Lightning checkpoint (in the working folder); "load" resumes it for the second; "load without the stream" does so with
    the callback's state taken out of the checkpoint (the control: the callback refuses
    such a checkpoint unless told ``resume_without_state``)."""
    import lightning
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import compile_rng

    devices, batch, accumulation = CONFIGS[name]

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1)).double()
            self.step_loss, self.losses = 0.0, []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = (self.net(x).squeeze(-1) - y).square().mean()
            self.step_loss = self.step_loss + loss.detach() / accumulation
            return loss

        def on_before_optimizer_step(self, optimizer):
            total = torch.as_tensor(self.step_loss, dtype=torch.float64).clone()
            if dist.is_initialized():
                dist.all_reduce(total)
                total /= dist.get_world_size()
            self.losses.append(total.item())
            self.step_loss = 0.0

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    lightning.seed_everything(0, verbose=False)
    model = Model()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, DIM, dtype=torch.float64, generator=g)
    data = TensorDataset(x, x.sum(-1).sin())
    epochs = STEPS * GLOBAL_BATCH // SAMPLES
    trainer = lightning.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_epochs=1 if resume == "save" else epochs, accumulate_grad_batches=accumulation,
        # the one line a user adds: the callback
        callbacks=[compile_rng.LightningCallback(resume_without_state=resume == "load without the stream")]
        if parity else [],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    if devices == 1:  # the order Lightning's DistributedSampler deals under DDP, on one replica
        loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0))
    else:  # as a user writes it: Lightning puts its DistributedSampler in
        loader = DataLoader(data, batch_size=batch, shuffle=True)
    checkpoint = os.path.abspath(f"{name}.ckpt")
    if resume == "load without the stream":
        saved = torch.load(checkpoint, weights_only=False)
        saved["callbacks"] = {}
        checkpoint = os.path.abspath(f"{name} without the stream.ckpt")
        if trainer.global_rank == 0:
            torch.save(saved, checkpoint)
        trainer.strategy.barrier() if devices > 1 else None
    trainer.fit(model, loader, ckpt_path=checkpoint if resume.startswith("load") else None)
    if resume == "save":
        trainer.save_checkpoint(checkpoint)
    return model.losses


def _train(spec: str, out: str) -> None:
    results = [[[name, parity, resume], _losses(name, parity, resume)] for name, parity, resume in json.loads(spec)]
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run(runs: list[tuple[str, bool, str]]) -> dict[tuple[str, bool, str], list[float]]:
    """The losses of ``(configuration, parity, resume)`` runs (:func:`_losses`), each
    configuration's devices in a fresh process (Lightning's DDP launcher starts the second
    rank itself); the resumes after the runs that saved their checkpoints."""
    losses = {}
    with tempfile.TemporaryDirectory() as folder:
        for phase in (("", "save"), ("load", "load without the stream")):
            for devices in (1, 2):
                mine = [r for r in runs if CONFIGS[r[0]][0] == devices and r[2] in phase]
                if not mine:
                    continue
                out = os.path.join(folder, f"losses-{devices}-{phase[0]}.json")
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                command = [sys.executable, os.path.abspath(__file__), "--train", json.dumps(mine), "--out", out]
                subprocess.run(command, check=True, env=env, cwd=folder)
                with open(out) as f:
                    losses.update({tuple(k): v for k, v in json.load(f)})
    return losses


def table(runs: list[tuple[str, bool, str]]) -> dict[tuple[str, bool, str], float]:
    """Max relative difference of each run's losses from the one device's with the same
    ``parity``, or, for a resume, from its own configuration's uninterrupted run after
    the checkpoint (the runs must include those)."""
    losses = run(runs)
    cells = {}
    for (name, parity, resume), curve in losses.items():
        if resume.startswith("load"):
            done = len(losses[(name, parity, "save")])
            reference = losses[(name, parity, "")][done:]
        elif resume == "" and name != "one device":
            reference = losses[("one device", parity, "")]
        else:
            continue
        assert len(curve) == len(reference) > 0, (name, parity, resume, len(curve))
        cells[(name, parity, resume)] = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
    return cells


#: every configuration with and without the callback; the resumes with it
RUNS = [(name, parity, "") for name in CONFIGS for parity in (True, False)] + [
    (name, True, resume) for name in ("one device", "DDP=2") for resume in ("save", "load", "load without the stream")
]


def _print_table() -> None:
    cells = table(RUNS)
    print("max relative difference of every step's loss (float64) from one device")
    print(f"{'configuration':30} {'compile_rng':>12} {'stock':>12}")
    for name in list(CONFIGS)[1:]:
        print(f"{name:30} {cells[(name, True, '')]:12.1e} {cells[(name, False, '')]:12.1e}")
    print("resumed from a Lightning checkpoint after epoch 1: max relative difference from the uninterrupted run")
    for (name, _, resume), difference in cells.items():
        if resume:
            print(f"{name:30} {resume:26} {difference:12.1e}")


def main() -> None:
    runs_help = "JSON list of [configuration, parity, resume] to run in this process"
    rank_or_table(__doc__, "--train", runs_help, _train, _print_table, out="losses.json")


if __name__ == "__main__":
    main()
