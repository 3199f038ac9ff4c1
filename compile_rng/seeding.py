"""Seeding: restart the stream and make compile_rng DTensor's RNG tracker.

``torch.manual_seed(s)`` - what every training script already calls on every rank -
is wrapped on import so that it also does :func:`manual_seed`.
"""

from __future__ import annotations

import functools

import torch

from . import state, tracker


def manual_seed(seed: int) -> None:
    """Restart the stream at ``(seed, 0)`` and install compile_rng as DTensor's RNG
    tracker. ``seed`` is a full uint64; call it with the same seed on every rank."""
    state.manual_seed(seed)
    tracker.install()


def install_manual_seed_hook() -> None:
    """Make ``torch.manual_seed(s)`` also call :func:`manual_seed` (idempotent).

    ``torch.manual_seed`` is looked up at call time by nearly every caller (training
    scripts, Lightning's ``seed_everything``, DTensor), so wrapping the module
    attributes covers the habit.
    """
    original = torch.random.manual_seed
    if getattr(original, "_compile_rng_hook", False):
        return

    @functools.wraps(original)
    def manual_seed_hook(seed):
        result = original(seed)
        # torch accepts negative seeds and reduces them mod 2**64; mirror that.
        manual_seed(int(seed) % state.UINT64)
        return result

    manual_seed_hook._compile_rng_hook = True
    torch.random.manual_seed = manual_seed_hook
    torch.manual_seed = manual_seed_hook
