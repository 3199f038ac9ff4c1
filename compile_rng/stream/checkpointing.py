"""Saving and resuming compile_rng's stream with the model and optimizer.

* :func:`state_dict` / :func:`load_state_dict`: this process's streams (every device
  type's ``(seed, offset)``, the run position) as a plain dict, for ``torch.save`` or any
  checkpoint format.
* :class:`StreamState`: the same as a ``torch.distributed.checkpoint`` ``Stateful`` (and an
  ``accelerate`` checkpointing object), put in the dict given to ``dcp.save``/``dcp.load``
  beside the model and optimizer. DCP keeps one copy of a non-tensor value per key, so
  ranks whose streams differ (pipeline stages seeded apart) need ``per_rank=True`` (one key
  per rank; resume on the same ranks); without it, saving and loading check that every
  rank agrees and raise if not.
* :func:`save_to_folder` / :func:`load_from_folder`: a checkpoint folder's own file per
  rank, for training loops that write a folder (the Hugging Face Trainer); a folder without
  one is refused rather than resumed on another stream.
* ``torch.random.fork_rng()`` forks compile_rng's CPU stream too
  (:mod:`compile_rng.installation`): the block's draws do not move the stream outside it.

A resume is exact when every draw after it depends only on what the state holds: the
stream position of every device, the declared run seed and its position (named steps
and per-name streams), and the canonical stream's version.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from compile_rng.stream import STREAM_VERSION, agreement, state

VERSION = 1  # of the saved dict's layout


def state_dict() -> dict[str, Any]:
    """This process's streams: ``{"version": 1, "stream": 1, "streams": {device_type:
    {"seed", "offset"}}}``, with ``"run": {"seed", "offset"}`` when a run seed is declared
    (``compile_rng.run_seed``)."""
    streams = {kind: {"seed": seed, "offset": offset} for kind, (seed, offset) in state.snapshot().items()}
    saved: dict[str, Any] = {"version": VERSION, "stream": STREAM_VERSION, "streams": streams}
    run = state.run_position()
    if run is not None:
        saved["run"] = {"seed": run[0], "offset": run[1]}
    return saved


def load_state_dict(saved: dict[str, Any]) -> None:
    """Restore the streams a :func:`state_dict` saved. A state of another layout or
    canonical stream version, or one holding a device type this process lacks (a GPU run
    resumed on CPU), raises instead of resuming on other numbers."""
    if not isinstance(saved, dict) or saved.get("version") != VERSION:
        found = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"compile_rng.load_state_dict: unknown state version {found!r} (expected {VERSION})")
    # states saved before the version was recorded were all drawn by stream 1
    stream = saved.get("stream", 1)
    if stream != STREAM_VERSION:
        raise ValueError(
            f"compile_rng.load_state_dict: the state was saved by canonical stream version {stream!r}; this "
            f"compile_rng draws version {STREAM_VERSION}, so the same position would give other numbers. Resume "
            "with the compile_rng release that saved it"
        )
    available = state.device_types()
    missing = sorted(set(saved["streams"]) - set(available))
    if missing:
        raise ValueError(
            f"compile_rng.load_state_dict: the checkpoint holds streams for {missing}, which this process "
            f"does not have (it has {available})"
        )
    run = saved.get("run")
    state.load(
        {kind: (int(s["seed"]), int(s["offset"])) for kind, s in saved["streams"].items()},
        None if run is None else (int(run["seed"]), int(run["offset"])),
    )


class StreamState:
    """compile_rng's streams as a ``torch.distributed.checkpoint`` ``Stateful``::

        dcp.save({"model": model_sd, "optim": optim_sd, "rng": compile_rng.StreamState()}, ...)
        dcp.load({..., "rng": compile_rng.StreamState()}, ...)   # restores the stream

    and as an ``accelerate`` checkpointing object
    (``accelerator.register_for_checkpointing(compile_rng.StreamState())``).
    ``per_rank=True`` saves each rank's streams under its own key (``rank<N>``): for ranks
    that draw from different streams. Without it all ranks must agree when saving, and
    after loading. :attr:`loaded` says whether a checkpoint has been loaded into it.
    """

    def __init__(self, per_rank: bool = False):
        self.per_rank = per_rank
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        mine = state_dict()
        rank = _rank()
        if rank is None:
            return mine
        if self.per_rank:
            return {f"rank{rank}": mine}
        _require_ranks_agree(mine, "saves", "a checkpoint keeps one copy: use StreamState(per_rank=True)")
        return mine

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        rank = _rank()
        if self.per_rank and rank is not None:
            saved = saved[f"rank{rank}"]
        load_state_dict(saved)
        if not self.per_rank and rank is not None:
            _require_ranks_agree(
                state_dict(), "loaded",
                "every rank must load the same checkpoint (or save with StreamState(per_rank=True))",
            )
        self.loaded = True


def _file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"compile_rng_state_{rank}.json")


def save_to_folder(folder: str, rank: int, world: int) -> None:
    """Write this rank's streams into the checkpoint folder ``folder``
    (``compile_rng_state_<rank>.json``; every rank writes its own)."""
    with open(_file(folder, rank), "w") as f:
        json.dump({"rank": rank, "world": world, "state": state_dict()}, f)


class MissingStreamState(RuntimeError):
    """A checkpoint to resume from holds no compile_rng state."""


def load_from_folder(folder: str, rank: int, world: int, who: str) -> None:
    """Restore the streams :func:`save_to_folder` wrote into ``folder``: rank ``rank``'s own
    when the checkpoint was saved by ``world`` ranks; under another number of ranks (an
    elastic restart) the one stream every saving rank held, refused if they differed.
    Raises :class:`MissingStreamState` when the folder holds none."""
    saved = {}
    for path in glob.glob(os.path.join(folder, "compile_rng_state_*.json")):
        with open(path) as f:
            content = json.load(f)
        saved[content["rank"]] = content
    if not saved:
        raise MissingStreamState(
            f"{who}: the checkpoint {folder} holds no compile_rng state (it was saved without compile_rng, or "
            "with a release that did not save it). Resumed on the stream this process happens to be at, every "
            "random op after it would draw other numbers than the run that saved it, and the curve would "
            "silently part. Resume it without compile_rng, or from a checkpoint saved with it"
        )
    if len({c["world"] for c in saved.values()}) == 1 and next(iter(saved.values()))["world"] == world:
        if rank not in saved:
            raise MissingStreamState(f"{who}: the checkpoint {folder} holds no compile_rng state for rank {rank}")
        load_state_dict(saved[rank]["state"])
        return
    states = {r: c["state"] for r, c in sorted(saved.items())}
    if any(s != states[min(states)] for s in states.values()):
        raise RuntimeError(
            f"{who}: the checkpoint {folder} was saved by {len(states)} ranks with different streams, so it "
            f"cannot resume on {world} ranks: resume on the number of ranks that saved it"
        )
    load_state_dict(states[min(states)])


def _require_ranks_agree(mine: dict[str, Any], when: str, advice: str) -> None:
    """Raise on every rank unless all hold the streams ``mine`` (a :func:`state_dict`):
    each stream's seed and offset, and the declared run position, agreed in one gather."""
    import torch.distributed as dist

    fields, values = [], []
    for kind in sorted(mine["streams"]):
        for name in ("seed", "offset"):
            fields.append(f"{kind} {name}")
            values.append(mine["streams"][kind][name])
    run = mine.get("run")
    fields += ["run seed declared", "run seed", "run offset"]
    values += [int(run is not None), run["seed"] if run else 0, run["offset"] if run else 0]
    agreement.require_agreement(
        [dist.group.WORLD], tuple(values), tuple(fields),
        f"compile_rng.StreamState: the ranks {when} different streams", advice,
    )


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
