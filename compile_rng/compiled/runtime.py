"""What runs each call of a compiled graph: reserve the graph's total advance from the
state *before* calling it (a call that raises still consumed its counters: the state is
always "advanced by the whole graph"), build the key, check the ranks agree (``verify``),
and hand tensor-parallel pieces to and from eager code."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from compile_rng._torch import dynamo_internals
from compile_rng.compiled.named_keys import KeyTable
from compile_rng.compiled.symbols import SizeFn
from compile_rng.eager import dispatch_modes
from compile_rng.ops import make_key
from compile_rng.passes.plan import ROWS_TOTAL, RngPlan
from compile_rng.semantics import local_values, verify
from compile_rng.semantics.named_draws import current_namer
from compile_rng.semantics.rows import Rows, current_rows, step_batch_dim
from compile_rng.stream import state


class BatchKey:
    """A batched graph's rows for a call (:mod:`compile_rng.eager.batches`) and its key."""

    def __init__(self, plan: RngPlan, placeholders: Sequence[fx.Node], device: torch.device):
        self.name, self.device, self.row_stride = plan.name, device, plan.row_stride
        self.batch_dim = plan.batch_dim
        self.draws = plan.local_rows is not None  # a graph without random ops has no batch
        self.local_rows = SizeFn(plan.local_rows if self.draws else 0, placeholders)
        self.size_guards = [(SizeFn(e, placeholders), equal, why) for e, equal, why in plan.size_guards]

    def rows(self, args: Sequence[Any]) -> Rows:
        count = self.local_rows(args)
        rows = current_rows()
        if not self.draws:
            return Rows(0, count, count)
        if rows is None:
            rows = Rows(0, count, count)
        elif step_batch_dim() != self.batch_dim:
            raise NotImplementedError(
                f"compile_rng: the batched graph {self.name} was compiled in a step with batch_dim="
                f"{self.batch_dim} and runs in one with batch_dim={step_batch_dim()}: the batch dim is a "
                "constant of the graph's counters. Keep one batch dim per compiled function (compile another "
                "function for the other), or call torch._dynamo.reset() between them"
            )
        for difference, equal, why in self.size_guards:
            if (difference(args) == 0) != equal:
                raise NotImplementedError(f"compile_rng: {why} (this call's sizes)")
        if rows.count != count:
            raise ValueError(
                f"compile_rng: the batched graph {self.name} draws on activations of {count} rows, but the "
                f"enclosing compile_rng.step / microbatch holds {rows.count} rows of this rank's batch; "
                "pass the rows of the batch this call processes"
            )
        if rows.stride != self.row_stride:
            def spacing(s: int) -> str:
                return "a contiguous block" if s == 1 else f"every {s}th row (DistributedSampler's interleaving)"

            here = f"in a step whose rows are {spacing(rows.stride)}" if current_rows() is not None else "outside a step"
            raise NotImplementedError(
                f"compile_rng: the batched graph {self.name} was compiled for rows of the global batch at "
                f"{spacing(self.row_stride)}, and runs {here}: the spacing is a constant of the graph's "
                "counters. Keep one row convention per compiled function (compile another function for "
                "the other), or call torch._dynamo.reset() between them"
            )
        return rows

    def __call__(self, seed: int, offset: int, rows: Rows) -> torch.Tensor:
        return make_key(seed, offset, self.device, rows=(rows.start, rows.total))


