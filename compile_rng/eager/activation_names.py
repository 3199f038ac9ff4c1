"""Names for eager random ops in a step with ``names=`` (the rule:
:mod:`compile_rng.semantics.named_draws`), and the pipeline stages' microbatch rows.

The names come from global module forward hooks (:func:`enter_hook`, :func:`leave_hook`:
``compile_rng.installation`` registers them at the first step with ``names=`` and removes
them on uninstall; outside such a step they return at once): a stack of the named modules
running, their call counts in the current forward of a root, and each call's count of
random ops.

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
  2.15): for the step, those two methods of each stage are wrapped (on the instance, by
  ``distributed_internals.pipeline_chunks_wrapped``) to make the microbatch's rows current - ``torch.tensor_split``'s rows, the schedules'
  default split of dim 0.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from compile_rng._torch import core_internals, distributed_internals, dynamo_internals
from compile_rng.eager import random_kernels
from compile_rng.semantics.model_names import module_names
from compile_rng.semantics.named_draws import activation_name, activation_seed, current_namer
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
        self.stack: list[tuple[nn.Module, str, int]] = []
        self._new_forward(None)
        # root forwards per (root, rows): the k-th forward over the same rows draws new masks
        self.forwards: dict[tuple[int, Rows], int] = {}
        self.ran_twice: set[str] = set()  # modules called more than once in a forward

    def _new_forward(self, forward: int | None) -> None:
        """A root's forward (its index over these rows) or, ``None``, a recomputation
        (activation checkpointing) in backward: calls and ops are counted afresh."""
        self.calls: dict[str, int] = {}
        self.ordinals: dict[tuple[str, int], int] = {}
        self.drawn: set[str] = set()  # names compiled graphs drew in this forward
        self.forward = forward

    def _call(self, fqn: str) -> int:
        """A new call of module ``fqn``: its index in this forward."""
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        if call:
            self.ran_twice.add(fqn)
        return call

    # --- module hooks --------------------------------------------------------------

    def enter(self, module: nn.Module, args: Any) -> None:
        fqn = self.fqn.get(id(module))
        if fqn is None:
            return
        if not self.stack:
            # a root's forward, or a recomputation (activation checkpointing) in backward
            self._new_forward(self._count_forward(module) if id(module) in self.roots else None)
        if self.stack and self.stack[-1][1] == fqn:  # a wrapper's call of the module it wraps
            call = self.stack[-1][2]
        else:
            call = self._call(fqn)
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
                "or draw it outside the step; a draw in backward (a gradient or communication hook) has no "
                "name either: give it generator= to draw from torch's generator. If activation checkpointing "
                "recomputes it in backward, "
                "checkpoint a module (checkpoint(self.mlp, x)) rather than a function: the module's call names it"
            )
        outermost = self.stack[0][0]
        module, fqn, call = self.stack[-1]
        ordinal = self.ordinals.get((fqn, call), 0)
        _, position = self._named(op, fqn, call, ordinal, device, recomputed=id(outermost) not in self.roots)
        self.ordinals[(fqn, call)] = ordinal + 1
        return position

    def graph_positions(
        self, graph: str, frame: Any, sites: Sequence[Any], module_calls: dict, device: torch.device
    ) -> list[tuple[int, int]]:
        """``(seed, base)`` of each random op of a compiled graph about to run from
        ``frame`` (the user's frame Dynamo compiled): ``sites`` are the ops'
        :class:`~compile_rng.passes.plan.ModuleSite`, ``module_calls`` the calls of each
        module the graph runs. Inside the graph the module hooks were traced, not run: the
        graph's calls and ops are counted here, as the hooks would have counted them."""
        resolve = _FrameModules(frame, self.fqn, graph)
        fqn_root, root_call = self._graph_root_call(resolve)
        first = self._count_graph_calls(resolve, module_calls, fqn_root)
        named = [(*self._site_call(resolve, site, fqn_root, root_call, first), site.ordinal) for site in sites]
        ordinals: dict[tuple[str, int], int] = {}
        positions = []
        for fqn, call, ordinal in named:
            op = f"the compiled graph {graph}'s random op in {fqn or 'the model'}"
            ordinal += self.ordinals.get((fqn, call), 0)
            ordinals[(fqn, call)] = max(ordinals.get((fqn, call), 0), ordinal + 1)
            name, position = self._named(op, fqn, call, ordinal, device, recomputed=self.forward is None)
            if self.forward is not None:
                self._draw_once(op, name)
            positions.append(position)
        self.ordinals.update(ordinals)
        return positions

    def _named(
        self, op: object, fqn: str, call: int, ordinal: int, device: torch.device, recomputed: bool
    ) -> tuple[str, tuple[int, int]]:
        """The name of ``op``, the ``ordinal``-th random op of call ``call`` of module
        ``fqn``, and its ``(seed, base)`` on ``device``; refused where it has no name in the
        unsplit model or, ``recomputed`` (activation checkpointing), an unknown one."""
        if recomputed:
            self._check_recomputation(op, fqn)
        self._check_in_submodule(op, fqn)
        name = activation_name(fqn, call, ordinal, self.forward or 0)
        seed, base = self.start[device.type]
        return name, (activation_seed(seed, name), base)

    def _graph_root_call(self, resolve: _FrameModules) -> tuple[str, int]:
        """The name of the module whose forward a compiled graph's frame runs and the
        index of this call of it (a new forward where the graph begins one)."""
        root, fqn_root = resolve.root()
        resumed, backward = dynamo_internals.is_resume_frame(resolve.frame), core_internals.in_backward()
        if not self.stack and not resumed:
            if fqn_root == "" and not backward:  # the model's (or stage's) forward is this graph's
                self._new_forward(self._count_forward(root))
            elif backward:  # activation checkpointing recomputes a compiled region
                self._new_forward(None)
        if self.stack and self.stack[-1][1] == fqn_root:  # a wrapper runs it: the wrapper's call
            return fqn_root, self.stack[-1][2]
        if resumed:  # the rest of a call after a graph break
            self.calls.setdefault(fqn_root, 1)
            return fqn_root, max(self.calls[fqn_root], 1) - 1
        return fqn_root, self._call(fqn_root)

    def _count_graph_calls(self, resolve: _FrameModules, module_calls: dict, fqn_root: str) -> dict[str, int]:
        """Count the calls a compiled graph makes of the modules below its root, as the
        hooks would have; returns each such module's calls before the graph (a wrapper and
        the module it wraps are one call of one name)."""
        first: dict[str, int] = {}
        runs: dict[str, int] = {}
        for where, count in module_calls.items():
            name = resolve.name(*where)
            if name is not None and name != fqn_root:
                first.setdefault(name, self.calls.get(name, 0))
                runs[name] = max(runs.get(name, 0), count)
        for name, count in runs.items():
            self.calls[name] = first[name] + count
            if self.calls[name] > 1:
                self.ran_twice.add(name)
        return first

    def _site_call(
        self, resolve: _FrameModules, site: Any, fqn_root: str, root_call: int, first: dict[str, int]
    ) -> tuple[str, int]:
        """``(module name, call)`` of a compiled graph's random op at ``site``."""
        fqn = resolve.name(site.scope, site.root, site.path) if site.path or site.root else fqn_root
        if fqn is None:
            raise RuntimeError(
                f"compile_rng: the compiled graph {resolve.graph} draws random numbers in a module that is not "
                "part of the model given as names= (it has no name in it); draw them in the model, or outside the step"
            )
        return fqn, root_call if fqn == fqn_root else first.get(fqn, 0) + site.call

    def _draw_once(self, op: object, name: str) -> None:
        """Record that a compiled graph draws stream ``name`` in this forward; refuse a
        second draw (a module run twice in a way the graph cannot count)."""
        if name in self.drawn:
            raise NotImplementedError(
                f"compile_rng: {op} would draw the stream {name!r} a second time in one forward: a module "
                "ran more than once in a forward in a way the compiled graph cannot count (weight sharing "
                "across a graph break). Compile the shared module on its own (module.compile()), or run it "
                "eagerly in the step"
            )
        self.drawn.add(name)

    def _check_in_submodule(self, op: object, fqn: str) -> None:
        if self.split and fqn == "":
            raise NotImplementedError(
                f"compile_rng: {op} ran in the pipeline stage module's own forward: a stage module is "
                "not a module of the unsplit model, so the op has no name in it. Draw it in a submodule"
            )

    def _count_forward(self, root: nn.Module) -> int:
        """This forward's index among the root's forwards over the current rows (the
        schedule's shape inference, outside any microbatch, is not counted)."""
        rows = current_rows()
        if rows is None:
            return 0
        index = self.forwards.get((id(root), rows), 0)
        self.forwards[(id(root), rows)] = index + 1
        return index

    def _check_recomputation(self, op: object, fqn: str | None = None) -> None:
        repeated = [fqn for _, fqn, _ in self.stack if fqn in self.ran_twice]
        if fqn is not None and fqn in self.ran_twice:
            repeated.append(fqn)
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


class _FrameModules:
    """The modules a compiled graph's module paths name, found from the frame that runs
    it, and their names in the model."""

    def __init__(self, frame: Any, names: dict[int, str], graph: str):
        self.frame, self.names, self.graph = frame, names, graph
        self._found: dict[tuple[str, str, str], str | None] = {}

    def _local(self, scope: str, root: str) -> Any:
        space = self.frame.f_globals if scope == "G" else self.frame.f_locals
        return space.get(root)

    def root(self) -> tuple[nn.Module, str]:
        """The module whose forward the frame runs (its first module argument: ``self``,
        also in a resume function after a graph break) and its name."""
        code = self.frame.f_code
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        local = self.frame.f_locals
        for argument in sorted(arguments, key=lambda a: a != "self"):
            value = local.get(argument)
            if isinstance(value, nn.Module) and id(value) in self.names:
                return value, self.names[id(value)]
        raise RuntimeError(
            f"compile_rng: the compiled graph {self.graph} draws random numbers in a step with names=, but the "
            f"code Dynamo compiled ({code.co_name} in {code.co_filename}) is not the forward of a module of the "
            "model given as names=, so its ops have no names. Compile the model's modules "
            "(module.compile() or torch.compile(module)) rather than a function that calls them"
        )

    def name(self, scope: str, root: str, path: str) -> str | None:
        """The name of the module at ``path`` below the frame's ``root`` (None: not a
        module of the model)."""
        where = (scope, root, path)
        if where not in self._found:
            base = self._local(scope, root) if root else self.root()[0]
            try:
                module = base.get_submodule(path) if isinstance(base, nn.Module) else None
            except AttributeError:
                module = None
            self._found[where] = self.names.get(id(module)) if module is not None else None
        return self._found[where]


def enter_hook(module: nn.Module, args: Any) -> None:
    """The global forward pre-hook of named steps: a named module's call begins."""
    # Inside a compiled region Dynamo traces the hooks: they must add nothing to the graph
    # (the graph counts its own calls: ActivationNames.graph_positions)
    if torch.compiler.is_compiling():
        return
    namer = current_namer()
    if isinstance(namer, ActivationNames):
        namer.enter(module, args)


def leave_hook(module: nn.Module, args: Any, output: Any) -> None:
    """The global forward hook of named steps (registered ``always_call``): a call ends."""
    if torch.compiler.is_compiling():
        return
    namer = current_namer()
    if isinstance(namer, ActivationNames):
        namer.leave(module, args, output)


# What registers enter_hook and leave_hook with torch (compile_rng.installation, the module
# that changes torch, sets it while compile_rng is installed; None while it is not).
_hooks_installer: Callable[[], None] | None = None


def set_hooks_installer(installer: Callable[[], None] | None) -> None:
    """Set what :func:`require_hooks` calls (``compile_rng.installation``'s; None on uninstall)."""
    global _hooks_installer
    _hooks_installer = installer


def require_hooks() -> None:
    """Have the global module hooks that name the ops installed (the installer registers
    them at the first step with ``names=``, then keeps them until ``compile_rng.uninstall()``);
    outside a step with names they return at once. Raises RuntimeError while compile_rng is
    uninstalled: without the hooks no op has a name."""
    if _hooks_installer is None:
        raise RuntimeError(
            "compile_rng.step(names=...): compile_rng is uninstalled, and the module hooks that name the "
            "random ops went with it; call compile_rng.install() (or compile_rng.manual_seed) first"
        )
    _hooks_installer()


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
            token = set_rows(microbatch_rows(rows, microbatches, chunk), split=microbatches > 1)
            try:
                with random_kernels.refreshed():  # the rows on a backward's device thread too
                    return method(chunk, *args, **kwargs)
            finally:
                reset_rows(token)

        return run

    with distributed_internals.pipeline_chunks_wrapped(stages, wrapped):
        yield
