"""Which dim of an eager random op's tensor holds the step's batch, read from torch's own
modules where they say it.

A step draws every random op at its rows of the global batch, so it must know which dim
of the op's tensor is the batch. Dim 0 unless the step declares another
(``compile_rng.step(..., batch_dim=1)``), except inside torch's modules whose activations
are sequence-major whatever the step says, and those whose are batch-major:

* ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``: the dropout between layers runs inside the
  recurrent kernel on ``(seq, batch, hidden)`` - also with ``batch_first=True``, whose
  input the kernel transposes first: dim 1;
* ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``: their own dropouts act
  on the layer's activations, ``(seq, batch, d_model)`` unless ``batch_first``: dim 1 or 0;
* ``nn.MultiheadAttention``: its attention dropout runs on ``(batch, heads, L, S)``
  whatever ``batch_first`` (its inputs are rearranged batch-major first): dim 0.

The innermost such module on the Python stack decides (a layer's attention is its
``MultiheadAttention``'s). The stack is read only when a step's random op draws: other
ops, and code outside a step, never get here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from compile_rng.eager.user_code import stack_frames


def _rules() -> dict[int, Callable[[Any], tuple[int, str]]]:
    """``id`` of a module method's code -> its rule (the methods live as long as torch)."""
    def recurrent(module: Any) -> tuple[int, str]:
        return 1, f"{type(module).__name__}'s dropout between layers is sequence-major"

    def layer(module: Any) -> tuple[int, str]:
        if getattr(module, "batch_first", False):
            return 0, f"{type(module).__name__}(batch_first=True)"
        return 1, f"{type(module).__name__}(batch_first=False) is sequence-major"

    def attention(module: Any) -> tuple[int, str]:
        return 0, "MultiheadAttention's attention dropout is batch-major"

    rules: dict[int, Callable[[Any], tuple[int, str]]] = {}
    for cls in (nn.RNN, nn.LSTM, nn.GRU):
        rules[id(cls.forward.__code__)] = recurrent
    for cls in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer):
        for name in ("forward", "_sa_block", "_mha_block", "_ff_block"):
            method = vars(cls).get(name)
            if method is not None:
                rules[id(method.__code__)] = layer
    rules[id(nn.MultiheadAttention.forward.__code__)] = attention
    return rules


#: ``id`` of the code of a torch module's method -> ``rule(module) -> (dim, why)``.
RULES_BY_CODE = _rules()


def said_by(frame: Any) -> tuple[int, str] | None:
    """``(dim, why)`` if ``frame`` runs one of torch's modules that says its batch dim."""
    rule = RULES_BY_CODE.get(id(frame.f_code))
    return None if rule is None else rule(frame.f_locals.get("self"))


def batch_dim_here(default: int) -> tuple[int, str]:
    """``(dim, why)``: the batch dim of the random op being drawn now, by the innermost of
    torch's modules above on the Python stack that says it, else ``default`` (why: "")."""
    for frame in stack_frames():
        said = said_by(frame)
        if said is not None:
            return said
    return default, ""
