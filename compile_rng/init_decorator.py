"""``@compile_rng.init``: run a weight-initialization function on compile_rng's stream."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import tracker
from .backend import backend
from .fqn_streams import fqn_streams, modules_in


def init(
    fn: Callable | None = None,
    *,
    mode: str = "tracker",
    inner: str = "inductor",
    compile: bool | str = "auto",
    key: str | None = None,
) -> Any:
    """Decorate a function that initializes modules or tensors (``model.init_weights``,
    a ``reset_parameters`` loop, ``nn.init.*`` calls).

    Calling it runs the function under ``torch.no_grad()`` and returns what it returns,
    with every random op - on DTensors and on plain tensors alike - drawing from
    compile_rng's stream in ``mode`` (``"tracker"`` or ``"invariant"``).

    ``compile``: ``"auto"`` (default) compiles the function as one graph with
    ``compile_rng.backend(mode, inner)`` (cached by ``torch.compile`` per module
    structure); a function Dynamo cannot capture whole - ``nn.init.trunc_normal_`` reads
    values (:mod:`compile_rng.trunc_normal`) - runs eagerly instead, with the same
    values, after a one-time warning. ``True`` requires the single graph (raises
    otherwise); ``False`` always runs eagerly. Partial graphs are not used: an init
    loop split at every ``trunc_normal_`` would recompile per shape for no speed.

    ``key="fqn"``: every parameter and buffer of the ``nn.Module`` arguments draws from
    its own stream, derived from ``(seed, its fully qualified name)`` instead of from
    program order (:mod:`compile_rng.fqn_streams`), so a pipeline stage that initializes
    only its layers gets their single-device values with no seed checkpoint and no
    messages between stages. It runs eagerly (the per-name seeds are host values).
    """
    if mode not in tracker.MODES:
        raise ValueError(f"compile_rng.init: mode must be one of {tracker.MODES}, got {mode!r}")
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile_rng.init: compile must be True, False or 'auto', got {compile!r}")
    if key not in (None, "fqn"):
        raise ValueError(f"compile_rng.init: key must be None or 'fqn', got {key!r}")
    if key == "fqn" and compile is True:
        raise ValueError("compile_rng.init: key='fqn' runs eagerly; drop compile=True")

    def decorate(f: Callable) -> Callable:
        be = backend(mode=mode, inner=inner)
        compiled = torch.compile(f, backend=be, fullgraph=True)
        use_graph = compile is not False and key is None

        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal use_graph
            with tracker.mode(mode), torch.no_grad():
                if use_graph:
                    try:
                        return compiled(*args, **kwargs)
                    # Raised while tracing or compiling, before anything ran: Dynamo could not
                    # capture one graph, or the C++ compiler failed on it (gcc 12 crashes on
                    # the single kernel Inductor makes of a whole model's normal_ init).
                    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as e:
                        if compile is True:
                            raise RuntimeError(
                                f"compile_rng.init(compile=True): {f.__qualname__} does not compile as one "
                                "graph; pass compile='auto' or False to run it eagerly on the stream"
                            ) from e
                        warnings.warn(
                            f"compile_rng.init: {f.__qualname__} does not compile as one graph "
                            f"({str(e).splitlines()[0]}); running it eagerly on compile_rng's stream",
                            stacklevel=2,
                        )
                        use_graph = False
                streams = fqn_streams(modules_in(args, kwargs)) if key == "fqn" else contextlib.nullcontext()
                with streams, tracker.eager_stream():
                    return f(*args, **kwargs)

        run.backend = be
        run.compiled = lambda: use_graph
        return run

    return decorate(fn) if fn is not None else decorate