class LocalPieces:
    """A graph's traffic in tensor-parallel ranks' local pieces with eager code
    (:mod:`compile_rng.semantics.local_values`): the pieces it returns are recorded for the eager
    code after it; a recorded piece among the inputs its plain random ops are computed
    from is refused (the graph would draw it as a replica: it was traced as a plain
    input, so the layout is unknown in it)."""

    def __init__(self, plan: RngPlan, inputs: int, outputs: list):
        self.plan, self.outputs = plan, outputs if any(v is not None for v in outputs) else None
        self.inputs = inputs

    def check(self, args: Sequence[Any]) -> None:
        draws = self.plan.draw_inputs
        if not draws or not local_values.touches(args):
            return
        # the traced graph's inputs are the Dynamo graph's unless AOTAutograd dropped or merged some
        positions = draws if self.plan.traced_inputs == self.inputs else range(len(args))
        for i in positions:
            if local_values.lookup(args[i]) is not None:
                ops = ", ".join(f"{op.original} at {op.source}" for op in self.plan.ops if op.sharding is None)
                raise NotImplementedError(
                    f"compile_rng: the compiled graph {self.plan.name} draws random numbers ({ops}) on values "
                    f"computed from its input {i}, a plain tensor that is this rank's piece of a sharded DTensor "
                    "(to_local() in code that ran before this graph: a graph break separates them). The graph "
                    "would draw it as a replica - every rank the same values for different pieces. Keep "
                    "to_local() and the random op in one graph (remove the graph break), or keep the tensor a "
                    "DTensor (use_local_output=False in the TP plan)"
                )

    def record(self, outputs: Any) -> Any:
        if self.outputs is not None and local_values.is_recording():
            from compile_rng.eager import eager_shards  # noqa: F401  (runs the eager ops on the pieces)

            for value, layout in zip(outputs, self.outputs):
                local_values.record(value, layout)
        return outputs


