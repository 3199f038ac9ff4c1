"""The Hugging Face ``Trainer`` with every optimizer step in a :func:`compile_rng.step`.

One line for the user::

    class Trainer(compile_rng.TrainerMixin, transformers.Trainer): pass

The Trainer fetches each optimizer step's microbatches up front
(``Trainer.get_batch_samples``, transformers 5.x) and then runs ``training_step`` on each.
The mixin opens the step there - the rows of every data-parallel rank's microbatches
gathered, placed where accelerate's loader dealt them (:mod:`.accelerate_rows`) - runs
each ``training_step`` in its :meth:`~compile_rng.eager.batches.Step.microbatch` (only
there: the Trainer's code between them draws as it would without the mixin), and closes
the step after the last. So every sample draws the masks it draws in one process
with the same global batch, whatever the number of ranks and the gradient accumulation.

A checkpoint holds the stream where the Trainer keeps its own RNG states (its
``_save_rng_state`` / ``_load_rng_state``): every rank writes
``compile_rng_state_<rank>.json`` beside ``rng_state_<rank>.pth``, and
``train(resume_from_checkpoint=...)`` restores it when the Trainer restores torch's, so a
resumed run draws what the uninterrupted one drew (:mod:`compile_rng.stream.checkpointing`;
a checkpoint without it is refused).
"""

from __future__ import annotations

from typing import Any

import warnings

from compile_rng.eager.batches import Step, open_step
from compile_rng.integrations import accelerate_rows
from compile_rng.stream import checkpointing


class TrainerMixin:
    """Put before ``transformers.Trainer`` in a subclass's bases (see the module docstring).

    Data parallelism is the Trainer's process group (DDP, or FSDP through accelerate);
    tensor or context parallelism (accelerate's ``ParallelismConfig``) and data loaders
    accelerate did not shard are refused rather than drawn at unknown rows.

    Resuming from a checkpoint saved without compile_rng's state raises; set
    ``compile_rng_resume_without_state = True`` on the Trainer to continue from it on the
    stream the process is at (with a warning: the steps after it draw other numbers than
    the run that saved it).
    """

    compile_rng_resume_without_state = False
    _compile_rng_step: Step | None = None
    _compile_rng_left = 0

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        checkpointing.save_to_folder(output_dir, self.args.process_index, self.args.world_size)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        who = "compile_rng.TrainerMixin"
        try:
            checkpointing.load_from_folder(checkpoint, self.args.process_index, self.args.world_size, who)
        except checkpointing.MissingStreamState as e:
            if not self.compile_rng_resume_without_state:
                raise checkpointing.MissingStreamState(
                    f"{e}; or set compile_rng_resume_without_state = True on the Trainer to continue on this "
                    "process's stream"
                ) from None
            warnings.warn(f"{e}; continuing on this process's stream (compile_rng_resume_without_state)", stacklevel=2)

    def get_train_dataloader(self):  # noqa: ANN201 - the Trainer's own signature
        # A new train(): a step a stopped loop left open (an exception or a callback between
        # microbatches) must not outlive it
        self._compile_rng_step, self._compile_rng_left = None, 0
        loader = super().get_train_dataloader()
        config = getattr(self.accelerator, "parallelism_config", None)
        split = {k: getattr(config, k, None) or 1 for k in ("tp_size", "cp_size", "sp_size")}
        if any(v > 1 for v in split.values()):
            raise NotImplementedError(
                f"compile_rng.TrainerMixin: accelerate's ParallelismConfig splits the model ({split}): its data-"
                "parallel group is not the world, which the mixin assumes. Use compile_rng.step with "
                "data_parallel=<the data-parallel mesh> in your own training_step"
            )
        accelerate_rows.check_dealt_by_rounds(loader, self.accelerator.num_processes)
        return loader

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._compile_rng_step is not None:
            raise RuntimeError(
                f"compile_rng.TrainerMixin: a new optimizer step began with {self._compile_rng_left} microbatch(es) "
                "of the last one not run through training_step"
            )
        sizes = [accelerate_rows.rows_of(b) for b in batches]
        # the step's one collective: every rank then knows every rank's rows
        everyone = accelerate_rows.gather_sizes(sizes, self.accelerator.device, num_batches)
        mine = accelerate_rows.positions(everyone, self.accelerator.process_index)
        step = open_step(sum(sizes), global_batch=sum(map(sum, everyone)), rows=mine)
        if batches:
            self._compile_rng_step, self._compile_rng_left = step, len(batches)
        else:  # this rank's data ran out: it took part in the step's collectives, and draws nothing
            step.finish()
        return batches, items

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        step = self._compile_rng_step
        if step is None:
            raise RuntimeError(
                "compile_rng.TrainerMixin: training_step ran outside the Trainer's training loop (no optimizer step "
                "is open): call it from Trainer.train, or use compile_rng.step around your own loop"
            )
        try:
            with step.microbatch(accelerate_rows.rows_of(inputs)):
                loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            self._compile_rng_step = None
            raise
        self._compile_rng_left -= 1
        if self._compile_rng_left == 0:
            self._compile_rng_step = None
            step.finish()
        return loss
