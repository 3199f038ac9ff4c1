"""``compile_rng.library_compiles``: a library's own ``torch.compile`` calls on the stream.

Libraries compile their own code with stock ``torch.compile``: torchao's optimizers compile
their per-parameter step on every call, with the bf16 stochastic rounding's random draws
inside. Those draws are torch's, per rank, on local shards: under FSDP2 the weights then
depend on the world size. Inside :func:`library_compiles` such a call compiles with
compile_rng's backend in the block's layout instead (its graphs draw from the stream,
DTensor ops at the layout's counters), eager DTensor random ops draw in that layout, and
torchao's rounding draws its bits on the parameter's DTensor
(:mod:`compile_rng.integrations.torchao_rounding`). A stock-compiled graph that still
draws in the block (a library passing its own backend) is refused
(:mod:`compile_rng.eager.layout_blocks`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from compile_rng._torch.dynamo_internals import compiles_with
from compile_rng.compiled.backend import backend
from compile_rng.eager import layout_blocks
from compile_rng.integrations import torchao_rounding


@functools.cache
def _backend(layout: str) -> Any:
    # one backend per layout: a new backend object would make Dynamo compile again
    return backend(layout=layout)


@contextlib.contextmanager
def library_compiles(layout: str = "tracker") -> Iterator[None]:
    """Inside the block, ``torch.compile`` calls made with torch's default backend compile
    with ``compile_rng.backend(layout=layout)`` (``mode``, ``options`` and the rest passed
    on), eager DTensor random ops draw in ``layout``, and torchao's optimizers draw their
    bf16 stochastic rounding on the parameters' DTensors. One line around an optimizer
    step gives the same weights at any FSDP size with ``layout="invariant"``::

        with compile_rng.library_compiles(layout="invariant"):
            optimizer.step()

    ``torch.compile`` is patched for the block on every thread."""
    with layout_blocks.layout(layout), compiles_with(_backend(layout)), torchao_rounding.on_dtensors():
        yield