class CompiledGraph:
    """The callable the backend hands Dynamo for one graph: ``compiled`` (the inner
    compiler's result, which takes the key as its last input) on the stream."""

    def __init__(
        self, compiled: Callable, plan: RngPlan, placeholders: Sequence[fx.Node], device: torch.device,
        check: bool, verify_over: Any, output_layouts: list,
    ):
        """``check``: verify before every call that the ranks agree, over ``verify_over``
        (the backend's ``verify=``: True, a DeviceMesh or a ProcessGroup)."""
        self.compiled, self.plan, self.device = compiled, plan, device
        self.advance = SizeFn(plan.total_advance, placeholders)
        self.key_of = BatchKey(plan, placeholders, device) if plan.batched else None
        self.check, self.verify_over = check, verify_over
        self.signature = verify.signature(plan)
        self.groups: list = []
        self.pieces = LocalPieces(plan, len(placeholders), output_layouts)
        self.placeholders = placeholders
        self._batch_sizes: dict[tuple[int, int], SizeFn | None] = {}  # (op, dim) -> its size there
        self.table = KeyTable(plan, placeholders, device) if plan.batched else None
        # a backward compiled with donated buffers overwrites its saved tensors: it must
        # not run once they are off (Dynamo does not recompile for that setting)
        self.donated = dynamo_internals.donated_buffers()

    def _check_ranks(self) -> None:
        if not self.groups:  # the process groups exist once the graph runs
            meshes = list({id(op.mesh): op.mesh for op in self.plan.ops if op.mesh is not None}.values())
            self.groups.extend(verify.groups_of(meshes, self.verify_over))
        verify.check(self.plan.name, *state.get_state(self.device), self.signature, self.groups)

    def _refuse_a_draw_off_the_batch(self, ops: list, dim: int, rows: int, args: Sequence[Any]) -> None:
        """A plain op outside torch's layout modules draws at the step's rows along the
        step's batch dim: eager code refuses a tensor whose dim is not the batch (noise of
        another shape, ``Normal.sample((n,))``, ``vmap(randomness="same")``); so does the graph."""
        for i, op in enumerate(ops):
            if op.batch_dim is not None or op.sharding is not None:
                continue
            if (i, dim) not in self._batch_sizes:
                size = op.local_shape[dim] if len(op.local_shape) > dim else None
                self._batch_sizes[i, dim] = None if size is None else SizeFn(size, self.placeholders)
            size = self._batch_sizes[i, dim]
            if size is None or size(args) != rows:
                raise NotImplementedError(
                    f"compile_rng: the compiled graph {self.plan.name} draws {op.original} at {op.source} on a tensor "
                    f"of shape {tuple(op.local_shape)} in a compile_rng.step whose batch has {rows} rows: every random "
                    f"op in a step draws at its rows of the global batch, so dim {dim} must be the batch (eager code "
                    "in the step refuses it too). Draw other randomness (data sampling, noise of another shape) "
                    "outside the step block, or transpose the tensor so the batch is that dim"
                )

    def _refuse_in_a_step(self, args: Sequence[Any]) -> None:
        """Without batched=True the graph's ops draw at this call's own counters, row-major.
        In a step eager code draws at the step's rows, the batch outermost along each op's
        batch dim: the same values only for the whole batch along dim 0. Part of the batch
        (a data-parallel rank's rows, a microbatch) would draw the same values on every rank
        and microbatch; another batch dim (``step(batch_dim=1)``, a sequence-major torch
        module) other values. A permutation has no rows: eager code draws it whole too."""
        at_rows = [op for op in self.plan.ops if not op.whole]
        rows = current_rows() if at_rows else None
        if rows is None:
            return
        fix = "Compile with compile_rng.backend(layout='invariant', batched=True)"
        if not (isinstance(rows, Rows) and rows.start == 0 and rows.count == rows.total):
            ops = ", ".join(f"{op.original} at {op.source}" for op in at_rows)
            raise NotImplementedError(
                f"compile_rng: the compiled graph {self.plan.name} draws random numbers ({ops}) in a "
                "compile_rng.step / microbatch that holds part of the step's global batch, but it was compiled "
                "by a backend without batched=True: its ops would draw at this call's own counters, not at its "
                "rows of the batch, so every data-parallel rank and microbatch would draw the same values "
                f"(eager code in the step draws at the rows). {fix}"
            )
        step_dim = step_batch_dim()
        self._refuse_a_draw_off_the_batch(at_rows, step_dim, rows.count, args)
        other = [op for op in at_rows if (step_dim if op.batch_dim is None else op.batch_dim) != 0]
        if other:
            ops = ", ".join(
                f"{op.original} at {op.source} (dim {step_dim if op.batch_dim is None else op.batch_dim})"
                for op in other
            )
            raise NotImplementedError(
                f"compile_rng: the compiled graph {self.plan.name} draws random numbers in a compile_rng.step on "
                f"activations whose batch is not dim 0 ({ops}: the step's batch_dim or a sequence-major torch "
                "module), but it was compiled by a backend without batched=True: its ops would draw row-major, "
                f"where eager code in the step draws the batch outermost - other values. {fix}"
            )

    def __call__(self, *args: Any) -> Any:
        namer = current_namer() if self.plan.ops else None
        if namer is not None and self.key_of is None:
            raise NotImplementedError(
                f"compile_rng: the compiled graph {self.plan.name} draws random numbers inside a "
                "compile_rng.step(names=...), but it was compiled by a backend without batched=True: "
                "named streams draw at the ops' rows of the step's batch. Compile with "
                "compile_rng.backend(layout='invariant', batched=True)"
            )
        if self.donated and not dynamo_internals.donated_buffers():
            raise RuntimeError(
                f"compile_rng: the compiled graph {self.plan.name} was compiled with AOTAutograd's donated "
                "buffers on, and torch._functorch.config.donated_buffer is off now: its backward would "
                "overwrite the saved tensors a second backward (retain_graph, a zero-bubble schedule's "
                "weight half) reads, and torch would not say so. Set donated_buffer before the first "
                "compile, or call torch._dynamo.reset() after changing it"
            )
        if self.check:
            self._check_ranks()
        if self.key_of is None:
            self._refuse_in_a_step(args)
            seed, offset = state.advance(self.advance(args), self.device)
            inputs = (make_key(seed, offset, self.device),)
        elif namer is None:
            rows = self.key_of.rows(args)
            seed, offset = state.advance(self.advance(args, {ROWS_TOTAL: rows.total}), self.device)
            inputs = (self.table.sequence(), self.key_of(seed, offset, rows))
        else:  # every op from its named stream: the graph's key holds the rows only
            rows = self.key_of.rows(args)
            inputs = (self.table.named(namer, args, rows), self.key_of(0, 0, rows))
        self.pieces.check(args)
        with dispatch_modes.graph_call():
            return self.pieces.record(self.compiled(*args, *inputs))
