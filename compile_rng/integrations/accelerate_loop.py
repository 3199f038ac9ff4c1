"""A plain ``accelerate`` training loop with every optimizer step in a :func:`compile_rng.step`.

::

    for batch in compile_rng.accelerate_batches(accelerator, loader):
        with accelerator.accumulate(model):
            ...  # the loop as it was

``accelerator.accumulate`` steps the optimizer after every ``gradient_accumulation_steps``
batches, counted from the loader's start, and after the loader's last batch. The batches
here are grouped the same way, without reading ahead (accelerate's loader flags its last
batch by peeking one ahead; reading further would make ``accumulate`` sync early), so a
group's size must be known before its first batch: the loader's length and its batch
size. Every batch must hold the loader's batch size on every rank - ``even_batches``
(accelerate's default) pads the last round so that it does; a batch that does not is
refused before it draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from compile_rng.eager.batches import open_step
from compile_rng.integrations import accelerate_rows


def accelerate_batches(accelerator: Any, loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of ``loader`` (prepared by ``accelerator``), each yielded inside its
    microbatch of the optimizer step ``accelerator.accumulate`` puts it in."""
    world, rank = accelerator.num_processes, accelerator.process_index
    accelerate_rows.check_dealt_by_rounds(loader, world)
    try:
        count = len(loader)
        # accelerate's loaders: the global batch (split_batches or not); a plain one: its own
        per_rank = (getattr(loader, "total_batch_size", None) or loader.batch_size) // world
    except (TypeError, AttributeError) as e:
        raise NotImplementedError(
            f"compile_rng.accelerate_batches: the loader ({type(loader).__name__}) has no length or batch size, so "
            "an optimizer step's rows are unknown before its first batch; wrap each step in compile_rng.step "
            "yourself (rows= this rank's positions)"
        ) from e
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    steps_of = accelerator.gradient_accumulation_steps
    batches = iter(loader)
    for first in range(0, count, steps_of):
        n = min(steps_of, count - first)
        mine = accelerate_rows.positions([[per_rank] * n] * world, rank)
        total = per_rank * n * world
        s = open_step(per_rank * n, data_parallel=group, global_batch=None if group else total, rows=mine)
        for index in range(first, first + n):
            batch = next(batches)  # outside the microbatches: the sampler's own generator draws as it did
            rows = accelerate_rows.rows_of(batch)
            if rows != per_rank:
                raise NotImplementedError(
                    f"compile_rng.accelerate_batches: batch {index} holds {rows} rows, not the loader's "
                    f"{per_rank} per rank (an uneven last batch: even_batches=False or a sampler of its own), "
                    "so the step's rows were placed wrong; keep accelerate's even_batches=True, or drop the "
                    "last batch (drop_last=True)"
                )
            with s.microbatch(rows):
                yield batch
        s.finish()
