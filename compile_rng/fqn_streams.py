"""Per-parameter streams keyed by fully qualified name (``@compile_rng.init(key="fqn")``).

A pipeline stage that initializes only its own layers must get the single-device
values of those layers without knowing how many counters the earlier stages used. So
each parameter (and buffer) gets its own stream: seed ``derive_seed(seed, fqn)``,
offset 0, advanced by the random ops that initialize it. "Its" ops are the random ops
from the first one that targets the tensor (an in-place op on it, or a ``*_like`` of
it) until one targets another named tensor, so temporaries drawn while initializing it
(``trunc_normal_``'s rejection loop) stay on its stream.

Derivation: ``derive_seed(seed, fqn)`` is the first 8 bytes (little endian) of
SHA-256(``b"compile_rng/fqn/v1" || seed as 8 bytes || fqn as UTF-8``). FQNs are unique
within a module tree by construction, and the initialized modules are checked: two
names whose derived seeds coincide (probability about n**2 / 2**65) raise an error
instead of sharing a stream, so no two tensors ever silently share values.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from . import state

_DOMAIN = b"compile_rng/fqn/v1"

_hook: contextvars.ContextVar[Callable[[object], None] | None] = contextvars.ContextVar(
    "compile_rng_fqn_hook", default=None
)


def derive_seed(seed: int, fqn: str) -> int:
    """The 64-bit seed of the stream of the tensor named ``fqn``."""
    digest = hashlib.sha256(_DOMAIN + seed.to_bytes(8, "little") + fqn.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def select_for(target: object) -> None:
    """Called by the random-op modes with the tensor an op targets (or None)."""
    hook = _hook.get()
    if hook is not None and target is not None:
        hook(target)


def _named_tensors(modules: Iterable[nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for module in modules:
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            names[id(t)] = name
            local = getattr(t, "_local_tensor", None)  # a DTensor's region sees its local shard
            if local is not None:
                names[id(local)] = name
    return names


@contextlib.contextmanager
def fqn_streams(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside the block, random ops targeting a named tensor of ``modules`` draw from
    that tensor's own stream. The global stream is left as it was."""
    modules = list(modules)
    if not modules:
        raise ValueError("compile_rng.init(key='fqn'): no nn.Module among the arguments to take names from")
    names = _named_tensors(modules)
    seed, offset = state.get_state()
    seeds: dict[str, int] = {}
    owner: dict[int, str] = {}
    for name in sorted(set(names.values())):
        derived = derive_seed(seed, name)
        if derived in owner:
            raise RuntimeError(f"compile_rng: the stream seeds of {name!r} and {owner[derived]!r} coincide; rename one")
        owner[derived] = name
        seeds[name] = derived
    positions: dict[str, int] = {}
    current: list[str | None] = [None]

    def switch(target: object) -> None:
        name = names.get(id(target))
        if name is None or name == current[0]:
            return
        if current[0] is not None:
            positions[current[0]] = state.get_state()[1]
        current[0] = name
        state.set_state(seeds[name], positions.get(name, 0))

    token = _hook.set(switch)
    try:
        yield
    finally:
        _hook.reset(token)
        state.set_state(seed, offset)


def modules_in(args: tuple, kwargs: dict) -> list[nn.Module]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]

