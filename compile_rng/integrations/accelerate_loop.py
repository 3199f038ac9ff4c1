"""A plain ``accelerate`` training loop with every optimizer step in a :func:`compile_rng.step`.

::

    for batch in compile_rng.accelerate_batches(accelerator, loader):
        with accelerator.accumulate(model):
            ...  # the loop as it was

``accelerator.accumulate`` steps the optimizer after every ``gradient_accumulation_steps``
batches, counted from the loader's start, and after the loader's last batch. The batches
here are grouped the same way, without reading ahead (accelerate's loader flags its last
batch by peeking one ahead; reading further would make ``accumulate`` sync early), so a
group's size must be known before its first microbatch draws: the loader's length and its
first batch's rows. Every batch must hold as many rows on every rank - ``even_batches``
(accelerate's default, required) pads the last round so that it does; a batch that does
not is refused before it draws. The groups line up with accelerate's own as long as its
counter restarts with the loader (``sync_with_dataloader``, the default) and the loader
starts at a step boundary (a resumed loader, ``skip_first_batches``, must skip whole
optimizer steps).

Checkpoints: the first call registers a :class:`compile_rng.StreamState` with the
accelerator (``register_for_checkpointing``), so ``accelerator.save_state`` saves the
stream. A run that resumes registers its own before ``accelerator.load_state`` (the
registration is how accelerate knows what to load): ``accelerate_batches`` then finds it
and registers no other. A loader resumed mid-epoch (``skip_first_batches``) whose
accelerator loaded no stream is refused: its steps would draw other numbers than the run
that saved the checkpoint. (accelerate itself refuses a ``load_state`` whose checkpoint
holds another number of registered objects than the accelerator: a checkpoint saved
without the stream, or one loaded without registering it.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from compile_rng.eager.batches import open_step
from compile_rng.integrations import accelerate_rows
from compile_rng.stream import agreement
from compile_rng.stream.checkpointing import StreamState


def accelerate_batches(accelerator: Any, loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of ``loader`` (prepared by ``accelerator``), each yielded inside its
    microbatch of the optimizer step ``accelerator.accumulate`` puts it in."""
    world, rank = accelerator.num_processes, accelerator.process_index
    accelerate_rows.check_dealt_by_rounds(loader, world, even=True)
    _checkpoint_the_stream(accelerator, loader)
    try:
        count = len(loader)
    except TypeError as e:
        raise NotImplementedError(
            f"compile_rng.accelerate_batches: the loader ({type(loader).__name__}) has no length, so an optimizer "
            "step's rows are unknown before its first batch; wrap each step in compile_rng.step yourself (rows= "
            "this rank's positions)"
        ) from e
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    steps_of = accelerator.gradient_accumulation_steps
    batches = iter(loader)
    per_rank = None  # the first batch's rows: every batch of every rank holds as many
    for first in range(0, count, steps_of):
        n = min(steps_of, count - first)
        step = None
        for index in range(first, first + n):
            batch = next(batches)  # outside the microbatches: the sampler's own generator draws as it did
            rows = accelerate_rows.rows_of(batch)
            per_rank = rows if per_rank is None else per_rank
            if step is None:  # the step's rows are known once its first batch is: every rank's n batches alike
                if first == 0:
                    _check_ranks_batch(group, per_rank)
                mine = accelerate_rows.positions([[per_rank] * n] * world, rank)
                step = open_step(per_rank * n, global_batch=per_rank * n * world, rows=mine)
            if rows != per_rank:
                raise NotImplementedError(
                    f"compile_rng.accelerate_batches: batch {index} holds {rows} rows, not the {per_rank} of the "
                    "loader's first (an uneven last batch: drop_last=False without accelerate's padding), so the "
                    "step's rows were placed wrong; keep accelerate's even_batches=True, or drop the last batch "
                    "(drop_last=True)"
                )
            with step.microbatch(rows):
                yield batch
        step.finish()


def _check_ranks_batch(group: Any, rows: int) -> None:
    """Every rank's batches must hold ``rows`` rows, as this rank's do (checked once per
    loader: a batch that differs from its loader's first is refused where it comes), for
    the steps' rows to be known without communicating."""
    agreement.require_agreement(
        [group] if group is not None else [], (rows,), ("rows per batch",),
        "compile_rng.accelerate_batches: the ranks' loaders deal batches of different sizes",
        "Give every rank's loader the same batch size (accelerate's prepare does)",
    )


def _checkpoint_the_stream(accelerator: Any, loader: Any) -> None:
    """Register the stream for the accelerator's checkpoints, once; refuse a loader resumed
    mid-epoch on a stream that no checkpoint restored (see the module docstring)."""
    # accelerate 1.15 keeps what register_for_checkpointing was given in _custom_objects
    # and offers no public getter
    ours = [o for o in getattr(accelerator, "_custom_objects", []) if isinstance(o, StreamState)]
    skipped = accelerate_rows.skipped_batches(loader)
    if skipped and not any(o.loaded for o in ours):
        raise RuntimeError(
            f"compile_rng.accelerate_batches: the loader resumes mid-epoch (it skips {skipped} batches), but "
            "accelerator.load_state restored no compile_rng stream, so every step from here would draw other "
            "numbers than the run that saved the checkpoint. Register it before loading: "
            "accelerator.register_for_checkpointing(compile_rng.StreamState()); accelerator.load_state(...)"
        )
    if not ours:
        accelerator.register_for_checkpointing(StreamState())
