"""The Philox state ``(seed, offset)`` per device type, both uint64.

On CPU, whose generator is not counter-based, compile_rng keeps the state itself
(:mod:`compile_rng.installation` makes ``torch.manual_seed`` restart it). On CUDA the state *is* the device
generator's Philox state (``initial_seed()``, ``get_offset()``), so compiled
compile_rng ops and eager CUDA ops share one stream.
"""

from __future__ import annotations

import threading

import torch

UINT64 = 2**64

_lock = threading.Lock()
_cpu_state: list[int] = [0, 0]
_seedings = [0]  # how many times manual_seed ran: rank-agreement checks restart with each


def check_uint64(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"compile_rng: {name} must be an int in [0, 2**64), got {value!r}")
    if not 0 <= value < UINT64:
        raise ValueError(f"compile_rng: {name} must be in [0, 2**64), got {value}")
    return value


def _device_type(device: str | torch.device) -> str:
    return torch.device(device).type


def _cuda_generator() -> torch.Generator:
    return torch.cuda.default_generators[torch.cuda.current_device()]


def manual_seed(seed: int) -> None:
    """Restart every device's stream at ``(seed, 0)``. ``seed`` is a full uint64."""
    seed = check_uint64("seed", seed)
    with _lock:
        _cpu_state[:] = [seed, 0]
        _seedings[0] += 1
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def seedings() -> int:
    """How many times :func:`manual_seed` has run in this process."""
    return _seedings[0]


def get_state(device: str | torch.device = "cpu") -> tuple[int, int]:
    """The current ``(seed, offset)`` of ``device``'s stream."""
    kind = _device_type(device)
    if kind == "cpu":
        with _lock:
            return _cpu_state[0], _cpu_state[1]
    if kind == "cuda":
        gen = _cuda_generator()
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
    elif kind == "cuda":
        gen = _cuda_generator()
        gen.manual_seed(seed)
        gen.set_offset(offset)
    else:
        raise NotImplementedError(f"compile_rng: no Philox state for device type {kind!r}")


def advance(increment: int, device: str | torch.device = "cpu") -> tuple[int, int]:
    """Reserve ``increment`` counters; returns the ``(seed, offset)`` before the advance.

    Raises instead of wrapping when the offset would pass 2**64: a wrapped stream
    would silently repeat values.
    """
    if increment < 0:
        raise ValueError(f"compile_rng: negative state advance {increment}")
    kind = _device_type(device)
    if kind != "cpu":
        seed, offset = get_state(device)
        set_state(seed, _checked_sum(offset, increment), device)
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
