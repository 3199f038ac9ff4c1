"""Per-parameter streams keyed by fully qualified name (``@compile_rng.init(streams="fqn")``).

A pipeline stage that initializes only its own layers must get the single-device
values of those layers without knowing how many counters the earlier stages used. So
each parameter (and buffer) gets its own stream: seed ``derive_seed(seed, fqn)``,
offset 0, advanced by the random ops that draw into it.

Which tensor a draw is for is decided by *storage*, at the time of the draw, from the
modules' current parameters and buffers (a re-assigned buffer is seen as re-assigned;
nothing is keyed by ``id()``, which Python recycles):

* a draw into a named tensor, its ``.data``, or any view or chunk of it (fused QKV
  weights initialized per chunk), or a ``*_like`` of it, uses that tensor's stream;
* a temporary allocated from, or computed from, one named tensor (``w.new_empty(...)``,
  ``torch.empty_like(w)``, the ``where`` in ``trunc_normal_``'s redraw loop - as
  ``nn.init.orthogonal_`` and fused-weight inits do) inherits its stream;
* any other draw (``torch.randn(...)`` into a fresh temporary) has no known owner: it
  draws from a stream of its own (``derive_seed(seed, "<anonymous>")``), and if its
  values later reach a named tensor (``copy_``, ``cat(out=)``, an assignment as the
  parameter), compile_rng raises an error naming the op instead of guessing.

Derivation: ``derive_seed(seed, fqn)`` is the first 8 bytes (little endian) of
SHA-256(``b"compile_rng/fqn/v1" || seed as 8 bytes || fqn as UTF-8``). Two names whose
derived seeds coincide (probability about n**2 / 2**65) raise an error instead of
sharing a stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from compile_rng._torch.core_internals import OpOverload, TorchDispatchMode, op_arguments, storage_weak_ref, tree_leaves
from compile_rng._torch.dtensor_internals import local_tensor
from compile_rng.eager import dispatch_modes
from compile_rng.eager.user_code import user_line
from compile_rng.semantics.model_names import TensorNames
from compile_rng.semantics.random_ops import is_random
from compile_rng.stream import named_seed, state

_DOMAIN = b"compile_rng/fqn/v1"
ANONYMOUS = "<anonymous>"

aten = torch.ops.aten

# Ops that allocate a temporary "like" a tensor (the names are refreshed for them: the
# tensor may have been registered since the last draw).
_ALLOCATE_LIKE = {
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.clone.default,
    aten._to_copy.default,
}


def derive_seed(seed: int, fqn: str) -> int:
    """The 64-bit seed of the stream of the tensor named ``fqn``."""
    return named_seed(seed, _DOMAIN, fqn)


def _storage_of(t: object) -> torch.UntypedStorage | None:
    """The storage holding ``t``'s values on this rank (a DTensor's local shard)."""
    if not isinstance(t, torch.Tensor):
        return None
    local = local_tensor(t)
    if type(local) is not torch.Tensor and not isinstance(local, nn.Parameter):
        return None  # other subclasses (fake, functional) hold no storage of their own
    if local.is_meta or local.numel() == 0:
        return None
    return local.untyped_storage()


def _key(storage: torch.UntypedStorage) -> int:
    return storage.data_ptr()


class _StorageSet:
    """Storages (weakly held) with a value each; a freed storage's address is forgotten,
    so a new tensor that recycles the address is not mistaken for the old one."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[object, str]] = {}

    def add(self, storage: torch.UntypedStorage, value: str) -> None:
        self._items[_key(storage)] = (storage_weak_ref(storage), value)

    def get(self, storage: torch.UntypedStorage | None) -> str | None:
        if storage is None:
            return None
        item = self._items.get(_key(storage))
        if item is None:
            return None
        if item[0].expired():
            del self._items[_key(storage)]
            return None
        return item[1]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t``'s elements lie in (this rank's local values)."""
    local = local_tensor(t)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(local.shape, local.stride()))
    start = local.storage_offset() * local.element_size()
    return start, start + extent * local.element_size()


class _NamedSpans:
    """The named tensors by the bytes they hold: a draw into a tensor belongs to the named
    tensor whose bytes contain its own. Several named tensors can share one storage
    (FSDP1's ``use_orig_params`` parameters are views of one flat parameter)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[object, list[tuple[int, int, str]]]] = {}

    def add(self, t: torch.Tensor, name: str) -> None:
        storage = _storage_of(t)
        if storage is None:
            return
        item = self._items.get(_key(storage))
        if item is None or item[0].expired():
            item = self._items[_key(storage)] = (storage_weak_ref(storage), [])
        item[1].append((*_span(t), name))

    def get(self, t: object) -> str | None:
        storage = _storage_of(t)
        item = None if storage is None else self._items.get(_key(storage))
        if item is None:
            return None
        if item[0].expired():
            del self._items[_key(storage)]
            return None
        start, end = _span(t)
        return next((name for lo, hi, name in item[1] if lo <= start and end <= hi), None)


@dataclass
class _Streams:
    """The per-name stream positions of one ``fqn_streams`` block."""

    seed: int
    tensors: TensorNames

    def __post_init__(self) -> None:
        self.seeds: dict[str, int] = {}
        self.positions: dict[tuple[str, str], int] = {}
        self.current: tuple[str, str] | None = None  # (name, device type)
        owner: dict[int, str] = {}
        names = {name for name, _ in self.tensors}
        for name in sorted(names) + [ANONYMOUS]:
            derived = derive_seed(self.seed, name)
            if derived in owner:
                raise RuntimeError(f"compile_rng: the stream seeds of {name!r} and {owner[derived]!r} coincide; rename one")
            owner[derived] = name
            self.seeds[name] = derived

    def select(self, name: str, device: str) -> None:
        """Point ``device``'s stream (a device type) at ``name``'s stream position."""
        if (name, device) == self.current:
            return
        if self.current is not None:
            self.positions[self.current] = state.get_state(self.current[1])[1]
        if name not in self.seeds:  # a tensor registered while the function ran
            self.seeds[name] = derive_seed(self.seed, name)
        self.current = (name, device)
        state.set_state(self.seeds[name], self.positions.get(self.current, 0), device)


def _written(func: OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes into (in-place targets and ``out=``)."""
    written = []
    for i, arg in enumerate(op_arguments(func)):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class _OwnershipMode(TorchDispatchMode):
    """Selects the stream of every random op by the storage it draws into, and follows
    values drawn with no known owner so they never silently land in a named tensor."""

    def __init__(self, streams: _Streams) -> None:
        super().__init__()
        self.streams = streams
        self.named = _NamedSpans()  # the modules' parameters and buffers, refreshed at each draw
        self.derived = _StorageSet()  # temporaries allocated from, or computed from, one named tensor
        self.anonymous = _StorageSet()  # storages holding values of ownerless draws -> the draw
        self.refresh_names()

    def owner(self, t: object) -> str | None:
        return self.named.get(t) or self.derived.get(_storage_of(t))

    def refresh_names(self) -> None:
        for name, t in self.streams.tensors:
            if self.named.get(t) is None:
                self.named.add(t, name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        written = _written(func, args, kwargs)
        if is_random(func):
            self.refresh_names()
            target = args[0] if args and isinstance(args[0], torch.Tensor) else None
            owner = self.owner(target)
            self.streams.select(owner or ANONYMOUS, dispatch_modes.op_device(func, args, kwargs).type)
            out = func(*args, **kwargs)
            if owner is None:
                self.mark(self.anonymous, [*tree_leaves(out), *written], f"{func} at {user_line()}")
            else:
                self.mark(self.derived, tree_leaves(out), owner)
            return out
        drawn = next((d for d in (self.anonymous.get(_storage_of(t)) for t in inputs) if d), None)
        if drawn is not None:
            self.refresh_names()
            for target in written:
                name = self.named.get(target)
                if name is not None:
                    raise ownerless_error(f"{func} writes them into {name!r}", drawn)
        out = func(*args, **kwargs)
        if drawn is not None:
            self.mark(self.anonymous, [*tree_leaves(out), *written], drawn)
            return out
        # A value computed from one named tensor (trunc_normal_'s ``where`` over redraws)
        # stays that tensor's: temporaries allocated like it draw from its stream.
        owners = {o for o in map(self.owner, inputs) if o is not None}
        if not owners and func in _ALLOCATE_LIKE:  # from a tensor registered since the last draw?
            self.refresh_names()
            owners = {o for o in map(self.owner, inputs) if o is not None}
        if len(owners) == 1:
            self.mark(self.derived, [*tree_leaves(out), *written], owners.pop())
        return out

    @staticmethod
    def mark(storages: _StorageSet, tensors: list, value: str) -> None:
        for t in tensors:
            storage = _storage_of(t)
            if storage is not None and storages.get(storage) is None:
                storages.add(storage, value)

    def check_named(self) -> None:
        """Raise if a named tensor now holds values of an ownerless draw (a parameter
        re-assigned to a temporary: ``module.w = nn.Parameter(tmp)``, ``w.data = tmp``)."""
        for name, t in self.streams.tensors:
            drawn = self.anonymous.get(_storage_of(t))
            if drawn is not None:
                raise ownerless_error(f"{name!r} was assigned them", drawn)


def ownerless_error(what: str, drawn: str) -> RuntimeError:
    return RuntimeError(
        f"compile_rng.init(streams='fqn'): {drawn} drew values into a tensor that belonged to no "
        f"parameter or buffer, and {what}; its per-name stream could not be chosen when it drew. "
        "Draw into the parameter (or a view or chunk of it), or allocate the temporary from it "
        "(w.new_empty(...), torch.empty_like(w)) so that it takes the parameter's stream."
    )


@contextlib.contextmanager
def fqn_streams(modules: Iterable[nn.Module], seed: int | None = None) -> Iterator[None]:
    """Inside the block, random ops draw from the stream of the named tensor of
    ``modules`` they draw into (see the module docstring); ``seed`` defaults to the
    run's declared seed (``compile_rng.run_seed``), else the current stream's seed. The
    global stream is left as it was."""
    modules = list(modules)
    if not modules:
        raise ValueError("compile_rng.init(streams='fqn'): no nn.Module among the arguments to take names from")
    saved = state.snapshot()
    if seed is None:  # the run's declared seed, else this rank's stream's
        run = state.run_position()
        seed = saved["cpu"][0] if run is None else run[0]
    mode = _OwnershipMode(_Streams(seed, TensorNames(modules)))
    try:
        with mode:
            yield
        mode.check_named()
    finally:
        state.restore(saved)


def modules_in(args: tuple, kwargs: dict) -> list[nn.Module]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]
