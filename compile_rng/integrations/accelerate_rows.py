"""Where ``accelerate``'s sharded data loaders put a rank's batches in the global batch.

Read from accelerate 1.15 (``accelerate/data_loader.py``), not assumed. Every loader
``Accelerator.prepare`` makes for data parallelism deals a step's data round by round:
in round ``m`` (the ``m``-th batch each rank draws) rank ``r`` holds the ``r``-th block of
what one process reading the same sampler would draw as its ``m``-th batch of the global
size:

* ``BatchSamplerShard`` (map-style datasets): ``split_batches=False`` gives rank ``r``
  the sampler's batches ``r, r + W, ...``; ``split_batches=True`` slices each batch into
  ``W`` blocks; ``even_batches`` pads the last round with the first samples (data
  the single process does not see, so its last step differs by data, not by masks);
* ``IterableDatasetShard`` (iterable datasets): each rank's slice of ``W`` batches;
* ``DataLoaderDispatcher`` (``dispatch_batches``): rank 0 reads a round and sends block
  ``r`` to rank ``r``.

So with gradient accumulation a rank's rows of an optimizer step are one block per
microbatch, ``W`` blocks apart: not evenly spaced. :func:`positions` lists them for
:func:`compile_rng.step` (``rows=``), whose microbatches then draw at their blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from compile_rng.stream import agreement


def rows_of(batch: Any) -> int:
    """The row count of a batch: dim 0 of its first tensor (a tensor, or a dict, list
    or tuple of them, as collators make)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    # Mapping: transformers' BatchEncoding (a UserDict) as well as dicts
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        try:
            return rows_of(value)
        except TypeError:
            continue
    raise TypeError(f"compile_rng: cannot tell the rows of a batch of type {type(batch).__name__}: no tensor in it")


def _shard(loader: Any) -> Any:
    """The loader's ``BatchSamplerShard`` (under a resumed loader's ``SkipBatchSampler``), or None."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler

    for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        while isinstance(sampler, SkipBatchSampler):
            sampler = sampler.batch_sampler
        if isinstance(sampler, BatchSamplerShard):
            return sampler
    return None


def skipped_batches(loader: Any) -> int:
    """How many batches a loader made by accelerate's ``skip_first_batches`` skips (0 for
    any other loader): on its ``skip_batches`` (``SkipDataLoader``, or a loader whose
    sampler cannot skip) or on its ``SkipBatchSampler``."""
    holders = (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
    return max((getattr(h, "skip_batches", 0) or 0) for h in holders)


def check_dealt_by_rounds(loader: Any, world: int, *, even: bool = False) -> None:
    """Refuse a loader whose rows in the global batch are unknown (``world`` > 1):
    anything but the loaders ``Accelerator.prepare`` makes for data parallelism, one over
    a sampler that already shards by rank, or (``even``: every rank must hold the same
    batches) one that does not pad the last round. (A sampler of the user's own must
    yield the same order on every rank, as accelerate itself assumes.)"""
    if world <= 1:
        return
    from accelerate.data_loader import DataLoaderDispatcher, IterableDatasetShard

    shard = _shard(loader)
    inner = getattr(shard, "batch_sampler", None)
    if isinstance(getattr(inner, "sampler", inner), torch.utils.data.DistributedSampler) or (
        shard is not None and shard.num_processes != world
    ):
        raise NotImplementedError(
            f"compile_rng: the training sampler ({type(getattr(inner, 'sampler', inner)).__name__}) picks each "
            "rank's samples itself (a DistributedSampler, or the Trainer's batch_rebalance), so no single global "
            "batch holds them in an order one process would read. Give accelerate a sampler that is the same on "
            "every rank (the Trainer's own random sampler) and let it shard"
        )
    if even and shard is not None and not shard.even_batches:
        raise NotImplementedError(
            "compile_rng.accelerate_batches: the loader was prepared with even_batches=False, so the ranks may "
            "hold different numbers of batches and an optimizer step's rows differ by rank; keep accelerate's "
            "even_batches=True (the default) or drop the last batch (drop_last=True)"
        )
    if (
        isinstance(loader, DataLoaderDispatcher)
        or shard is not None
        or isinstance(getattr(loader, "dataset", None), IterableDatasetShard)
    ):
        return
    raise NotImplementedError(
        f"compile_rng: the training data loader ({type(loader).__name__} over "
        f"{type(getattr(loader, 'dataset', None)).__name__}, sampler "
        f"{type(getattr(loader, 'sampler', None)).__name__}) was not sharded by accelerate, so where this rank's "
        f"rows sit among the {world} ranks' is unknown and every sample could draw another row's masks. "
        "Let accelerate shard the data (Accelerator.prepare / the Trainer's own loader), or run each step in "
        "compile_rng.step(..., rows=<this rank's global positions>) yourself"
    )


def positions(sizes: Sequence[Sequence[int]], rank: int) -> list[int]:
    """This rank's global row positions in a step whose microbatch ``m`` holds
    ``sizes[r][m]`` rows on rank ``r`` (0 where a rank ran out of data), dealt by rounds."""
    rounds = max((len(s) for s in sizes), default=0)
    grid = [[s[m] if m < len(s) else 0 for s in sizes] for m in range(rounds)]  # grid[m][r]
    mine, first = [], 0
    for row in grid:
        start = first + sum(row[:rank])
        mine.extend(range(start, start + row[rank]))
        first += sum(row)
    return mine


def gather_sizes(mine: Sequence[int], device: torch.device, length: int) -> list[list[int]]:
    """Every data-parallel rank's microbatch sizes, each padded with 0 (a rank that ran out
    of data) to ``length``, the most any rank can hold: one small all-gather on the world
    group."""
    import torch.distributed as dist

    if len(mine) > length:
        raise ValueError(f"compile_rng: {len(mine)} microbatches in a step of at most {length}")
    padded = [*mine, *[0] * (length - len(mine))]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [padded]
    return agreement.gather_int_lists(padded, dist.group.WORLD, device, [length] * dist.get_world_size())
