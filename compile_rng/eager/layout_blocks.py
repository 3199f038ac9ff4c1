"""``compile_rng.layout(...)``: the counter layout of eager DTensor random ops in a block.

Eager DTensor random ops in the block draw at the layout's counters
(:mod:`compile_rng.semantics.layouts`). A graph compiled by another backend that draws in
the block is refused: its random ops would be torch's per-rank draws on local tensors
(stock Inductor's, a library's own ``torch.compile`` of an optimizer step), not the
layout's - the user asked for a layout and would get torch's values silently. Compile such
code with compile_rng's backend (:func:`compile_rng.library_compiles` for a library's own
compiles).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from compile_rng.eager.dispatch_modes import foreign_graphs_refused
from compile_rng.semantics import layouts


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    """Counter layout of eager DTensor random ops inside the block (``"tracker"`` by
    default, or ``"invariant"``); a graph compiled by another backend that draws inside it
    raises, naming the fix. Compiled graphs take the layout of their backend; code that
    graph-breaks out of one runs eagerly, so wrap the call in the same layout
    (``@compile_rng.init`` does)."""
    with layouts.layout(name), foreign_graphs_refused():
        yield


def mode(name: str) -> contextlib.AbstractContextManager[None]:
    """Deprecated spelling of :func:`layout`."""
    layouts.warn_renamed("compile_rng.mode(...)", "compile_rng.layout(...)", stacklevel=3)
    return layout(name)
