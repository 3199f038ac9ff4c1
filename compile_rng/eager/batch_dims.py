"""Which dim of an eager random op's tensor holds the step's batch, read from torch's own
modules where they say it.

A step draws every random op at its rows of the global batch, so it must know which dim
of the op's tensor is the batch. Dim 0 unless the step declares another
(``compile_rng.step(..., batch_dim=1)``), except inside torch's modules whose activations
are sequence-major whatever the step says, and those whose are batch-major:

* ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``: the dropout between layers runs inside the
  recurrent kernel on ``(seq, batch, hidden)`` - also with ``batch_first=True``, whose
  input the kernel transposes first: dim 1. On a ``PackedSequence`` it runs on the packed
  ``(tokens, hidden)`` data, whose rows mix the batch's samples: refused;
* ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``: their own dropouts act
  on the layer's activations, ``(seq, batch, d_model)`` unless ``batch_first``: dim 1 or 0
  (an unbatched ``(seq, d_model)`` input has no batch dim: refused);
* ``nn.MultiheadAttention``: its attention dropout runs batch-major whatever
  ``batch_first`` (its inputs are rearranged first): on ``(batch, heads, L, S)`` with
  ``need_weights=False``, on ``(batch * heads, L, S)`` with the default ``need_weights=True``
  - dim 0, ``heads`` entries a batch row.

Each rule checks the layout it assumes against the drawn tensor's rank and refuses one it
does not know. The innermost such module on the Python stack decides (a layer's attention
is its ``MultiheadAttention``'s). The stack is read only when a step's random op draws:
other ops, and code outside a step, never get here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.nn.utils.rnn import PackedSequence

from compile_rng.semantics.rows import BatchDim


Rule = Callable[[Any, Any, Sequence[int]], BatchDim]


def _refuse(module: Any, shape: Sequence[int], layout: str, fix: str) -> NotImplementedError:
    return NotImplementedError(
        f"compile_rng: a random op inside {type(module).__name__} draws on a tensor of shape {tuple(shape)} "
        f"in compile_rng.step: {layout}, so its rows of the step's batch are unknown. {fix}"
    )


#: the methods of torch's layout modules whose code the eager rules below are keyed on
_RULE_METHODS = {
    **{cls: ("forward",) for cls in (nn.RNN, nn.LSTM, nn.GRU, nn.MultiheadAttention)},
    **{cls: ("forward", "_sa_block", "_mha_block", "_ff_block")
       for cls in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)},
}


def declared_layout(module: Any) -> tuple[int, int] | None:
    """``(dim, heads)`` of torch's module that says the layout of its random ops'
    activations (None for any other): the batch dim, and the entries along it per batch row
    of a ``(batch * heads, L, S)`` draw (``nn.MultiheadAttention``'s with weights). A subclass that overrides a method the eager rules read is none:
    which code draws is not known here (the eager rules below see it on the stack). Compiled
    graphs (:mod:`compile_rng.passes.batch_rows`) read it here."""
    base = next((cls for cls in _RULE_METHODS if isinstance(module, cls)), None)
    if base is None or any(getattr(type(module), m, None) is not getattr(base, m, None) for m in _RULE_METHODS[base]):
        return None
    if base in (nn.RNN, nn.LSTM, nn.GRU):
        return 1, 1
    if base is nn.MultiheadAttention:
        return 0, module.num_heads
    return _layer_dim(module), 1


def _layer_dim(layer: Any) -> int:
    """A Transformer layer's batch dim: it does not keep its ``batch_first`` (torch
    2.11-2.15); its attention, built with it, does."""
    return 0 if getattr(layer.self_attn, "batch_first", False) else 1


def _rules() -> dict[int, Rule]:
    """``id`` of a module method's code -> its rule (the methods live as long as torch)."""
    def recurrent(module: Any, frame: Any, shape: Sequence[int]) -> BatchDim:
        if isinstance(frame.f_locals.get("orig_input"), PackedSequence):
            raise _refuse(
                module, shape, "its dropout between layers runs on a PackedSequence's packed (tokens, hidden) data, "
                "whose rows mix the batch's samples by length",
                "Pad the batch instead of packing it (a padded (seq, batch, ...) input), or set dropout=0 and "
                "drop between single-layer modules",
            )
        if len(shape) != 3:
            raise _refuse(module, shape, "its dropout between layers is expected on (seq, batch, hidden)", "Please report it")
        return BatchDim(1, f"{type(module).__name__}'s dropout between layers is sequence-major")

    def layer(module: Any, frame: Any, shape: Sequence[int]) -> BatchDim:
        if len(shape) != 3:
            raise _refuse(
                module, shape, "its activations are unbatched (seq, d_model)", "Give the layer a batched input"
            )
        if _layer_dim(module) == 0:
            return BatchDim(0, f"{type(module).__name__}(batch_first=True)")
        return BatchDim(1, f"{type(module).__name__}(batch_first=False) is sequence-major")

    def attention(module: Any, frame: Any, shape: Sequence[int]) -> BatchDim:
        if len(shape) == 4:
            return BatchDim(0, "MultiheadAttention's attention dropout is batch-major")
        if len(shape) == 3:
            return BatchDim(
                0, "MultiheadAttention(need_weights=True) drops on (batch * heads, L, S)", heads=module.num_heads
            )
        raise _refuse(
            module, shape, "its attention dropout is expected on (batch, heads, L, S) or (batch * heads, L, S)",
            "Please report it",
        )

    rules: dict[int, Rule] = {}
    for cls in (nn.RNN, nn.LSTM, nn.GRU):
        rules[id(cls.forward.__code__)] = recurrent
    for cls in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer):
        for name in ("forward", "_sa_block", "_mha_block", "_ff_block"):
            method = vars(cls).get(name)
            if method is not None:
                rules[id(method.__code__)] = layer
    rules[id(nn.MultiheadAttention.forward.__code__)] = attention
    return rules


#: ``id`` of the code of a torch module's method -> ``rule(module, frame, shape) -> BatchDim``.
RULES_BY_CODE = _rules()


def said_by(frame: Any, shape: Sequence[int]) -> BatchDim | None:
    """The batch dim of a tensor of ``shape`` drawn under ``frame``, if ``frame`` runs one
    of torch's modules that says it (NotImplementedError where the tensor is not in the
    layout the module's rule knows)."""
    rule = RULES_BY_CODE.get(id(frame.f_code))
    return None if rule is None else rule(frame.f_locals.get("self"), frame, shape)
