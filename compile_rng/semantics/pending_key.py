"""The pending key: the placeholder a traced DTensor random op reads its key from.

While AOTAutograd traces a graph for the backend, compile_rng's tracker
(:mod:`compile_rng.eager.tracker`) replaces a DTensor random op with a functional op on
``compile_rng::pending_key(site)``, and records the op's :class:`Site` in the node's
``meta``; the pass (:mod:`compile_rng.passes.functionalize_rng`) resolves it to the
graph's key input. This module imports no DTensor: the pass needs only these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from compile_rng.semantics.spmd import Sharding


@torch.library.custom_op("compile_rng::pending_key", mutates_args=())
def pending_key(site: int, device: torch.device) -> torch.Tensor:
    """Stands for the graph's key during tracing; never runs."""
    raise RuntimeError(
        "compile_rng internal error: a traced DTensor random op was not resolved by the "
        "compile_rng pass; compile with backend='compile_rng'"
    )


@pending_key.register_fake
def _(site, device):
    return torch.empty(2, dtype=torch.int64, device=device)


@dataclass
class Site:
    """A DTensor random op seen while tracing (for the pass, dumps and reports)."""

    op: str
    layout: str
    sharding: Sharding
    start: Any  # SymInt/int: offset of the rank's first counter within the op's range
    advance: Any  # SymInt/int: counters the op reserves
    coords: tuple  # the runtime mesh coordinate (SymInts) ``start`` is a function of
    mesh: Any = None  # the DeviceMesh (verify=True checks over the ranks that run the graph)

#: ``node.meta`` key of a ``pending_key`` node's :class:`Site`: the graph carries what the
#: pass needs, and it goes away with the graph (no registry outlives a compile).
SITE = "compile_rng_site"
