"""The names that key per-name streams: a parameter's, buffer's or module's name in a
``torch.distributed.checkpoint`` state dict (docs/contract.md, "Names").

Per-name streams (``init(streams="fqn")``, ``step(names=...)``) make a draw depend on
where it sits in the model, so the name must be the same in every configuration compared:
with and without activation checkpointing, ``torch.compile(module)``, FSDP1 or DDP around
the model. Those wrappers insert a path component (``_checkpoint_wrapped_module``,
``_orig_mod``, ``_fsdp_wrapped_module``, ``module``) that DCP's names leave out; so do ours,
by DCP's own rule (:func:`compile_rng._torch.torch_internals.checkpoint_name`). A wrapper
that DCP does not strip changes the checkpoint's keys and the streams' names alike.

A wrapper and the module it wraps get one name (a call of the wrapper and the call of the
module it makes are one call of that name).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from compile_rng._torch.torch_internals import checkpoint_module_name, checkpoint_name


def module_names(root: nn.Module) -> dict[int, str]:
    """``id(module) -> name`` for the modules under ``root`` (alive while the caller holds
    ``root``): a wrapper has the name of the module it wraps."""
    names: dict[int, str] = {}
    for path, module in reversed(list(root.named_modules())):  # a module's children first
        name = checkpoint_module_name(root, path)
        if name is None:  # DDP, OptimizedModule, FSDP1: named by the module they hold
            child = next(iter(module.children()), None)
            name = names.get(id(child)) if child is not None else None
        if name is not None:
            names.setdefault(id(module), name)
    return names


class TensorNames:
    """The parameters and buffers of ``modules`` by name; each path's name is computed once
    (a draw re-reads the modules' tensors, which re-assignment may have changed)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self._names: dict[tuple[int, str], str] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for module in self.modules:
            for path, tensor in [*module.named_parameters(), *module.named_buffers()]:
                name = self._names.get((id(module), path))
                if name is None:
                    name = self._names[(id(module), path)] = checkpoint_name(module, path)
                yield name, tensor
