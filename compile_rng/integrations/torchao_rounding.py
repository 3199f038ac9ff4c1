"""torchao's bf16 stochastic rounding with its random bits drawn on the parameter's DTensor.

torchao's optimizers (``_AdamW``, ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` with
``bf16_stochastic_round=True``) round each updated float32 parameter to bf16 up or down at
random inside their compiled per-parameter step (``torchao.optim.adam.single_param_adam``):
the random bits come from ``torch.randint`` on the parameter's *local* shard, so under FSDP2
every rank draws for its own shard, and the weights depend on the world size (and on the TP
plan). :func:`on_dtensors` makes that step draw the bits as a DTensor op on the parameter
itself (``rand_like`` of the DTensor, its top 16 bits): its shards then take the counters of compile_rng's
layout, so under ``layout="invariant"`` the rounded weights are those of one device.

The rounding is torchao's: round away from zero with the probability the discarded 16
bits give, ``(bits + r) & 0xFFFF0000`` with ``r`` uniform in ``[0, 2**16)``; only the source
of ``r`` changes. Patched for a block, by name, in the module torchao's step looks it up in
(checked on torchao 0.18.0; a torchao without it raises naming the version).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

_PATCHED = "_fp32_to_bf16_sr"  # torchao.optim.adam's name for its rounding


def rounded_to_bf16(x_f32: torch.Tensor) -> torch.Tensor:
    """``x_f32`` (float32, a DTensor or a plain tensor) rounded to bf16 stochastically, its
    16 random bits per element drawn on ``x_f32`` itself."""
    from torch.distributed.tensor import DTensor

    # 16 uniform bits: the top 16 of a float32 uniform's 24 (the stream's fast float32 kernel)
    r = (torch.rand_like(x_f32) * 65536).to(torch.int32)
    sharded = isinstance(x_f32, DTensor)
    local, r_local = (x_f32.to_local(), r.to_local()) if sharded else (x_f32, r)
    rounded = ((local.view(torch.int32) + r_local) & -(1 << 16)).view(torch.float32).bfloat16()
    if not sharded:
        return rounded
    return DTensor.from_local(rounded, x_f32.device_mesh, x_f32.placements, run_check=False,
                              shape=x_f32.shape, stride=x_f32.stride())


@contextlib.contextmanager
def on_dtensors() -> Iterator[None]:
    """Inside the block, torchao's optimizers (where torchao is imported) draw their
    rounding bits with :func:`rounded_to_bf16`; torchao's own function again at exit."""
    adam = sys.modules.get("torchao.optim.adam")
    if adam is None:
        yield
        return
    stock = getattr(adam, _PATCHED, None)
    if stock is None:
        import torchao

        raise NotImplementedError(
            f"compile_rng: torchao {torchao.__version__}'s optimizers have no {_PATCHED} to draw their bf16 "
            "stochastic rounding on DTensors (checked on torchao 0.18.0); pin torchao 0.18 or report it"
        )
    setattr(adam, _PATCHED, rounded_to_bf16)
    try:
        yield
    finally:
        setattr(adam, _PATCHED, stock)
