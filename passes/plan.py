"""The plan: what the pass did to one compiled graph (the pass fills it; the backend, the
plan store, the reports and ``verify`` read it), and the symbols of a batched graph's
runtime rows in its offset expressions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from compile_rng.semantics.spmd import Sharding


@dataclass(frozen=True)
class ModuleSite:
    """Where a random op of a batched graph sits among the modules of the compiled code,
    for the named streams of ``compile_rng.step(names=...)`` (resolved per call:
    :mod:`compile_rng.compiled.named_keys`).

    ``root`` is the compiled frame's local (or global) that Dynamo's module paths start
    from (``"self"`` for a module's forward), ``path`` the dotted path of the innermost
    module running the op below it (``""``: the op runs in ``root`` itself), ``call`` the
    module's call within the graph (Dynamo numbers a module's later calls in one graph)
    and ``ordinal`` how many random ops that call ran before this one in the graph."""

    root: str
    path: str
    call: int
    ordinal: int
    scope: str = "L"  # "L": a local of the compiled frame; "G": a global


@dataclass
class RewrittenOp:
    """One random op the pass made functional (for tests, dumps and explain)."""

    original: str
    replacement: str
    node: str  # name of the functional op's node in the rewritten graph
    source: str  # "file:line" of the user code, if known
    local_shape: tuple
    dtype: torch.dtype
    offset: sympy.Expr  # base of the op's counter range, relative to the call's key
    advance: sympy.Expr
    layout: str = "tracker"
    sharding: Sharding | None = None  # None for plain tensors
    start: sympy.Expr = sympy.Integer(0)  # the rank's first counter within the range
    coords: tuple = ()  # the symbols of the mesh coordinate in ``start``, by mesh dim
    mesh: Any = None  # the DeviceMesh of a DTensor op
    module: ModuleSite | None = None  # batched graphs: where the op sits (named streams)
    #: the batch dim eager code in a step draws the op at, where a torch module around it
    #: says it (None: the step's ``batch_dim``); a module whose layout was not read counts as
    #: its default, sequence-major (1)
    batch_dim: int | None = None
    #: drawn whole, as eager code draws it (a permutation): never at a step's rows
    whole: bool = False


@dataclass
class Unsupported:
    """A random op the pass could not rewrite (collected instead of raised on request)."""

    op: str
    source: str
    reason: str


#: A batched graph's runtime rows (:mod:`compile_rng.eager.batches`), in offset expressions.
ROW_START = sympy.Symbol("row_start", integer=True, nonnegative=True)
ROWS_TOTAL = sympy.Symbol("rows_total", integer=True, nonnegative=True)
BATCH_SYMBOLS = (ROW_START, ROWS_TOTAL)


@dataclass
class RngPlan:
    """What the pass did to one compiled graph; filled in as the pass runs."""

    name: str = "graph"  # which compiled function (set by the backend)
    #: the backend's counter layout; a plain tensor (a one-rank replica) has the same
    #: layout in both, and its ops are reported under this layout
    layout: str = "tracker"
    ops: list[RewrittenOp] = field(default_factory=list)
    total_advance: sympy.Expr = sympy.Integer(0)
    #: Python code of each graph before and after the pass rewrote it.
    graphs_before: list[str] = field(default_factory=list)
    graphs: list[str] = field(default_factory=list)
    #: explain() sets this: unsupported ops are recorded and left in place.
    collect_unsupported: bool = False
    unsupported: list[Unsupported] = field(default_factory=list)
    #: how often the pass ran on this plan's graphs (0: the compiled graph came from
    #: AOTAutograd's cache, untraced, and the backend loaded this plan as it was filed)
    pass_runs: int = 0
    #: wall time spent in this pass, and in the whole backend compile (set by the backend)
    pass_seconds: float = 0.0
    compile_seconds: float = 0.0
    #: a batched graph: dim 0 of every random op is the batch (compile_rng.eager.batches);
    #: ``local_rows`` is that dim's size, the same for every op (None until one is seen)
    batched: bool = False
    local_rows: sympy.Expr | None = None
    #: batched graphs: local row ``i`` is global row ``row_start + i * row_stride``: the
    #: spacing of the step's rows when the graph compiled (1: a contiguous block;
    #: DistributedSampler deals every world-th row), a constant of the ops' counter strides
    row_stride: int = 1
    #: batched graphs: the dim of a random op's tensor that holds the batch, as the step the
    #: graph compiled in declared it (``compile_rng.step(batch_dim=)``), a constant of the
    #: ops' counter strides; torch's batch-major modules (nn.MultiheadAttention) draw at dim 0
    batch_dim: int = 0
    #: batched graphs: what the pass assumed of size symbols that differ only in this trace,
    #: as ``(difference, equal, why)``: that ``difference`` is 0 (``equal``: two ops' batch
    #: sizes, which Dynamo's automatic dynamic shapes gives a symbol each) or is not (which
    #: dim is the batch); a call where the assumption fails is refused with ``why``
    size_guards: list[tuple[sympy.Expr, bool, str]] = field(default_factory=list)
    #: positions among the traced graph's inputs (the key not counted) that a plain-tensor
    #: random op's tensor is computed from, and how many inputs that graph has: the
    #: backend refuses a tensor-parallel rank's local piece there (compile_rng.semantics.local_values)
    draw_inputs: tuple[int, ...] = ()
    traced_inputs: int = 0
    #: batched graphs: the rows of the per-op key table input (one row per random op, at
    #: most; the backend sizes it from the Dynamo graph), and each module's calls in the
    #: graph as ``(scope, root, path) -> calls`` (the backend reads them off Dynamo's graph)
    key_table_rows: int = 0
    module_calls: dict = field(default_factory=dict)
    #: ``(dim, heads)`` that each of torch's layout modules in the graph says of its random
    #: ops' activations (:func:`compile_rng.eager.batch_dims.declared_layout`), by its
    #: ``nn_module_stack`` key (the backend reads the modules from the compiled frame)
    module_layouts: dict = field(default_factory=dict)

    @property
    def loaded_from_cache(self) -> bool:
        """The compiled graph came from AOTAutograd's cache and this plan was loaded."""
        return self.pass_runs == 0
