"""DTensor's in-place random ops that its dispatcher runs without a distribute region
(``exponential_``, ``log_normal_``, ``cauchy_``, ``geometric_``, ``random_``,
``bernoulli_`` with tensor ``p``): the handler the installer registers for them runs the
local op in compile_rng's tracker region, like every other DTensor random op."""

from __future__ import annotations

from typing import Any

import torch

from compile_rng._torch.dtensor_internals import (
    distribute_region,
    dtensor_dispatch_unhandled,
    dtensor_spec,
    rng_tracker,
)
from compile_rng.stream import state

aten = torch.ops.aten


# Random ops DTensor's dispatcher runs without a distribute region.
UNROUTED = [
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    aten.random_.to,
    getattr(aten.random_, "from"),
    aten.bernoulli_.Tensor,
]


def _describe(mesh: Any) -> str:
    return f"the {mesh.device_type} mesh of ranks {mesh.mesh.tolist()}"


def _local_operand(op_call, target: Any, a: Any) -> Any:
    """``a``'s local tensor laid out like ``target``'s shard (as DTensor's own dispatch
    would redistribute it); operands from another mesh or plain tensors are refused."""
    from torch.distributed.tensor import DTensor  # imported: the handler only runs on DTensors

    if isinstance(a, DTensor):
        if a.device_mesh != target.device_mesh:
            raise ValueError(
                f"compile_rng: {op_call}: an operand lives on {_describe(a.device_mesh)}, the tensor it "
                f"fills on {_describe(target.device_mesh)}; move it to the target's mesh "
                "(distribute_tensor / redistribute)"
            )
        return a.redistribute(target.device_mesh, target.placements).to_local()
    if isinstance(a, torch.Tensor) and a.dim() > 0:
        raise ValueError(
            f"compile_rng: {op_call}: mixes a torch.Tensor operand with a DTensor; make it a DTensor on "
            "the target's mesh (distribute_tensor or DTensor.from_local)"
        )
    return a


def inplace_handler(op_call, args, kwargs):
    target = args[0]
    if not state.serves(target.device_mesh):
        return dtensor_dispatch_unhandled(op_call, args, kwargs)
    if target.device_mesh.get_coordinate() is None:
        # Like DTensor's own dispatch: a rank outside the mesh holds no shard, runs
        # nothing and does not advance its state.
        return target
    local_args = [target.to_local(), *(_local_operand(op_call, target, a) for a in args[1:])]
    with distribute_region(rng_tracker(), dtensor_spec(target)):
        op_call(*local_args, **kwargs)
    return target
