"""The plans of cached graphs, filed beside AOTAutograd's cache entries.

An AOTAutograd cache hit returns a compiled graph without tracing it, so the pass does
not run and the backend would not know the graph's total advance. Each compile that
runs the pass files its :class:`RngPlan` under that compile's AOTAutograd cache key,
in Inductor's cache folder; a hit on the key finds it.

torch's AOTAutograd key hashes the Dynamo graph and a DTensor input's mesh by its ranks
and layout, not by this process's rank - but tracing a DTensor graph bakes values of
this process into the compiled graph: a vocab-sharded embedding masks the rows of this
rank's coordinate, a collective names this process's group. One entry for every rank
handed rank 1 the graph rank 0 traced (a 3% loss error in a TP training run). So the
backend mixes :func:`process_context` into the key: a DTensor graph's entry and plan
are this rank's own (a restarted job hits them); other ranks trace it themselves and
share Inductor's FX-graph cache, whose key hashes the traced graph's code.

Size symbols are filed by the graph input they come from (input index, dim), and
renamed to the symbols of the inputs of the graph that finds the plan.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile
from pathlib import Path

import sympy
import torch
from torch import fx

from compile_rng._torch import inductor_internals
from compile_rng.passes.plan import RngPlan

#: (input index, dim) of a size symbol; dim None: the input is the SymInt itself
Position = tuple[int, int | None]


def process_context(gm: fx.GraphModule) -> str:
    """What of this process tracing ``gm`` may bake into its compiled graph besides what
    AOTAutograd's key hashes: for a graph that uses a DeviceMesh (a DTensor value, or a
    mesh argument), the rank and each mesh's dim names and process-group names; "" for
    a graph with none (one entry then serves every rank: nothing rank-specific is
    traced)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return ""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    meshes = set()

    def collect(value):
        if isinstance(value, DTensor):
            meshes.add(value.device_mesh)
        elif isinstance(value, DeviceMesh):
            meshes.add(value)
        return value

    for node in gm.graph.nodes:
        fx.node.map_aggregate((node.meta.get("example_value"), node.args, node.kwargs), collect)
    if not meshes:
        return ""
    groups = sorted(
        repr((mesh.mesh_dim_names, tuple(mesh.get_group(d).group_name for d in range(mesh.ndim))))
        if mesh.get_coordinate() is not None else repr((mesh.mesh_dim_names, "not a member"))
        for mesh in meshes
    )
    return f"rank {torch.distributed.get_rank()}: {groups}"


def _path(key: str) -> Path:
    return Path(inductor_internals.inductor_cache_dir()) / "compile_rng_plans" / f"{key}.pkl"


def _renamed(plan: RngPlan, renames: dict[sympy.Symbol, sympy.Symbol]) -> RngPlan:
    """``plan`` with its size symbols renamed, SymInts as their expressions (a SymInt
    belongs to its compile's shape environment) and no meshes."""

    def rename(expr):
        if isinstance(expr, torch.SymInt):
            expr = expr.node.expr
        return expr.xreplace(renames) if isinstance(expr, sympy.Basic) else expr

    def sharding(s):
        return s and dataclasses.replace(s, global_shape=tuple(map(rename, s.global_shape)))

    ops = [
        dataclasses.replace(
            op, offset=rename(op.offset), advance=rename(op.advance), start=rename(op.start),
            local_shape=tuple(map(rename, op.local_shape)), sharding=sharding(op.sharding), mesh=None,
        )
        for op in plan.ops
    ]
    return dataclasses.replace(
        plan, ops=ops, total_advance=rename(plan.total_advance), local_rows=rename(plan.local_rows),
        size_guards=[(rename(e), equal, why) for e, equal, why in plan.size_guards],
    )


def save(key: str, plan: RngPlan, positions: dict[sympy.Symbol, Position]) -> None:
    """File ``plan`` under AOTAutograd cache key ``key``; ``positions`` places the graph's
    size symbols among its inputs. Atomic: every rank may file the same plan at once."""
    by_position = {sym: sympy.Symbol(f"input{i}_{dim}", integer=True) for sym, (i, dim) in positions.items()}
    record = (_renamed(plan, by_position), {v: positions[k] for k, v in by_position.items()})
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
        pickle.dump(record, f)
    os.replace(f.name, path)


def load(key: str, symbols: dict[Position, sympy.Symbol]) -> RngPlan | None:
    """The plan filed under ``key``, in the size symbols of the inputs of the graph that
    asks (``symbols``: each input position's symbol); None if none is filed, or it cannot
    be read, or it names an input this graph does not have (the backend then compiles
    with the pass). A change to compile_rng's sources changes the key (the pass's uuid
    is in it): a record is only ever read by the sources that filed it."""
    try:
        with open(_path(key), "rb") as f:
            plan, positions = pickle.load(f)
    except Exception:  # noqa: BLE001  (unreadable: compiling with the pass is always right)
        return None
    if any(pos not in symbols for pos in positions.values()):
        return None
    return _renamed(plan, {sym: symbols[pos] for sym, pos in positions.items()})
