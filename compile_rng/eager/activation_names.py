"""Names for eager random ops in a step with ``names=`` (the rule:
:mod:`compile_rng.semantics.named_draws`), and the pipeline stages' microbatch rows.

The names come from global module forward hooks (``torch.nn.modules.module``'s public
``register_module_forward_pre_hook`` / ``register_module_forward_hook``), installed for the
step only: a stack of the named modules running, their call counts in the current
forward of a root, and each call's count of random ops.

* A *root* is a module given as ``names=`` (or a ``PipelineStage``'s ``submod``); names
  are FQNs relative to it, so a stage built as torchtitan builds one (a deep copy of the
  model with the other stages' layers deleted, layers in a ``ModuleDict`` keyed by their
  original index) names its modules as the unsplit model does.
* Activation checkpointing recomputes a module's forward in backward, outside any root
  forward: the recomputation counts calls and ops afresh from that module, which gives
  the forward's names as long as the module (and every module under it) ran once per
  forward; otherwise the draw is refused.
* A ``PipelineStage`` runs microbatch ``i`` in ``forward_one_chunk(i, ...)`` and its
  backward in ``backward_one_chunk(i, ...)`` (GPipe, 1F1B, interleaved 1F1B; torch 2.13 -
  2.15): for the step, those two methods of each stage are wrapped (on the instance) to
  make the microbatch's rows current - ``torch.tensor_split``'s rows, the schedules'
  default split of dim 0.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules import module as nn_module

from compile_rng.semantics.model_names import module_names
from compile_rng.semantics.named_draws import activation_name, activation_seed
from compile_rng.semantics.rows import Rows, current_rows, reset_rows, set_rows


def microbatch_rows(rows: Rows, microbatches: int, index: int) -> Rows:
    """Rows of microbatch ``index`` when this rank's ``rows`` are split into
    ``microbatches`` by ``torch.tensor_split`` (the first ``count % microbatches`` get one more)."""
    q, r = divmod(rows.count, microbatches)
    return rows.sub(index * q + min(index, r), q + (index < r))


def _is_stage(obj: object) -> bool:
    return all(hasattr(obj, a) for a in ("submod", "forward_one_chunk", "backward_one_chunk"))


class ActivationNames:
    """The :class:`~compile_rng.semantics.named_draws.Namer` of one step."""

    def __init__(self, roots: Sequence[nn.Module], start: dict[str, tuple[int, int]], split: bool):
        """``roots``: the modules whose FQNs name the ops; ``start``: every device type's
        ``(seed, base)`` at the step's start; ``split``: the roots are pipeline stages
        (an op in a stage module's own forward has no name in the unsplit model)."""
        self.start, self.split = start, split
        self.fqn: dict[int, str] = {}
        for root in roots:
            if isinstance(root, fx.GraphModule):
                raise NotImplementedError(
                    "compile_rng.step(names=...): the stage module is an fx.GraphModule (a "
                    "torch.distributed.pipelining.pipeline() split): tracing inlined the model's modules, so "
                    "its random ops have no module names. Split the model by hand (a deep copy with the other "
                    "stages' layers deleted, as torchtitan does) and pass those stages"
                )
            self.fqn.update(module_names(root))
        self.roots = {id(r) for r in roots}
        self.stack: list[tuple[nn.Module, str, int | None]] = []
        self.calls: dict[str, int] = {}
        self.ordinals: dict[tuple[str, int], int] = {}
        self.ran_twice: set[str] = set()  # modules called more than once in a forward
        # root forwards per (root, rows): the k-th forward over the same rows draws new masks
        self.forwards: dict[tuple[int, Rows], int] = {}
        self.forward: int | None = 0  # of the forward running; None: a recomputation

    # --- module hooks --------------------------------------------------------------

    def enter(self, module: nn.Module, args: Any) -> None:
        fqn = self.fqn.get(id(module))
        if fqn is None:
            return
        if not self.stack:
            # a root's forward, or a recomputation (activation checkpointing) in backward
            self.calls, self.ordinals = {}, {}
            self.forward = self._count_forward(module) if id(module) in self.roots else None
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        if call:
            self.ran_twice.add(fqn)
        self.stack.append((module, fqn, call))

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1][0] is module:
            self.stack.pop()

    # --- Namer ---------------------------------------------------------------------

    def position(self, op: object, advance: int, device: torch.device) -> tuple[int, int]:
        if not self.stack:
            raise RuntimeError(
                f"compile_rng: {op} ran in a step with names= but outside the forward of any module "
                "given as names= (it has no name in the model). Move it into the model's forward, "
                "or draw it outside the step. If activation checkpointing recomputes it in backward, "
                "checkpoint a module (checkpoint(self.mlp, x)) rather than a function: the module's call names it"
            )
        outermost = self.stack[0][0]
        module, fqn, call = self.stack[-1]
        if id(outermost) not in self.roots:
            self._check_recomputation(op)
        if self.split and id(module) in self.roots:
            raise NotImplementedError(
                f"compile_rng: {op} ran in the pipeline stage module's own forward: a stage module is "
                "not a module of the unsplit model, so the op has no name in it. Draw it in a submodule"
            )
        ordinal = self.ordinals.get((fqn, call), 0)
        self.ordinals[(fqn, call)] = ordinal + 1
        seed, base = self.start[device.type]
        return activation_seed(seed, activation_name(fqn, call, ordinal, self.forward or 0)), base

    def _count_forward(self, root: nn.Module) -> int:
        """This forward's index among the root's forwards over the current rows (the
        schedule's shape inference, outside any microbatch, is not counted)."""
        rows = current_rows()
        if rows is None:
            return 0
        index = self.forwards.get((id(root), rows), 0)
        self.forwards[(id(root), rows)] = index + 1
        return index

    def _check_recomputation(self, op: object) -> None:
        repeated = [fqn for _, fqn, _ in self.stack if fqn in self.ran_twice]
        if repeated:
            raise NotImplementedError(
                f"compile_rng: {op} is recomputed (activation checkpointing) in {repeated[-1]!r}, a "
                "module that ran more than once in a forward: which call is recomputed is unknown, so "
                "its name is. Checkpoint a module that runs once per forward"
            )
        if any(count > 1 for count in self.forwards.values()):
            raise NotImplementedError(
                f"compile_rng: {op} is recomputed (activation checkpointing) in a step that ran the model "
                "more than once over the same rows: which forward is recomputed is unknown, so its name is. "
                "Run one forward per step (or per microbatch) with checkpointing, or do not checkpoint"
            )

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        pre = nn_module.register_module_forward_pre_hook(self.enter)
        post = nn_module.register_module_forward_hook(self.leave, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


def roots_of(names: Any) -> tuple[list[nn.Module], list[Any]]:
    """``(root modules, pipeline stages)`` of a step's ``names=``: a module, a
    ``PipelineStage``, or a list of them."""
    items = list(names) if isinstance(names, (list, tuple)) else [names]
    roots, stages = [], []
    for item in items:
        if _is_stage(item):
            stages.append(item)
            roots.append(item.submod)
        elif isinstance(item, nn.Module):
            roots.append(item)
        else:
            raise TypeError(
                f"compile_rng.step(names=...): expected nn.Module or PipelineStage objects, got {type(item).__name__}"
            )
    if stages and len(stages) != len(items):
        raise TypeError("compile_rng.step(names=...): pass either the pipeline stages or the model, not both")
    return roots, stages


@contextlib.contextmanager
def microbatch_rows_of(stages: Sequence[Any], rows: Rows, microbatches: int) -> Iterator[None]:
    """Within the block, each stage's forward and backward of microbatch ``i`` run with
    microbatch ``i``'s rows current (the stages' methods wrapped on the instances)."""

    def wrapped(method):
        @functools.wraps(method)
        def run(chunk: int, *args, **kwargs):
            if not 0 <= chunk < microbatches:
                raise ValueError(
                    f"compile_rng.step: the schedule ran microbatch {chunk}, but the step was given "
                    f"microbatches={microbatches}; pass the schedule's n_microbatches"
                )
            token = set_rows(microbatch_rows(rows, microbatches, chunk))
            try:
                return method(chunk, *args, **kwargs)
            finally:
                reset_rows(token)

        return run

    names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    patched = [(stage, name) for stage in stages for name in names if hasattr(stage, name)]
    for stage, name in patched:
        setattr(stage, name, wrapped(getattr(stage, name)))
    try:
        yield
    finally:
        for stage, name in patched:
            delattr(stage, name)  # the class's method again
