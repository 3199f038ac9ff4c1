"""Saving and resuming compile_rng's stream with the model and optimizer.

* :func:`state_dict` / :func:`load_state_dict`: this process's streams (every device
  type's ``(seed, offset)``) as a plain dict, for ``torch.save`` or any checkpoint format.
* :class:`StreamState`: the same as a ``torch.distributed.checkpoint`` ``Stateful``, put
  in the dict given to ``dcp.save``/``dcp.load`` beside the model and optimizer. DCP keeps
  one copy of a non-tensor value per key, so ranks whose streams differ (pipeline stages
  seeded apart) need ``per_rank=True`` (one key per rank; resume on the same ranks);
  without it, saving checks that every rank agrees and raises if not.
* ``torch.random.fork_rng()`` forks compile_rng's CPU stream too
  (:mod:`compile_rng.installation`): the block's draws do not move the stream outside it.
"""

from __future__ import annotations

from typing import Any

from compile_rng.stream import state

VERSION = 1


def state_dict() -> dict[str, Any]:
    """This process's streams: ``{"version": 1, "streams": {device_type: {"seed", "offset"}}}``,
    with ``"run": {"seed", "offset"}`` when a run seed is declared (``compile_rng.run_seed``)."""
    streams = {kind: {"seed": seed, "offset": offset} for kind, (seed, offset) in state.snapshot().items()}
    saved: dict[str, Any] = {"version": VERSION, "streams": streams}
    run = state.run_position()
    if run is not None:
        saved["run"] = {"seed": run[0], "offset": run[1]}
    return saved


def load_state_dict(saved: dict[str, Any]) -> None:
    """Restore the streams a :func:`state_dict` saved. A device type the checkpoint has
    but this process lacks (a GPU run resumed on CPU) raises instead of being dropped."""
    if saved.get("version") != VERSION:
        raise ValueError(f"compile_rng.load_state_dict: unknown state version {saved.get('version')!r} (expected {VERSION})")
    available = state.device_types()
    missing = sorted(set(saved["streams"]) - set(available))
    if missing:
        raise ValueError(
            f"compile_rng.load_state_dict: the checkpoint holds streams for {missing}, which this process "
            f"does not have (it has {available})"
        )
    for kind, stream in saved["streams"].items():
        state.set_state(int(stream["seed"]), int(stream["offset"]), kind)
    if "run" in saved:
        state.set_run_position((int(saved["run"]["seed"]), int(saved["run"]["offset"])))


class StreamState:
    """compile_rng's streams as a ``torch.distributed.checkpoint`` ``Stateful``::

        dcp.save({"model": model_sd, "optim": optim_sd, "rng": compile_rng.StreamState()}, ...)
        dcp.load({..., "rng": compile_rng.StreamState()}, ...)   # restores the stream

    ``per_rank=True`` saves each rank's streams under its own key (``rank<N>``): for ranks
    that draw from different streams. Without it all ranks must agree when saving.
    """

    def __init__(self, per_rank: bool = False):
        self.per_rank = per_rank

    def state_dict(self) -> dict[str, Any]:
        mine = state_dict()
        rank = _rank()
        if rank is None:
            return mine
        if self.per_rank:
            return {f"rank{rank}": mine}
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        differ = [r for r, theirs in enumerate(everyone) if theirs != mine]
        if differ:
            raise RuntimeError(
                f"compile_rng.StreamState: ranks {differ} have other streams than rank {rank} "
                f"({mine['streams']}); a checkpoint keeps one copy: use StreamState(per_rank=True)"
            )
        return mine

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        rank = _rank()
        if self.per_rank and rank is not None:
            saved = saved[f"rank{rank}"]
        load_state_dict(saved)


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
