"""PyTorch Lightning with every optimizer step in a :func:`compile_rng.step`.

One line for the user::

    trainer = lightning.Trainer(..., callbacks=[compile_rng.LightningCallback()])

Read from Lightning 2.6 (``loops/training_epoch_loop.py``), not assumed: each batch runs
between the callbacks' ``on_train_batch_start`` and ``on_train_batch_end`` (its
``training_step`` and backward; with ``accumulate_grad_batches = N`` the optimizer steps
after every ``N`` batches of an epoch, counted from its start, and after its last). So
the callback opens a step at the first batch of each group, runs each batch in its
microbatch, and closes the step after the last.

The rows: under DDP Lightning gives the loader a ``DistributedSampler`` (rank ``r`` of
``W`` reads samples ``r, r + W, ...`` of the sampler's list), so batch ``m`` of every rank
together is the ``m``-th global batch of ``W`` times the size, and rank ``r``'s rows of it
are ``r, r + W, ...`` (interleaved); on one device the loader's own sampler, in order. Every
rank's sampler holds as many samples (the sampler pads or drops to equal), so every
rank's batch sizes - and the steps' rows - are known by construction: no communication.
Strategies other than one device and DDP, and loaders without such a sampler, are
refused. The stream travels in Lightning's checkpoints as the callback's state;
``fit(ckpt_path=...)`` from a checkpoint without it raises (``resume_without_state=True``:
continue on this process's stream, with a warning).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import Callback

from compile_rng.eager.batches import Step, open_step
from compile_rng.integrations import accelerate_rows
from compile_rng.stream import checkpointing


def _sampler_and_batch(trainer: Any) -> tuple[Any, int, bool, int, int]:
    """``(sampler, batch size, drop_last, world, rank)`` of the training loader."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    loader = trainer.train_dataloader
    strategy = type(trainer.strategy).__name__
    if strategy not in ("SingleDeviceStrategy", "DDPStrategy"):
        raise NotImplementedError(
            f"compile_rng.LightningCallback: the {strategy} strategy; the callback knows the rows Lightning's "
            "single-device and DDP loaders deal. Use compile_rng.step in your own training_step otherwise"
        )
    batches = getattr(loader, "batch_sampler", None)
    if not isinstance(loader, DataLoader) or type(batches) is not BatchSampler:
        raise NotImplementedError(
            f"compile_rng.LightningCallback: the training loader ({type(loader).__name__}, batch sampler "
            f"{type(batches).__name__}) is not one DataLoader batching its sampler, so the rows of its batches "
            "are unknown"
        )
    world, rank = trainer.world_size, trainer.global_rank
    sampler = batches.sampler
    if world > 1 and not (isinstance(sampler, DistributedSampler) and sampler.num_replicas == world):
        raise NotImplementedError(
            f"compile_rng.LightningCallback: under DDP the loader's sampler is a {type(sampler).__name__}, not "
            "the DistributedSampler Lightning gives it (use_distributed_sampler=True), so each rank's rows of "
            "the global batch are unknown"
        )
    return sampler, batches.batch_size, batches.drop_last, world, rank


class LightningCallback(Callback):
    """Put in ``lightning.Trainer(callbacks=[...])`` (see the module docstring)."""

    def __init__(self, resume_without_state: bool = False) -> None:
        self.resume_without_state = resume_without_state
        self._loaded = False
        self._sizes: list[int] = []
        self._world = self._rank = 1
        self._step: Step | None = None
        self._microbatch: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.ckpt_path is None or self._loaded:
            return
        message = (
            f"compile_rng.LightningCallback: the checkpoint {trainer.ckpt_path} holds no compile_rng state (saved "
            "without the callback), so every random op from here would draw other numbers than the run that "
            "saved it"
        )
        if not self.resume_without_state:
            raise checkpointing.MissingStreamState(
                f"{message}. Resume it without compile_rng, or pass LightningCallback(resume_without_state=True) "
                "to continue on this process's stream"
            )
        warnings.warn(f"{message}; continuing on this process's stream (resume_without_state)", stacklevel=2)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        sampler, batch, drop_last, self._world, self._rank = _sampler_and_batch(trainer)
        samples = len(sampler)
        sizes = [batch] * (samples // batch) + ([samples % batch] if samples % batch and not drop_last else [])
        self._sizes = sizes[: int(min(len(sizes), trainer.num_training_batches))]
        self._every = trainer.accumulate_grad_batches
        self._step, self._microbatch = None, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= len(self._sizes) or accelerate_rows.rows_of(batch) != self._sizes[batch_idx]:
            raise RuntimeError(
                f"compile_rng.LightningCallback: batch {batch_idx} holds {accelerate_rows.rows_of(batch)} rows, "
                f"not the {self._sizes[batch_idx] if batch_idx < len(self._sizes) else 'no'} its loader's sampler "
                "deals; the step's rows would be wrong"
            )
        if batch_idx % self._every == 0:
            self._step = self._open(batch_idx)
        self._microbatch = self._step.microbatch(self._sizes[batch_idx])
        self._microbatch.__enter__()

    def _open(self, first: int) -> Step:
        """The step of the batches ``first, ...`` up to the next optimizer step: this rank's
        rows of each are ``r, r + W, ...`` of that batch's ``W`` ranks together."""
        group = self._sizes[first: first + self._every]
        positions, start = [], 0
        for size in group:
            positions += [start + self._rank + self._world * j for j in range(size)]
            start += self._world * size
        return open_step(sum(group), global_batch=start, rows=positions)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._microbatch.__exit__(None, None, None)
        self._microbatch = None
        if (batch_idx + 1) % self._every == 0 or batch_idx + 1 == len(self._sizes):
            step, self._step = self._step, None
            step.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._microbatch is not None:
            self._microbatch.__exit__(type(exception), exception, exception.__traceback__)
        self._step, self._microbatch = None, None

    def state_dict(self) -> dict[str, Any]:
        """The stream, for Lightning's checkpoints (``compile_rng.state_dict``)."""
        return checkpointing.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        checkpointing.load_state_dict(state_dict)
        self._loaded = True
