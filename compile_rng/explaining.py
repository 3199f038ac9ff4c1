"""``compile_rng.explain``: compile a function with a collecting backend and report
every random op it runs (:mod:`compile_rng.report` turns the plans into text)."""

from __future__ import annotations

from typing import Any

import sympy
import torch

from . import dispatch_modes, state
from .dynamo_backend import Backend, BackendConfig
from .report import OpReport, Report


def explain(fn: Any, *args: Any, mode: str = "tracker", **kwargs: Any) -> Report:
    """Report every random op ``fn(*args, **kwargs)`` runs through compile_rng.

    Compiles ``fn`` with ``compile_rng.backend(mode, inner="aot_eager")`` and calls it
    once (its outputs are discarded and compile_rng's state is restored afterwards).
    Random ops with no counter-based form are listed with the reason instead of raising.
    """
    if mode not in dispatch_modes.MODES:
        raise ValueError(f"compile_rng.explain: mode must be one of {dispatch_modes.MODES}, got {mode!r}")
    be = Backend(BackendConfig(mode, "aot_eager", collect_unsupported=True))
    saved = state.snapshot()
    try:
        torch.compile(fn, backend=be)(*args, **kwargs)
    finally:
        state.restore(saved)
    ops = [OpReport.from_op(op) for plan in be.plans for op in plan.ops]
    total = sum((plan.total_advance for plan in be.plans), sympy.Integer(0))
    return Report(ops, total, [u for plan in be.plans for u in plan.unsupported])
