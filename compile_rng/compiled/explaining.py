"""``compile_rng.explain``: compile a function with a collecting backend and report
every random op it runs (:mod:`compile_rng.debug.report` turns the plans into text)."""

from __future__ import annotations

from typing import Any

import sympy
import torch

from compile_rng.compiled.backend import Backend, BackendConfig
from compile_rng.debug.report import OpReport, Report
from compile_rng.semantics import layouts
from compile_rng.stream import state


def explain(fn: Any, *args: Any, layout: str = "tracker", mode: str | None = None, **kwargs: Any) -> Report:
    """Report every random op ``fn(*args, **kwargs)`` runs through compile_rng.

    Compiles ``fn`` with ``compile_rng.backend(layout, inner="aot_eager")`` and calls it
    once (its outputs are discarded and compile_rng's state is restored afterwards).
    Random ops with no counter-based form are listed with the reason instead of raising.
    """
    layout = layouts.renamed_keyword("compile_rng.explain", layout, mode)
    be = Backend(BackendConfig(layout, "aot_eager", collect_unsupported=True))
    saved = state.snapshot()
    try:
        torch.compile(fn, backend=be)(*args, **kwargs)
    finally:
        state.restore(saved)
    ops = [OpReport.from_op(op) for plan in be.plans for op in plan.ops]
    total = sum((plan.total_advance for plan in be.plans), sympy.Integer(0))
    return Report(ops, total, [u for plan in be.plans for u in plan.unsupported])
