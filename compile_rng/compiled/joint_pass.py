"""compile_rng's rewrite as Inductor's joint pass, and its identity in the compile caches.

:meth:`JointPass.uuid` (compile_rng's sources, the layout) is in Inductor's and
AOTAutograd's cache keys. Inductor's FX-graph key holds a DeviceMesh input by its ranks
and layout (the coordinate is read at run time; a value tracing baked in is in the
graph's code): one artifact serves every rank. AOTAutograd's key hashes the graph before
tracing, so a DTensor graph's key gets this process's rank and groups mixed in
(:func:`compile_rng.compiled.plan_store.process_context`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from compile_rng._torch import dynamo_internals, inductor_internals
from compile_rng import passes
from compile_rng.passes.functionalize_rng import functionalize_rng
from compile_rng.passes.plan import RngPlan


@functools.cache
def source_hash() -> str:
    """A hash of compile_rng's sources (the pass, the rules, the lowerings, the kernels):
    everything that decides a compiled graph's code besides what Inductor hashes itself."""
    package = Path(__file__).parent.parent  # compile_rng/
    digest = hashlib.sha256(torch.__version__.encode())
    for folder in (package, Path(passes.__file__).parent):
        for path in sorted([*folder.rglob("*.py"), *folder.rglob("csrc/*.c")]):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


class JointPass(inductor_internals.CustomGraphPass):
    """compile_rng's rewrite as Inductor's ``joint_custom_pre_pass`` (then the user's own
    pass, if any). Its :meth:`uuid` is what Inductor's FX-graph and AOTAutograd's caches
    key the pass on: compile_rng's sources, the layout, a batched graph's row spacing and AOTAutograd's
    donated buffers - no rank, coordinate or device
    (the rewritten graph computes the coordinate at run time), so one Inductor artifact
    serves every rank (a DTensor graph's AOTAutograd key gets the rank besides: see the
    module's docstring). A user pass without a uuid makes it ``None``: the caches are then
    bypassed."""

    def __init__(self, plan: RngPlan, user_pass: Callable | None = None):
        self.plan, self.user_pass = plan, user_pass

    def __call__(self, graph: fx.Graph) -> None:
        # Inductor lowers the graph after this pass; the lowerings are imported here, not
        # per compile: an AOTAutograd cache hit neither runs the pass nor needs them (1 s)
        from compile_rng.ops import lowering  # noqa: F401

        functionalize_rng(graph, self.plan)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Any:
        user = None
        if self.user_pass is not None:
            user = self.user_pass.uuid() if isinstance(self.user_pass, inductor_internals.CustomGraphPass) else None
            if user is None:
                return None
        return (source_hash(), self.plan.layout, self.plan.batched, self.plan.row_stride, self.plan.batch_dim,
                self.plan.collect_unsupported, dynamo_internals.donated_buffers(), user)
