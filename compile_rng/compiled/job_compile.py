"""One compile per job: the first rank of a node compiles a graph, the others load it.

compile_rng's graphs are rank-agnostic (the key input carries the rank's position), and
Inductor's FX-graph cache keys an artifact on the traced graph and the mesh by its ranks
and layout, not on the process's rank (``tests/test_caches.py``). Ranks that start
compiling the same graph at the same moment all miss that cache and all compile it.
Here the first rank to take a file lock named by the graph, in Inductor's cache folder
(one per node), compiles while the others wait; then they compile too and find its
artifact. Nothing is communicated, so ranks that compile different graphs (uneven
``_StridedShard`` layouts) never wait on each other; a rank whose load misses compiles
itself (correctness never depends on the lock, only the time does), and waits at most
for that one first compile. ``benchmarks/bench_job_compile.py`` measures it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from filelock import FileLock
from torch import fx

from compile_rng._torch import inductor_internals

#: ``COMPILE_RNG_JOB_COMPILE=0`` lets every rank compile on its own, as stock torch does.
ENV = "COMPILE_RNG_JOB_COMPILE"


def enabled(inner: str) -> bool:
    """Whether ranks queue: a multi-rank job compiling with Inductor and its caches on."""
    if os.environ.get(ENV, "1") == "0" or inner != "inductor" or not inductor_internals.inductor_caches_enabled():
        return False
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _describe(value: object) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(type(value))
    parts = [type(value).__name__, str(value.dtype), str(tuple(value.shape)), str(value.stride())]
    placements = getattr(value, "placements", None)
    if placements is not None:  # a DTensor: its layout, and its mesh by its ranks (as Inductor's key has it)
        parts += [str(placements), str(value.device_mesh.mesh.tolist())]
    return " ".join(parts)


def graph_identity(gm: fx.GraphModule, inputs: list) -> str:
    """What ranks compiling the same graph share: its code and its inputs' layouts. Two
    graphs that only this identity confuses are compiled one after the other, each its own."""
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(gm.code.encode())
    for value in inputs:
        digest.update(_describe(value).encode())
    return digest.hexdigest()[:40]


@contextlib.contextmanager
def compiling_once(gm: fx.GraphModule, inputs: list, inner: str) -> Iterator[None]:
    """Compile inside: of the ranks of this node that compile the same graph, the first
    compiles while the others wait; then they compile together, finding its artifact in
    Inductor's cache. A rank never waits for more than that first compile, also where
    the artifact does not serve it (a graph whose traced form differs by rank)."""
    if not enabled(inner):
        yield
        return
    folder = Path(inductor_internals.inductor_cache_dir()) / "compile_rng_locks"
    folder.mkdir(parents=True, exist_ok=True)
    identity = graph_identity(gm, inputs)
    compiled_once = folder / f"{identity}.done"
    lock = FileLock(str(folder / f"{identity}.lock"))
    with lock:
        first = not compiled_once.exists()
        if first:
            yield
            compiled_once.touch()
    if not first:
        yield
