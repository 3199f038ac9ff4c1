"""Where an eager random op's counters come from: the step's sequence, or the stream of
the op's name (``compile_rng.step(names=...)``, docs/contract.md §3.6).

Without names, an op reserves its counters from the device's state (``state.advance``):
its values depend on every op that ran before it, on this rank. A pipeline stage does
not run the ops of the stages before it, so inside a step with ``names=`` every op draws
from a stream named by where it sits in the model instead:

* its name is :func:`activation_name` - ``fqn`` the innermost module running it (its
  name in a DCP checkpoint of the unsplit model: wrappers left out,
  :mod:`compile_rng.semantics.model_names`), ``call`` how many times that module ran
  before in this forward, ``ordinal`` how many random ops this call of it ran before,
  ``forward`` how many forwards of the model ran before over the same rows in this step
  (a second forward of the same batch - SimCSE, two views - draws new masks);
* its seed is :func:`activation_seed` ``(seed, name)`` and its counters start at the
  ``base`` of the step - ``(seed, base)`` is the device's state when the step began -
  plus its row window of the step's global batch (:func:`compile_rng.semantics.rows.batch_window`);
* the step ends at ``base + STEP_STRIDE`` on every device type, whatever ran in it, so
  every stage, data-parallel rank and microbatch split starts the next step at the same
  position. One op may draw at most ``STEP_STRIDE`` counters per step.

The naming itself (module hooks, the pipeline's microbatches) is eager code
(:mod:`compile_rng.eager.activation_names`); a compiled graph's ops are named from the
modules its frame runs them in (:mod:`compile_rng.compiled.named_keys`) by the same
rule; this module is the rule both sides share.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Protocol

import torch

from compile_rng.stream import named_seed, state

ACTIVATION_DOMAIN = b"compile_rng/activation/v1"
#: how far a step with names moves every device's offset (2**24 steps fit in 2**64)
STEP_STRIDE = 2**40


def activation_name(fqn: str, call: int, ordinal: int, forward: int) -> str:
    """``"{fqn}:{call}:{ordinal}"`` for a step's first forward over its rows, with
    ``"@{forward}"`` appended for the later ones."""
    name = f"{fqn}:{call}:{ordinal}"
    return f"{name}@{forward}" if forward else name


@functools.lru_cache(maxsize=65536)
def activation_seed(seed: int, name: str) -> int:
    """The seed of the activation stream ``name`` (cached: a step computes each name's
    seed once per run seed, not once per element or per step)."""
    return named_seed(seed, ACTIVATION_DOMAIN, name)


class Namer(Protocol):
    """Names the random op about to draw (``compile_rng.eager.activation_names``)."""

    def position(self, op: object, advance: int, device: torch.device) -> tuple[int, int]:
        """``(seed, base)`` of ``op``'s draw of ``advance`` counters on ``device``."""
        ...

    def graph_positions(
        self, graph: str, frame: object, sites: list, module_calls: dict, device: torch.device
    ) -> list[tuple[int, int]]:
        """``(seed, base)`` of each random op of compiled graph ``graph`` about to run from
        ``frame`` (the ops' module sites and the graph's module calls: the pass's plan)."""
        ...


_namer: contextvars.ContextVar[Namer | None] = contextvars.ContextVar("compile_rng_namer", default=None)


def current_namer() -> Namer | None:
    return _namer.get()


def set_namer(namer: Namer | None) -> contextvars.Token:
    return _namer.set(namer)


def reset_namer(token: contextvars.Token) -> None:
    _namer.reset(token)


def draw_position(op: object, advance: int, device: torch.device) -> tuple[int, int]:
    """``(seed, base)`` for an eager draw of ``advance`` counters: from the op's name
    inside a step with names, else reserved from the device's state."""
    namer = _namer.get()
    if namer is None:
        return state.advance(advance, device)
    check_step_draw(op, advance)
    return namer.position(op, advance, device)


def check_step_draw(what: object, advance: int) -> None:
    """Raise ValueError where ``what`` (an op, a compiled graph) draws ``advance`` counters
    in a step with names, more than its named stream holds: the next step starts
    :data:`STEP_STRIDE` further on."""
    if advance > STEP_STRIDE:
        raise ValueError(
            f"compile_rng: {what} draws {advance} counters in a step with names=, more than the "
            f"{STEP_STRIDE} a named stream holds per step"
        )
