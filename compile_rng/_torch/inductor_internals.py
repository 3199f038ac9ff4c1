"""Inductor's private APIs compile_rng reads: its compile entry point, options,
decompositions, caches and vector ISA, and what the lowerings build (the lazy names of
:data:`_LAZY`: ``from compile_rng._torch.inductor_internals import register_lowering``
imports Inductor then).

One temporary patch lives here, beside what it patches, lasting only for the backend's
own compile: :func:`rank_free_mesh_cache_keys`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from compile_rng._torch.core_internals import lazy_attributes

__all__ = [  # and the lazy names of _LAZY, added below
    "inductor_cache_dir",
    "inductor_caches_off",
    "inductor_compile",
    "inductor_decompositions",
    "inductor_options",
    "inductor_vector_isa",
    "rank_free_mesh_cache_keys",
]


@contextlib.contextmanager
def rank_free_mesh_cache_keys() -> Iterator[None]:
    """Inductor's FX-graph cache key with a DeviceMesh graph input reduced to the mesh's
    ``_stable_hash()`` (its ranks, layout, device type and dim names: what DTensor's
    guards and AOTAutograd's cache key use), not to its pickled ``__dict__``, which holds
    the process's rank, coordinate and ``hash()`` (a different key in every process).
    AOTAutograd lifts a DTensor's mesh into the graph as an opaque input; the compiled
    code reads nothing rank-specific from it at compile time (a value it bakes in is in
    the graph's code, which the key hashes). Lasts for the block (the backend's own
    compile, under Dynamo's compile lock): other compiles keep torch's key.
    ``FxGraphCachePickler._reduce_fake_script_object`` is looked up when a pickler is
    made (2.13, 2.15)."""
    if not torch.distributed.is_available():
        yield
        return
    from torch._inductor.codecache import FxGraphCachePickler
    from torch.distributed.device_mesh import DeviceMesh

    stock = FxGraphCachePickler.__dict__["_reduce_fake_script_object"]

    def reduce(self: Any, obj: Any) -> Any:
        if isinstance(obj.real_obj, DeviceMesh):
            return (str, (f"{obj.script_class_name}:{obj.real_obj._stable_hash()}",))
        return stock(self, obj)

    FxGraphCachePickler._reduce_fake_script_object = reduce
    try:
        yield
    finally:
        FxGraphCachePickler._reduce_fake_script_object = stock


def inductor_cache_dir() -> str:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR`` or its default): compile_rng's
    plans are kept beside the artifacts they describe."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_caches_off() -> Any:
    """A context in which Inductor neither looks up nor files artifacts: for compiles
    whose code depends on something its keys do not hold (benchmarks and tests that
    force the lowering's choice of a fused loop or a kernel call)."""
    from torch._inductor import config

    return config.patch(force_disable_caches=True)


def inductor_vector_isa() -> str:
    """The vector instruction set Inductor generates CPU C++ for, e.g. ``"avx512"``,
    ``"avx2"``, ``"neon"``, ``""`` for none (its ``pick_vec_isa``, which honours
    ``ATEN_CPU_CAPABILITY``): the lowerings pick fused loops or the C kernel by it."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return str(isa).split(" ")[0] if isa else ""  # an InvalidVecISA is falsy


def inductor_decompositions() -> dict:
    """Inductor's decomposition table (the aot_eager path applies the same ones)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: fx.GraphModule, inputs: list, config_patches: dict, decompositions: dict) -> Any:
    """Inductor's ``compile_fx`` with config patches: ``joint_custom_pre_pass`` is where
    the pass runs on the joint graph, before partitioning."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, inputs, config_patches=config_patches, decompositions=decompositions)


def inductor_options(mode: str | None, options: dict | None) -> dict:
    """Inductor config patches for ``torch.compile``'s ``mode`` and ``options``, as
    ``torch.compile`` derives them for its own Inductor backend (2.13-2.15:
    ``torch._inductor.list_mode_options``, option names are config names with ``-`` as
    ``_``). An unknown mode or option raises, naming it."""
    from torch._inductor import config, list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    known = config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(
                f"compile_rng backend: unknown Inductor option {key!r} in torch.compile(options=...); "
                "torch._inductor.list_options() lists them"
            )
        patches[name] = value
    return patches


# --- names imported on first use ---------------------------------------------------------

# name -> (module, attribute or None for the module itself, why)
_LAZY: dict[str, tuple[str, str | None, str]] = {
    "inductor_ir": ("torch._inductor.ir", None, "the lowerings build Inductor IR"),
    "register_lowering": ("torch._inductor.lowering", "register_lowering", "lowers the functional ops"),
    "fallback_handler": (
        "torch._inductor.lowering", "fallback_handler",
        "long float32 streams call the C kernel from compiled code",
    ),
    "inductor_ops": ("torch._inductor.virtualized", "ops", "the pointwise ops of a lowering's inner function"),
    "CustomGraphPass": (
        "torch._inductor.custom_graph_pass", "CustomGraphPass",
        "the joint pass's type: Inductor's FX-graph cache keys a custom pass on its uuid() (else bypasses)",
    ),
}
__all__ += list(_LAZY)
__getattr__ = lazy_attributes(__name__, _LAZY)
