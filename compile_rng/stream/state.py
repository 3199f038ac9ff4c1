"""The Philox state ``(seed, offset)`` per device type, both uint64 (docs/contract.md §1).

On CPU, whose generator is not counter-based, compile_rng keeps the state itself
(:mod:`compile_rng.installation` makes ``torch.manual_seed`` restart it). On CUDA (and
XPU) the state *is* the current device's generator's Philox state (``initial_seed()``,
``get_offset()``), so compile_rng ops and eager CUDA ops share one stream, and
``torch.manual_seed`` restarts it.

That generator is also what code outside compile_rng draws from (a data pipeline's
augmentation between a step's microbatches), so compile_rng never moves it backwards: a
block that draws from an earlier position of an accelerator stream (every microbatch of
a step restarts at the step's position) *holds* that stream (:func:`held`). Inside it the
stream's position is the block's own; each draw only moves torch's generator forward, to
the end of the draw where that passes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import torch

from compile_rng.stream import UINT64

_lock = threading.Lock()
_cpu_state: list[int] = [0, 0]
_seedings = [0]  # how many times manual_seed ran: rank-agreement checks restart with each
# The run's declared seed and the named streams' position (:func:`run_seed`), or None.
_run: list[int] | None = None


def check_uint64(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"compile_rng: {name} must be an int in [0, 2**64), got {value!r}")
    if not 0 <= value < UINT64:
        raise ValueError(f"compile_rng: {name} must be in [0, 2**64), got {value}")
    return value


#: the CPU device: an eager draw passing this one skips reading its type
CPU = torch.device("cpu")


def _device_type(device: str | torch.device) -> str:
    if device is CPU:  # `.type` makes a string per read (~0.2 us), and every eager draw asks
        return "cpu"
    return device.type if isinstance(device, torch.device) else torch.device(device).type


#: device types whose state is the device generator's Philox state
ACCELERATORS = ("cuda", "xpu")

# The accelerator streams a block holds: device type -> [seed, offset], the block's own
# position (a mutable list: a copy of the context - a backward's device thread - shares it).
_held: contextvars.ContextVar[dict[str, list[int]] | None] = contextvars.ContextVar(
    "compile_rng_held_streams", default=None
)


def _holding(start: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """The holds of the current context with ``start``'s accelerator streams added."""
    hold = dict(_held.get() or {})
    for kind, (seed, offset) in start.items():
        if kind in ACCELERATORS:
            hold[kind] = [check_uint64("seed", seed), check_uint64("offset", offset)]
    return hold


def hold(start: dict[str, tuple[int, int]]) -> None:
    """Hold ``start``'s accelerator streams at its positions in the current context, for
    good: for a private copy of a context (a recomputation's)."""
    _held.set(_holding(start))


@contextlib.contextmanager
def held(start: dict[str, tuple[int, int]]) -> Iterator[None]:
    """Every stream of ``start`` (a :func:`snapshot`) at its position there inside the
    block: the CPU stream (compile_rng's alone) is set; an accelerator stream is held at
    it, so that torch's generator, which other code draws from, never moves backwards."""
    for kind, (seed, offset) in start.items():
        if kind not in ACCELERATORS:
            set_state(seed, offset, kind)
    token = _held.set(_holding(start))
    try:
        yield
    finally:
        _held.reset(token)


def _held_position(kind: str) -> list[int] | None:
    hold = _held.get()
    return None if hold is None else hold.get(kind)


def _forward(kind: str, seed: int, offset: int) -> None:
    """Move ``kind``'s generator forward to ``offset`` if it is behind it on ``seed``."""
    gen = _generator(kind)
    if gen.initial_seed() % UINT64 == seed and gen.get_offset() < offset:
        gen.set_offset(offset)


def serves(mesh: object) -> bool:
    """Whether compile_rng's semantics apply to ``mesh``'s random ops: its device type has
    a compile_rng stream (CPU, CUDA, XPU)."""
    device_type = mesh.device_type
    return device_type == "cpu" or device_type in ACCELERATORS


def _generator(kind: str) -> torch.Generator:
    module = getattr(torch, kind)
    return module.default_generators[module.current_device()]


def device_of(kind: str) -> torch.device:
    """The device a stream of device type ``kind`` lives on (the current one)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind not in ACCELERATORS:
        raise NotImplementedError(f"compile_rng: no Philox state for device type {kind!r}")
    return torch.device(kind, getattr(torch, kind).current_device())


def manual_seed(seed: int) -> None:
    """Restart every device's stream at ``(seed, 0)``. ``seed`` is a full uint64."""
    seed = check_uint64("seed", seed)
    with _lock:
        _cpu_state[:] = [seed, 0]
        _seedings[0] += 1
    for kind in device_types()[1:]:
        getattr(torch, kind).manual_seed_all(seed)
        position = _held_position(kind)
        if position is not None:
            position[:] = [seed, 0]


def load(streams: dict[str, tuple[int, int]], run: tuple[int, int] | None) -> None:
    """Put every device's stream and the run position where a checkpoint left them. Counts
    as a seeding: checks that ranks agree (:func:`seedings`) run again after it."""
    for kind, (seed, offset) in streams.items():
        set_state(seed, offset, kind)
    set_run_position(run)
    with _lock:
        _seedings[0] += 1


