"""What the pass did, for people: annotated graph code and the report
:func:`compile_rng.explain` returns (text only: nothing here compiles)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from compile_rng.passes.plan import RewrittenOp, RngPlan, Unsupported


def _placements(op: RewrittenOp) -> str:
    return "plain tensor (one-rank replica)" if op.sharding is None else str(tuple(op.sharding.placements))


def describe(op: RewrittenOp) -> list[str]:
    """One op's provenance and counter formulas, as comment lines."""
    lines = [f"compile_rng: {op.original} -> {op.replacement}  [{op.source}]"]
    if op.sharding is not None:
        names = op.sharding.mesh_dim_names or ()
        lines.append(
            f"  mesh {tuple(op.sharding.mesh_shape)} {tuple(names)}, placements {_placements(op)}, "
            f"global shape {tuple(op.sharding.global_shape)}, local shape {op.local_shape}, layout {op.layout}"
        )
        lines.append(f"  start (rank's first counter) = {op.start}   with coordinate {op.coords}")
    else:
        lines.append(f"  {_placements(op)}, shape {op.local_shape}")
    lines.append(f"  base offset = {op.offset}   advance = {op.advance}")
    return lines


def annotated_code(plan: RngPlan) -> str:
    """The rewritten graph's code with :func:`describe` comments above each random call."""
    code = plan.graphs[-1].splitlines()
    by_node = {op.node: op for op in plan.ops}
    out = [f"# compile_rng: {plan.name}; total advance per call = {plan.total_advance}"]
    for line in code:
        stripped = line.lstrip()
        name = stripped.split("=")[0].split(":")[0].strip() if "=" in stripped else None
        if name in by_node:
            indent = line[: len(line) - len(stripped)]
            out.extend(f"{indent}# {c}" for c in describe(by_node[name]))
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass
class OpReport:
    """One random op of an explained function."""

    source: str
    op: str
    layout: str
    mesh_shape: tuple | None
    mesh_dim_names: tuple | None
    placements: tuple | None
    global_shape: tuple
    local_shape: tuple
    dtype: torch.dtype
    start: sympy.Expr
    offset: sympy.Expr
    advance: sympy.Expr
    #: the start offset for every mesh coordinate (plain tensors: ``{(): 0}``)
    start_by_coordinate: dict[tuple, Any] = field(default_factory=dict)

    @classmethod
    def from_op(cls, op: RewrittenOp) -> "OpReport":
        sh = op.sharding
        if sh is None:
            return cls(op.source, op.original, op.layout, None, None, None, op.local_shape, op.local_shape,
                       op.dtype, op.start, op.offset, op.advance, {(): 0})
        by_coord = {}
        for coord in itertools.product(*(range(n) for n in sh.mesh_shape)):
            env = {sym: sympy.Integer(c) for sym, c in zip(op.coords, coord) if isinstance(sym, sympy.Symbol)}
            value = sympy.sympify(op.start).xreplace(env)
            by_coord[coord] = int(value) if value.is_Integer else value
        shape = tuple(sympy.sympify(s) for s in sh.global_shape)
        return cls(op.source, op.original, op.layout, tuple(sh.mesh_shape), sh.mesh_dim_names, tuple(sh.placements),
                   shape, op.local_shape, op.dtype, op.start, op.offset, op.advance, by_coord)


@dataclass
class Report:
    """``compile_rng.explain``'s result: every random op of every graph, in order."""

    ops: list[OpReport]
    total_advance: sympy.Expr
    unsupported: list[Unsupported]

    def __str__(self) -> str:
        # offset: the op's first counter, relative to the state the call starts from;
        # start: the rank's first counter within the op's range (by coordinate below)
        rows = [("#", "source", "op", "layout", "mesh", "placements", "global -> local", "dtype", "offset", "start",
                 "advance")]
        for i, r in enumerate(self.ops):
            mesh = "-" if r.mesh_shape is None else f"{r.mesh_shape}{tuple(r.mesh_dim_names or ())}"
            place = "replica" if r.placements is None else ", ".join(str(p) for p in r.placements)
            rows.append((str(i), r.source.split("/")[-1], r.op.replace("aten.", ""), r.layout, mesh, place,
                         f"{tuple(r.global_shape)} -> {tuple(r.local_shape)}", str(r.dtype).replace("torch.", ""),
                         str(r.offset), str(r.start), str(r.advance)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for i, r in enumerate(self.ops):
            if r.mesh_shape is not None:
                starts = ", ".join(f"{c}: {v}" for c, v in r.start_by_coordinate.items())
                lines.append(f"op {i} start by mesh coordinate: {starts}")
        lines.append("offset: the op's first counter after the call's starting state; start: the rank's first "
                     "counter within the op")
        lines.append(f"total advance per call: {self.total_advance}")
        for u in self.unsupported:
            lines.append(f"UNSUPPORTED {u.op} at {u.source}: {u.reason}")
        return "\n".join(lines)
