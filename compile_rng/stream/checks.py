"""The argument checks of the functional ops, one copy for every implementation (the CPU
kernels of :mod:`compile_rng.ops` and the accelerator kernels of
:mod:`compile_rng.stream.accelerator_ops`): the same call fails the same way on any device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compile_rng import stream


def check_layout(op: str, size: Sequence[int], strides: Sequence[int]) -> None:
    """Counter strides: one per dimension, none negative."""
    if len(size) != len(strides):
        raise ValueError(f"compile_rng.{op}: size {list(size)} and strides {list(strides)} differ in rank")
    if any(s < 0 for s in strides):
        raise ValueError(f"compile_rng.{op}: counter strides must be non-negative, got {list(strides)}")


def check_float(op: str, dtype: torch.dtype) -> None:
    """A floating op's dtype is one of the contract's :data:`~compile_rng.stream.FLOAT_DTYPES`."""
    if dtype not in stream.FLOAT_DTYPES:
        raise TypeError(
            f"compile_rng.{op}: dtype {dtype} is not supported; use one of "
            f"{', '.join(str(d) for d in stream.FLOAT_DTYPES)}"
        )


def check_randint_range(low: int, high: int) -> None:
    """``randint``'s range: ``0 < high - low <= 2**63`` (the contract's integer transform)."""
    if not 0 < high - low <= 2**63:
        raise ValueError(f"compile_rng.randint: need 0 < high - low <= 2**63, got [{low}, {high})")
