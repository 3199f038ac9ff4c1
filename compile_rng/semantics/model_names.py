"""The names that key per-name streams: a parameter's, buffer's or module's name in a
``torch.distributed.checkpoint`` state dict (docs/contract.md, "Names").

Per-name streams (``init(streams="fqn")``, ``step(names=...)``) make a draw depend on
where it sits in the model, so the name must be the same in every configuration compared:
with and without activation checkpointing, ``torch.compile(module)``, FSDP1 or DDP around
the model. Those wrappers insert a path component (``_checkpoint_wrapped_module``,
``_orig_mod``, ``_fsdp_wrapped_module``, ``module``) that DCP's names leave out; so do ours,
by DCP's own rule (:func:`compile_rng._torch.distributed_internals.checkpoint_name`). A wrapper
that DCP does not strip changes the checkpoint's keys and the streams' names alike.

A wrapper and the module it wraps get one name (a call of the wrapper and the call of the
module it makes are one call of that name).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch
from torch import nn

from compile_rng._torch.distributed_internals import checkpoint_module_name, checkpoint_name


# root -> (its module tree, the names): a named step names its model's modules at every
# step; DCP's rule walks each path (~0.1 ms a module), the tree is compared in microseconds
_names_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def module_names(root: nn.Module) -> Mapping[int, str]:
    """``id(module) -> name`` for the modules under ``root`` (alive while the caller holds
    ``root``): a wrapper has the name of the module it wraps. Computed again when a module
    under ``root`` was added, removed, replaced or wrapped since the last call."""
    tree = list(root.named_modules())
    shape = tuple((path, id(module), type(module)) for path, module in tree)
    known = _names_of.get(root)
    if known is not None and known[0] == shape:
        return known[1]
    names: dict[int, str] = {}
    for path, module in reversed(tree):  # a module's children first
        name = checkpoint_module_name(root, path)
        if name is None:  # DDP, OptimizedModule, FSDP1: named by the module they hold
            child = next(iter(module.children()), None)
            name = names.get(id(child)) if child is not None else None
        if name is not None:
            names.setdefault(id(module), name)
    _names_of[root] = (shape, MappingProxyType(names))
    return _names_of[root][1]


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