def seedings() -> int:
    """How many times :func:`manual_seed` (or :func:`load`) has run in this process."""
    return _seedings[0]


def get_state(device: str | torch.device = "cpu") -> tuple[int, int]:
    """The current ``(seed, offset)`` of ``device``'s stream."""
    kind = _device_type(device)
    if kind == "cpu":
        with _lock:
            return _cpu_state[0], _cpu_state[1]
    if kind in ACCELERATORS:
        position = _held_position(kind)
        if position is not None:
            return position[0], position[1]
        gen = _generator(kind)
        return gen.initial_seed() % UINT64, gen.get_offset()
    raise NotImplementedError(f"compile_rng: no Philox state for device type {kind!r}")


def set_state(seed: int, offset: int, device: str | torch.device = "cpu") -> None:
    """Set ``device``'s stream to ``(seed, offset)``; both uint64."""
    seed = check_uint64("seed", seed)
    offset = check_uint64("offset", offset)
    kind = _device_type(device)
    if kind == "cpu":
        with _lock:
            _cpu_state[:] = [seed, offset]
    elif kind in ACCELERATORS:
        position = _held_position(kind)
        if position is not None:
            position[:] = [seed, offset]
            return
        gen = _generator(kind)
        gen.manual_seed(seed)
        gen.set_offset(offset)
    else:
        raise NotImplementedError(f"compile_rng: no Philox state for device type {kind!r}")


def device_types() -> list[str]:
    """The device types with a stream in this process: the CPU and available accelerators."""
    return ["cpu", *(k for k in ACCELERATORS if hasattr(torch, k) and getattr(torch, k).is_available())]


def snapshot() -> dict[str, tuple[int, int]]:
    """Every device type's ``(seed, offset)`` (for :func:`restore`)."""
    return {kind: get_state(kind) for kind in device_types()}


def restore(saved: dict[str, tuple[int, int]]) -> None:
    """Put back the states a :func:`snapshot` took."""
    for kind, (seed, offset) in saved.items():
        set_state(seed, offset, kind)


def settle(end: dict[str, tuple[int, int]]) -> None:
    """After blocks that :func:`held` the streams: put each at ``end`` (a :func:`snapshot`
    taken inside the last), moving no accelerator generator backwards - code outside
    compile_rng may have drawn past ``end`` from it in the meantime."""
    for kind, (seed, offset) in end.items():
        if kind in ACCELERATORS and _held_position(kind) is None:
            _forward(kind, seed, offset)
        else:
            set_state(seed, offset, kind)


def advance(increment: int, device: str | torch.device = "cpu") -> tuple[int, int]:
    """Reserve ``increment`` counters; returns the ``(seed, offset)`` before the advance.

    Raises instead of wrapping when the offset would pass 2**64: a wrapped stream
    would silently repeat values.
    """
    if increment < 0:
        raise ValueError(f"compile_rng: negative state advance {increment}")
    kind = _device_type(device)
    if kind != "cpu":
        position = _held_position(kind) if kind in ACCELERATORS else None
        if position is not None:
            seed, offset = position
            position[1] = _checked_sum(offset, increment)
            _forward(kind, seed, position[1])
            return seed, offset
        seed, offset = get_state(device)
        # the generator's offset only: re-seeding it per op (set_state) is needless work
        _generator(kind).set_offset(_checked_sum(offset, increment))
        return seed, offset
    with _lock:
        seed, offset = _cpu_state
        _cpu_state[1] = _checked_sum(offset, increment)
        return seed, offset


def _checked_sum(offset: int, increment: int) -> int:
    if offset + increment >= UINT64:
        raise OverflowError(
            f"compile_rng: advancing the offset {offset} by {increment} would pass 2**64; "
            "reseed with compile_rng.manual_seed()"
        )
    return offset + increment


def run_seed(seed: int | None) -> None:
    """Declare the run's seed for named streams (``step(names=...)``, ``init(streams="fqn")``):
    they draw from ``seed`` at the run's own position, which starts at 0 here and which
    neither ``torch.manual_seed`` nor :func:`manual_seed` moves - so ranks seeded apart
    (pipeline stages seeded ``seed + pp_rank``, torchtitan's and Megatron's habit) name
    alike. ``None`` withdraws the declaration (named streams follow each rank's stream again)."""
    global _run
    with _lock:
        _run = None if seed is None else [check_uint64("seed", seed), 0]


def run_position() -> tuple[int, int] | None:
    """``(declared seed, named position)``, or None when no run seed is declared."""
    with _lock:
        return None if _run is None else (_run[0], _run[1])


def set_run_position(position: tuple[int, int] | None) -> None:
    """Set the declared seed and named position (a checkpoint's; None: undeclared)."""
    global _run
    with _lock:
        _run = None if position is None else [check_uint64("seed", position[0]), check_uint64("offset", position[1])]


def advance_run(increment: int) -> None:
    """Move the named position on by ``increment`` (a step with names ended)."""
    with _lock:
        if _run is None:
            raise RuntimeError("compile_rng: no run seed declared")
        _run[1] = _checked_sum(_run[1], increment)
