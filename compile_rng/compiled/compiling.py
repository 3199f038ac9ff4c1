"""``compile_rng.compile``: ``torch.compile`` whose eager segments stay on the stream.

Dynamo splits a function at a graph break and runs the code between the graphs
eagerly. ``torch.compile(fn, backend="compile_rng")`` makes the graphs functional, but
torch gives a backend no hook around the whole call (``torch.compile`` wraps the
backend object, dropping Dynamo's ``backend_ctx_ctor``), so a plain-tensor random op
in such an eager segment would draw from torch's generator. This wrapper holds
:func:`compile_rng.eager.dispatch_modes.compiled_call` around every call instead: eager segments
then use the same stream and counters as one graph would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from compile_rng.compiled.backend import backend
from compile_rng.eager import dispatch_modes
from compile_rng.semantics.layouts import layout_or_compile_mode


def compile(
    model: Callable | torch.nn.Module | None = None,
    *,
    layout: str = "tracker",
    inner: str = "inductor",
    verify: Any = False,
    mode: str | None = None,
    options: dict | None = None,
    **torch_compile_kwargs: Any,
) -> Any:
    """``torch.compile`` with ``compile_rng.backend(layout, inner, verify)`` in which every
    random op - in the graphs and in the eager code between them - follows compile_rng's
    stream, so a function with graph breaks gives the values of one graph.

    A function gets a wrapper (``.backend`` holds the backend and its ``plans``); an
    ``nn.Module`` gets ``torch.compile``'s ``OptimizedModule`` (``.forward.backend``).
    ``mode``, ``options`` and ``torch_compile_kwargs`` (``dynamic``, ``fullgraph``, ...)
    are ``torch.compile``'s (``mode``/``options`` configure the inner Inductor;
    ``mode="invariant"`` is the deprecated spelling of ``layout="invariant"``).
    Usable as ``@compile_rng.compile`` or ``@compile_rng.compile(layout="invariant")``.
    """
    layout, mode = layout_or_compile_mode("compile_rng.compile", layout, mode)
    if model is None:
        return functools.partial(
            compile, layout=layout, inner=inner, verify=verify, mode=mode, options=options, **torch_compile_kwargs
        )
    be = backend(layout, inner, verify)
    compiled = torch.compile(model, backend=be, mode=mode, options=options, **torch_compile_kwargs)
    if isinstance(model, torch.nn.Module):
        # torch.compile's OptimizedModule; its forward is the Dynamo-wrapped call
        compiled.forward = _on_stream(compiled.forward, be)
        return compiled
    return functools.wraps(model)(_on_stream(compiled, be))


def _on_stream(compiled: Callable, be: Any) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        with dispatch_modes.compiled_call():
            return compiled(*args, **kwargs)

    call.backend = be
    return call
