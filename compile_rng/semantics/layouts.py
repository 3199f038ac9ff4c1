"""The counter layouts (docs/contract.md §3): their names, the layout eager DTensor random
ops use here (:func:`layout`), and the old spelling ``mode=`` (deprecated: *mode* is
``torch.compile``'s word, and a dispatch mode's).

* ``"tracker"`` - eager DTensor's semantics: replicas equal, shards different; a plain
  tensor is a replica on a one-rank mesh;
* ``"invariant"`` - every element draws the counter of its global row-major index, so
  the full tensor does not depend on the sharding.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator

LAYOUTS = ("tracker", "invariant")
_eager_layout: contextvars.ContextVar[str] = contextvars.ContextVar("compile_rng_layout", default="tracker")


def check(where: str, name: str) -> str:
    """``name`` if it is a layout, else a ValueError naming ``where``."""
    if name not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {name!r}")
    return name


def current_layout() -> str:
    """The layout :func:`layout` selects for eager DTensor random ops here."""
    return _eager_layout.get()


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    """Counter layout of eager DTensor random ops inside the block (``"tracker"`` by
    default, or ``"invariant"``). Compiled graphs take the layout of their backend; code
    that graph-breaks out of one runs eagerly, so wrap the call in the same layout
    (``@compile_rng.init`` does)."""
    token = _eager_layout.set(check("compile_rng.layout", name))
    try:
        yield
    finally:
        _eager_layout.reset(token)


def warn_renamed(old: str, new: str, stacklevel: int) -> None:
    """Warn that ``old`` is the deprecated spelling of ``new``."""
    _deprecated(old, new, stacklevel + 1)


def _deprecated(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} names the counter layout; spell it {new} (the old spelling goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def renamed_keyword(where: str, layout: str, mode: str | None) -> str:
    """The layout of a call whose ``mode=`` keyword is the old spelling of ``layout=``
    (``compile_rng.init``, ``compile_rng.explain``): ``mode`` wins with a warning."""
    if mode is None:
        return check(where, layout)
    _deprecated(f"{where}(mode={mode!r})", f"layout={mode!r}", stacklevel=3)
    if layout not in ("tracker", mode):
        raise ValueError(f"{where}: layout={layout!r} and mode={mode!r} disagree; pass layout= only")
    return check(where, mode)


def layout_or_compile_mode(where: str, layout: str, mode: str | None) -> tuple[str, str | None]:
    """``(layout, torch.compile mode)`` from a call that takes both (``compile_rng.compile``,
    ``compile_rng.backend``): ``mode=`` naming a counter layout is the old spelling of
    ``layout=``, any other value is ``torch.compile``'s."""
    if mode not in LAYOUTS:
        return check(where, layout), mode
    return renamed_keyword(where, layout, mode), None
