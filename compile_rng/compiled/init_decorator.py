"""``@compile_rng.init``: run a weight-initialization function on compile_rng's stream."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from compile_rng._torch.dynamo_internals import compile_failures
from compile_rng.compiled.backend import backend
from compile_rng.eager import dispatch_modes, layout_blocks
from compile_rng.eager.fqn_streams import fqn_streams, modules_in
from compile_rng.semantics import layouts
from compile_rng.stream import state

_COMPILE_FAILURES = compile_failures()


def init(
    fn: Callable | None = None,
    *,
    layout: str = "tracker",
    inner: str = "inductor",
    compile: bool | str = False,
    streams: str | None = None,
    seed: int | None = None,
    mode: str | None = None,
    key: str | None = None,
) -> Any:
    """Decorate a function that initializes modules or tensors (``model.init_weights``,
    a ``reset_parameters`` loop, ``nn.init.*`` calls).

    Calling it runs the function under ``torch.no_grad()`` and returns what it returns,
    with every random op - on DTensors and on plain tensors alike - drawing from
    compile_rng's stream in counter ``layout`` (``"tracker"`` or ``"invariant"``).

    ``compile``: ``False`` (default) runs the function eagerly on the stream - an init runs
    once per job, and its first call is fastest that way (``benchmarks/bench_init_first.py``:
    compiling costs Dynamo and Inductor seconds that one call never earns back).
    ``"auto"`` compiles the function as one graph with ``compile_rng.backend(layout,
    inner)`` (cached by ``torch.compile`` per module structure); a function Dynamo cannot
    capture whole - ``nn.init.trunc_normal_`` reads values
    (:mod:`compile_rng.eager.trunc_normal`), ``with torch.device(...)`` - runs eagerly instead,
    with the same values, after a warning (once per model: another model
    the function is called on still compiles). ``True`` requires the single graph
    (raises otherwise). Partial graphs are not used: an init loop split at every
    ``trunc_normal_`` would recompile per shape for no speed.

    ``streams="fqn"``: every parameter and buffer of the ``nn.Module`` arguments draws from
    its own stream, derived from ``(seed, its fully qualified name)`` instead of from
    program order (:mod:`compile_rng.eager.fqn_streams`), so a pipeline stage that initializes
    only its layers gets their single-device values with no seed checkpoint and no
    messages between stages. It runs eagerly (the per-name seeds are host values).

    ``seed``: draw from the stream ``(seed, 0)`` (or, with ``streams="fqn"``, from the per-name
    streams derived from ``seed``) whatever the current state, and leave the state as it
    was. Without it the current state's seed is used. Pass it when the training stack
    seeds ranks differently (pipeline stages seeded with ``seed + pp_rank`` would
    otherwise derive different per-name streams and defeat ``streams="fqn"``).

    ``mode=`` and ``key=`` are the deprecated spellings of ``layout=`` and ``streams=``.
    """
    layout = layouts.renamed_keyword("compile_rng.init", layout, mode)
    streams = _streams_argument(streams, key)
    _check_arguments(compile, streams, seed)

    def decorate(f: Callable) -> Callable:
        runner = _Init(f, layout, inner, compile, streams, seed)

        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            return runner(*args, **kwargs)

        run.backend = runner.backend
        run.compiled = runner.uses_graph
        return run

    return decorate(fn) if fn is not None else decorate


def _check_arguments(compile: bool | str, streams: str | None, seed: int | None) -> None:
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile_rng.init: compile must be True, False or 'auto', got {compile!r}")
    if streams not in (None, "fqn"):
        raise ValueError(f"compile_rng.init: streams must be None or 'fqn', got {streams!r}")
    if streams == "fqn" and compile is True:
        raise ValueError("compile_rng.init: streams='fqn' runs eagerly; drop compile=True")
    if seed is not None:
        state.check_uint64("seed", seed)


class _Init:
    """A function decorated by :func:`init`: its calls, as one graph or eagerly."""

    def __init__(self, f: Callable, layout: str, inner: str, compile: bool | str, streams: str | None,
                 seed: int | None):
        self.f, self.layout, self.compile, self.streams, self.seed = f, layout, compile, streams, seed
        self.backend = backend(layout=layout, inner=inner)
        self.graph = torch.compile(f, backend=self.backend, fullgraph=True)
        # Dynamo's failure to capture a call whole is the model's (its structure, its
        # init's branches): the models that failed run eagerly from then on, the others
        # still try; calls on no module share one decision
        self.eager_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.eager_without_model = False

    def uses_graph(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a call on these arguments runs as one graph (no arguments: a call on no module)."""
        if self.compile is False or self.streams is not None:
            return False
        models = modules_in(args, kwargs)
        if models:
            return not any(model in self.eager_models for model in models)
        return not self.eager_without_model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with layout_blocks.layout(self.layout), torch.no_grad(), _stream_seed(self.seed if self.streams is None else None):
            if self.uses_graph(*args, **kwargs):
                before = state.snapshot()
                try:
                    return self.graph(*args, **kwargs)
                # Any failure to compile: Dynamo could not capture one graph, hit its
                # recompile limit (a helper called on tensors of many meshes or layouts),
                # or the C++ compiler failed (gcc 12 crashes on the single kernel Inductor
                # makes of a whole model's normal_ init). The eager run starts from the
                # state the call began with, so it draws what the graph would have.
                except _COMPILE_FAILURES as e:
                    state.restore(before)
                    self._fall_back(e, args, kwargs)
            return self._eager(*args, **kwargs)

    def _fall_back(self, error: BaseException, args: tuple, kwargs: dict) -> None:
        """Refuse (``compile=True``) or warn, and run calls on these models eagerly from now on."""
        name = self.f.__qualname__
        if self.compile is True:
            raise RuntimeError(
                f"compile_rng.init(compile=True): {name} does not compile as one "
                "graph; pass compile='auto' or False to run it eagerly on the stream"
            ) from error
        warnings.warn(
            f"compile_rng.init: {name} does not compile as one graph "
            f"({str(error).splitlines()[0]}); running it eagerly on compile_rng's stream",
            stacklevel=4,
        )
        models = modules_in(args, kwargs)
        self.eager_models.update(models)
        self.eager_without_model |= not models

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        names = fqn_streams(modules_in(args, kwargs), self.seed) if self.streams == "fqn" else contextlib.nullcontext()
        # The name streams' dispatch mode sits on top: it picks the stream, then the op draws.
        with dispatch_modes.eager_stream(), names:
            return self.f(*args, **kwargs)


def _streams_argument(streams: str | None, key: str | None) -> str | None:
    """``streams=``, or its deprecated spelling ``key=`` (*key* is the RNG key tensor)."""
    if key is None:
        return streams
    warnings.warn(
        f"compile_rng.init(key={key!r}) names the parameters' streams; spell it streams={key!r} "
        "(the old spelling goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    if streams not in (None, key):
        raise ValueError(f"compile_rng.init: streams={streams!r} and key={key!r} disagree; pass streams= only")
    return key


@contextlib.contextmanager
def _stream_seed(seed: int | None) -> Iterator[None]:
    """Draw from ``(seed, 0)`` inside the block and restore the state after it."""
    if seed is None:
        yield
        return
    saved = state.snapshot()
    for kind in saved:
        state.set_state(seed, 0, kind)
    try:
        yield
    finally:
        state.restore(saved)
