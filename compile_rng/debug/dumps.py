"""``with compile_rng.dump(path):`` - depyf's dump plus the graphs before/after the pass."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from compile_rng.debug.report import annotated_code

_dump_dir: contextvars.ContextVar[Path | None] = contextvars.ContextVar("compile_rng_dump_dir", default=None)


@contextlib.contextmanager
def dump(path: str | Path) -> Iterator[Path]:
    """Dump everything ``torch.compile`` and compile_rng produce inside the block.

    ``path`` gets depyf's usual files (decompiled bytecode, every graph Dynamo and
    AOTAutograd produced) and, for each graph compile_rng rewrote,
    ``<function>.<compile id>.compile_rng_before.py`` / ``..._after.py``: the graph
    before and after the pass, the after file with a comment above every functional
    random call (original op, placements, global shape, start offset and base advance
    as sympy expressions). With several ranks each writes to ``path/rank<r>``. Yields
    the folder used.
    """
    import depyf

    folder = Path(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        folder = folder / f"rank{dist.get_rank()}"
    folder.mkdir(parents=True, exist_ok=True)
    token = _dump_dir.set(folder)
    try:
        with depyf.prepare_debug(str(folder)):
            yield folder
    finally:
        _dump_dir.reset(token)


def dumping() -> bool:
    """Whether a :func:`dump` block is open (its graphs must come from this compile)."""
    return _dump_dir.get() is not None


def write_plan(plan) -> None:
    """Called by the backend after each compile: writes the plan's files if dumping."""
    folder = _dump_dir.get()
    if folder is None or not plan.graphs:
        return
    stem = folder / f"{plan.name}.compile_rng"
    stem.with_name(stem.name + "_before.py").write_text(
        f"# compile_rng: {plan.name} before the pass\n" + plan.graphs_before[-1]
    )
    stem.with_name(stem.name + "_after.py").write_text(annotated_code(plan))
