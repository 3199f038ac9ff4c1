"""Training steps: activations drawn at their rows of the step's global batch.

Invariant activations (docs/contract.md §3.5). In a graph of a ``batched`` backend
(``compile_rng.backend(layout="invariant", batched=True)``), dim 0 of every random op's
tensor is the batch: the tensor holds rows ``[start, start + rows)`` of a global batch
of ``total`` rows, and element ``(i, j...)`` draws the counter of ``(start + i, j...)``
in the global tensor (DTensor placements of the other dims apply as usual). The op
advances the stream by ``ceil4(total * row_numel)``, on every rank alike.

A *step* (:func:`step`) fixes where the rows come from:

* the global batch is the data-parallel ranks' local batches, as the data loader dealt
  them: contiguous blocks in mesh-coordinate order (any sizes: an uneven last batch is
  the normal case), interleaved rows (``DistributedSampler``), or explicit positions;
* every microbatch (:meth:`Step.microbatch`) restarts at the stream position the step
  began at, so a sample draws the same masks whichever microbatch it is in; the step
  ends at the position every microbatch reached (they must agree) - exactly where one
  call on the whole global batch ends.

Outside a step a batched graph's tensors are the whole batch (``start = 0``,
``total = rows``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from compile_rng.eager import activation_names, dispatch_modes, random_kernels
from compile_rng.semantics.named_draws import STEP_STRIDE, reset_namer, set_namer
from compile_rng.semantics.rows import Rows, ScatteredRows, current_rows, reset_rows, reset_step_batch_dim, rows_at, set_rows, set_step_batch_dim
from compile_rng.stream import agreement, state


def _group_coordinate(data_parallel: Any) -> tuple[Any, int, int, torch.device]:
    """``(process group, this rank's coordinate, size, device)`` of a 1-D mesh or a group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(data_parallel, DeviceMesh):
        if data_parallel.ndim != 1:
            raise ValueError(
                f"compile_rng.step: data_parallel must be a 1-D mesh (got {data_parallel.ndim}-D "
                f"{data_parallel.mesh_dim_names}); flatten the data-parallel dims first "
                "(mesh[('dp_replicate', 'dp_shard')]._flatten())"
            )
        device = torch.device(data_parallel.device_type)
        return data_parallel.get_group(), data_parallel.get_local_rank(), data_parallel.size(), device
    device = agreement.collective_device(data_parallel)
    return data_parallel, dist.get_rank(data_parallel), dist.get_world_size(data_parallel), device


ORDERS = ("contiguous", "interleaved")


def _positions(positions: Sequence[int], local_batch: int) -> list[int]:
    """This rank's explicit global row positions, checked against its local batch."""
    positions = [int(p) for p in positions]
    if len(positions) != local_batch:
        raise ValueError(f"compile_rng.step: rows= lists {len(positions)} positions for a local batch of {local_batch}")
    return positions


def _check_cover(held: Sequence[int], total: int) -> None:
    if sorted(held) != list(range(total)):
        raise ValueError(
            f"compile_rng.step: the rows= positions do not cover the global batch of {total} rows once each "
            "(a row held twice or by no rank would draw another row's masks)"
        )


def _dealt(order: str, coord: int, size: int, total: int) -> Rows:
    """Rank ``coord`` of ``size``'s rows of a global batch of ``total`` rows dealt by ``order``:
    ``torch.chunk``'s blocks (DTensor's ``Shard(0)``), or one row each in turn."""
    if order == "interleaved":
        return Rows(coord, max(0, -(-(total - coord) // size)), total, size)
    chunk = -(-total // size)
    start = min(coord * chunk, total)
    return Rows(start, max(min(chunk, total - start), 0), total)


def _rank_rows(local_batch: int, data_parallel: Any, global_batch: int | None, order: Any) -> Rows | ScatteredRows:
    """This rank's rows of the global batch (``order``: see :func:`step`)."""
    if isinstance(local_batch, bool) or not isinstance(local_batch, int) or local_batch < 0:
        raise TypeError(f"compile_rng.step: local_batch must be a row count, got {local_batch!r}")
    if isinstance(order, str):
        if order not in ORDERS:
            raise ValueError(f"compile_rng.step: rows={order!r}; expected one of {ORDERS} or this rank's positions")
        positions = None
    else:
        positions = _positions(order, local_batch)
    if data_parallel is None:
        if positions is not None:
            if global_batch is None:
                raise ValueError("compile_rng.step: rows=<positions> without data_parallel needs global_batch=")
            if any(not 0 <= p < global_batch for p in positions) or len(set(positions)) != len(positions):
                raise ValueError(
                    f"compile_rng.step: rows= positions {positions[:8]} are not distinct rows of the global batch "
                    f"of {global_batch}"
                )
            return rows_at(positions, global_batch)
        if global_batch not in (None, local_batch):
            raise ValueError(
                f"compile_rng.step: global_batch={global_batch} but local_batch={local_batch} "
                "without data_parallel; pass data_parallel= (the mesh or group the batch is split over)"
            )
        return Rows(0, local_batch, local_batch)
    import torch.distributed as dist

    group, coord, size, device = _group_coordinate(data_parallel)
    if global_batch is not None and positions is None:  # no communication needed
        rows = _dealt(order, coord, size, global_batch)
        if local_batch != rows.count:
            raise ValueError(
                f"compile_rng.step: global_batch={global_batch} dealt {order} over {size} data-parallel ranks "
                f"gives coordinate {coord} {rows.count} rows, but local_batch={local_batch}; "
                "omit global_batch to gather the ranks' actual sizes"
            )
        return rows
    counts = [torch.empty(2, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([coord, local_batch], dtype=torch.int64, device=device), group=group)
    sizes = {c: n for c, n in (t.tolist() for t in counts)}
    total = sum(sizes.values())
    if global_batch is not None and total != global_batch:
        raise ValueError(f"compile_rng.step: the ranks hold {total} rows, but global_batch={global_batch}")
    if positions is None and order == "contiguous":
        return Rows(sum(n for c, n in sizes.items() if c < coord), local_batch, total)
    if positions is None:  # interleaved: every rank must hold its dealt share
        for c, n in sizes.items():
            if n != _dealt(order, c, size, total).count:
                raise ValueError(
                    f"compile_rng.step(rows='interleaved'): {total} rows dealt over {size} ranks give coordinate "
                    f"{c} {_dealt(order, c, size, total).count} rows, but it holds {n}"
                )
        return Rows(coord, local_batch, total, size)
    # explicit positions: every rank's, to check that they cover the batch once
    everyone = agreement.gather_int_lists(positions, group, device, [sizes[c] for c in range(size)])
    _check_cover([p for held in everyone for p in held], total)
    return rows_at(positions, total)


class Step:
    """One training step's batch (see the module docstring); made by :func:`step`."""

    def __init__(self, rows: Rows | ScatteredRows, *, only_microbatches: bool = False):
        self.rows = rows
        # every device's stream (a CUDA model draws on CUDA); a step of microbatches only
        # starts where its first microbatch does (a training loop may restore its RNG state
        # between opening the step and running it: the Trainer does when it resumes)
        self._start = None if only_microbatches else state.snapshot()
        self._used = 0
        self._ends: list[dict[str, tuple[int, int]]] = []
        self._only_microbatches = only_microbatches

    @contextlib.contextmanager
    def microbatch(self, rows: int) -> Iterator[Rows | ScatteredRows]:
        """The next ``rows`` rows of this rank's local batch, drawn exactly as the whole
        step's batch draws them: the stream restarts at the step's position."""
        if rows < 0 or self._used + rows > self.rows.count:
            raise ValueError(
                f"compile_rng: microbatch of {rows} rows after {self._used} of this rank's "
                f"{self.rows.count}; the microbatches must split the step's local batch"
            )
        mine = self.rows.sub(self._used, rows)
        self._used += rows
        if self._start is None:
            self._start = state.snapshot()
        token = set_rows(mine, split=rows < self.rows.count)
        try:
            # the streams restart at the step's position (torch's CUDA generator, which code
            # between microbatches draws from, is held there, not moved back); a step's own
            # stream draws at the new rows on a backward's device thread too
            with state.held(self._start), (
                dispatch_modes.compiled_call() if self._only_microbatches else random_kernels.refreshed()
            ):
                try:
                    yield mine
                finally:
                    self._ends.append(state.snapshot())
        finally:
            reset_rows(token)

    def finish(self) -> None:
        """End the step where every microbatch ended (they must agree; done by :func:`step`)."""
        if not self._ends:
            return
        if self._used != self.rows.count:
            raise ValueError(
                f"compile_rng: the microbatches covered {self._used} of this rank's {self.rows.count} rows"
            )
        if any(end != self._ends[0] for end in self._ends):
            offsets = [{kind: offset for kind, (_, offset) in end.items()} for end in self._ends]
            raise RuntimeError(
                f"compile_rng: the microbatches of a step drew different amounts of randomness "
                f"(they ended at offsets {offsets}); every microbatch must run the same random ops"
            )
        state.settle(self._ends[0])


@contextlib.contextmanager
def step(
    local_batch: int, *, data_parallel: Any = None, global_batch: int | None = None,
    names: Any = None, microbatches: int | None = None, rows: str | Sequence[int] = "contiguous",
    batch_dim: int = 0,
) -> Iterator[Step]:
    """One training step of ``local_batch`` rows on this rank.

    ``data_parallel`` (a 1-D DeviceMesh or a process group) is what the global batch is
    split over: the global batch is the ranks' local batches in coordinate order, their
    sizes gathered once here (one tiny all-gather), or - with ``global_batch`` given -
    taken to be DTensor's ``Shard(0)`` split of it. Batched graphs called in the block
    draw at this rank's rows; use :meth:`Step.microbatch` for gradient accumulation.

    ``rows`` is where this rank's rows sit in the global batch: ``"contiguous"`` (a block,
    in coordinate order), ``"interleaved"`` (rows ``coord, coord + size, ...``: how
    ``DistributedSampler`` and ``datasets``' ``split_dataset_by_node`` deal samples), or this
    rank's global row positions in the order it holds them (checked to cover the batch once,
    over the ranks). Random ops draw at evenly spaced rows only: positions that are not
    (accelerate's loader under gradient accumulation: a block per microbatch) draw in
    :meth:`Step.microbatch`, one evenly spaced block each. Compiled batched graphs take
    contiguous rows only.

    ``names`` (the model, or this rank's ``PipelineStage`` objects) makes every eager
    random op in the block draw from the stream of its name in the model instead of the
    step's sequence (:mod:`compile_rng.semantics.named_draws`), so that pipeline stages
    draw the single process's masks; with stages, ``microbatches`` is the schedule's
    ``n_microbatches`` and each stage's microbatch ``i`` draws at its rows.

    ``batch_dim`` is the dim of the random ops' tensors that holds the batch: 0
    (batch-major), or 1 for sequence-major code (``(seq, batch, ...)``, fairseq's habit);
    either way a batch row takes the outermost counters, so a sequence-major draw is its
    batch-first transpose's. Eagerly, torch's own modules say it themselves and override
    it inside them (:mod:`compile_rng.eager.batch_dims`: ``nn.LSTM``/``nn.GRU``/``nn.RNN``,
    the ``nn.Transformer`` layers, ``nn.MultiheadAttention``); a compiled batched graph
    draws at the dim of the step it compiled in (``nn.MultiheadAttention``'s at 0) and
    refuses a step that declares another.
    """
    if isinstance(batch_dim, bool) or batch_dim not in (0, 1):
        raise ValueError(f"compile_rng.step: batch_dim must be 0 or 1, got {batch_dim!r}")
    rows = _rank_rows(local_batch, data_parallel, global_batch, rows)
    enclosing = current_rows()
    if enclosing is not None and enclosing != rows:
        # its draws would be at its own rows of its own batch: every microbatch of the
        # enclosing step would draw the same values
        raise RuntimeError(
            f"compile_rng.step: a step of {local_batch} rows opened inside a step or microbatch whose rows here are "
            f"{enclosing}: steps do not nest. Draw in the enclosing step (its microbatches are at their rows "
            "already), or close it first"
        )
    token = set_step_batch_dim(batch_dim)
    try:
        if names is None:
            if microbatches is not None:
                raise ValueError("compile_rng.step: microbatches= goes with names=<pipeline stages>")
            with _rows_and_stream(rows, rows) as s:
                yield s
            s.finish()
            return
        with _named(rows, names, microbatches) as s:
            yield s
    finally:
        reset_step_batch_dim(token)


def open_step(local_batch: int, *, data_parallel: Any = None, global_batch: int | None = None,
              rows: str | Sequence[int] = "contiguous") -> Step:
    """A step (arguments as :func:`step`) whose code runs only in its microbatches, for a
    training loop that owns the code between them (fetching the next batch, the optimizer
    step): only the microbatches draw at the rows; call :meth:`Step.finish` after the last."""
    return Step(_rank_rows(local_batch, data_parallel, global_batch, rows), only_microbatches=True)


@contextlib.contextmanager
def _rows_and_stream(rows: Rows | ScatteredRows, current: Rows | ScatteredRows | None) -> Iterator[Step]:
    """A :class:`Step` of ``rows``, with ``current`` the rows the block's code draws at."""
    s = Step(rows)
    token = set_rows(current)
    try:
        with dispatch_modes.compiled_call():  # eager random ops in the block draw at the rows too
            yield s
    finally:
        reset_rows(token)


@contextlib.contextmanager
def _named(rows: Rows, names: Any, microbatches: int | None) -> Iterator[Step]:
    activation_names.require_hooks()
    roots, stages = activation_names.roots_of(names)
    if not stages and microbatches is not None:
        raise ValueError(
            "compile_rng.step: microbatches= goes with names=<pipeline stages>; one process splits "
            "its batch with Step.microbatch"
        )
    if stages and (isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(
            "compile_rng.step(names=<pipeline stages>): pass microbatches=, the schedule's n_microbatches "
            f"(got {microbatches!r})"
        )
    run = state.run_position()  # a declared run seed: every device draws at the run's position
    start = state.snapshot() if run is None else dict.fromkeys(state.device_types(), run)
    _check_ranks_agree(start)
    namer = activation_names.ActivationNames(roots, start, split=bool(stages))
    namer_token = set_namer(namer)
    pipeline = (
        activation_names.microbatch_rows_of(stages, rows, microbatches) if stages else contextlib.nullcontext()
    )
    try:
        # Pipeline stages: rows only inside a microbatch (the schedule's shape inference
        # runs a forward outside any: it draws by name and changes nothing).
        with pipeline, _rows_and_stream(rows, None if stages else rows) as s:
            yield s
    finally:
        reset_namer(namer_token)
    s.finish()
    if run is not None:
        state.advance_run(STEP_STRIDE)  # each rank's own stream stays as its seeding left it
        return
    for kind, (seed, base) in start.items():
        state.set_state(seed, base + STEP_STRIDE, kind)


def _check_ranks_agree(start: dict[str, tuple[int, int]]) -> None:
    """Every rank must begin the step at the same position of every device's stream (a
    named draw uses the stream of its tensor's device): a stage seeded ``seed + pp_rank``
    (torchtitan, Megatron), or one that ran other stock CUDA random ops before the step,
    would draw other masks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    kinds = sorted(start)
    agreement.require_agreement(
        [dist.group.WORLD], tuple(v for kind in kinds for v in start[kind]),
        tuple(f"{kind} {field}" for kind in kinds for field in ("seed", "offset")),
        "compile_rng.step(names=...): the ranks begin the step at different stream positions",
        "Every rank must be seeded alike - a pipeline stage "
        "seeded seed + pp_rank (torchtitan, Megatron) draws other masks than the single process. "
        "Seed every rank with the same compile_rng.manual_seed / torch.manual_seed, or keep that seeding "
        "and declare the run's seed once on every rank: compile_rng.run_seed(seed)",
    )
