"""Inductor's private APIs compile_rng reads: its compile entry point, options,
decompositions, caches and vector ISA, and what the lowerings build (the lazy names of
:data:`_LAZY`: ``from compile_rng._torch.inductor_internals import register_lowering``
imports Inductor then).

One temporary patch lives here, beside what it patches, lasting only for the backend's
own compile: :func:`rank_free_mesh_cache_keys`; and :func:`triton_helper` adds a helper
function to the source of the one Triton kernel being generated, whose expressions
:func:`triton_consecutive_counters` reads back. The installer alone
adds an op to Inductor's op handlers and removes it (:func:`add_triton_op`,
:func:`remove_triton_op`).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from compile_rng._torch.core_internals import lazy_attributes

__all__ = [  # and the lazy names of _LAZY, added below
    "add_triton_op",
    "remove_triton_op",
    "inductor_cache_dir",
    "inductor_caches_off",
    "inductor_compile",
    "inductor_decompositions",
    "inductor_options",
    "inductor_vector_isa",
    "rank_free_mesh_cache_keys",
    "static_cuda_kernel",
    "static_cuda_launch",
    "triton_block",
    "triton_compute_lines",
    "triton_consecutive_counters",
    "triton_helper",
    "triton_kernel_holds_helpers",
    "triton_new_name",
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


def static_cuda_kernel(compiled: Any) -> Any:
    """torch's C++ launcher's record of Triton's compiled CUDA kernel ``compiled`` (what
    Inductor launches its kernels with instead of Triton's Python launcher): its
    ``arg_tys`` hold one type code per non-constexpr argument. Loads nothing. Private:
    ``torch._inductor.runtime.static_triton_launcher`` (run on 2.13; its source read for
    2.11 and 2.15, the same constructor and ``run``); it reads ``_cubin_path``, which
    Inductor sets on the kernels it compiles."""
    from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel

    if not hasattr(compiled, "_cubin_path"):
        compiled._cubin_path = None  # the cubin is written from the kernel's own bytes
    return StaticallyLaunchedCudaKernel(compiled)


def static_cuda_launch(kernel: Any, device: int, cubin_dir: str) -> Callable[..., None]:
    """``launch(grid_x, grid_y, stream, *args)`` of :func:`static_cuda_kernel`'s ``kernel``
    on CUDA device ``device``, its cubin written under ``cubin_dir``: ``args`` are the
    kernel's non-constexpr arguments in order. For the GPU check's host-time comparison
    (``benchmarks/bench_gpu.py --host``); no GPU has run it yet."""
    kernel.reload_cubin_from_raw(f"{cubin_dir}/{kernel.name}_{kernel.hash}.cubin")
    kernel.load_kernel(device)

    def launch(grid_x: int, grid_y: int, stream: int, *args: Any) -> None:
        kernel.run(grid_x, grid_y, 1, stream, *args)

    return launch


def _op_tables() -> tuple:
    """The classes an op of Inductor's IR needs a method in: the Triton code generator
    (``TritonOverrides``, which ``TritonKernelOverrides`` extends), the dtype pass
    (``DtypePropagationOpsHandler``) and the handlers that treat every op alike
    (``DefaultHandler``'s subclasses: index analysis, the kernel formatter, the memory
    counters), which otherwise warn "undefined OpHandler" once per use (2.11-2.15)."""
    from torch._inductor.codegen.triton import TritonOverrides
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler
    from torch._inductor.ops_handler import DefaultHandler

    return TritonOverrides, DtypePropagationOpsHandler, DefaultHandler


def add_triton_op(name: str, codegen: Callable[..., str], dtype: torch.dtype) -> None:
    """Make ``ops.<name>(*args)`` a pointwise op of Inductor's IR that a Triton kernel
    emits as the expression ``codegen(*args)`` (its arguments' Triton expressions) and
    whose value has ``dtype``; only Triton kernels can emit it. Inductor has no public way
    to add an op to its handlers (:func:`_op_tables`); stock code never names it."""
    triton, dtypes, default = _op_tables()
    setattr(triton, name, staticmethod(codegen))
    setattr(dtypes, name, staticmethod(lambda *args: dtype))
    setattr(default, name, default._call_default(name))


def remove_triton_op(name: str) -> None:
    """Take back what :func:`add_triton_op` added for ``name``."""
    for table in _op_tables():
        if name in vars(table):
            delattr(table, name)


def triton_helper(template: str, base_name: str) -> str:
    """Add the ``@triton.jit`` function ``template`` (its name as ``{name}``, every other
    brace doubled: Inductor ``str.format``s it) to the source of the Triton kernel being
    generated, once per kernel; its name there (``TritonKernel.helper_functions``, 2.11-2.15)."""
    from torch._inductor.virtualized import V

    return V.kernel.helper_functions.add(template, base_name=base_name)


def triton_kernel_holds_helpers() -> bool:
    """Whether the Triton kernel being generated splices its helper functions into its
    source (:func:`triton_helper`): not a template's (``TritonTemplateKernel``: its source
    is rendered from the template, with no helpers; a matmul's fused epilogue), 2.11-2.15."""
    from torch._inductor.select_algorithm import TritonTemplateKernel
    from torch._inductor.virtualized import V

    return not isinstance(V.kernel, TritonTemplateKernel)


_names_asked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def triton_new_name(prefix: str) -> str:
    """A name for values the kernel being generated does not hold yet: ``prefix`` and a
    count of the names asked of that kernel (deterministic: the same graph gives the same
    source, so Inductor's caches keep hitting)."""
    from torch._inductor.virtualized import V

    count = _names_asked.get(V.kernel, 0)
    _names_asked[V.kernel] = count + 1
    return f"{prefix}{count}"


def triton_compute_lines(lines: list[str]) -> None:
    """Append ``lines`` to the computations of the kernel being generated (its ``compute``
    buffer, where the ops of its body are written before what reads them)."""
    from torch._inductor.virtualized import V

    V.kernel.compute.writelines(lines)


def triton_block() -> str | None:
    """The block of the Triton kernel being generated, where it is one-dimensional (its
    ``XBLOCK``, or the constant it was given), else None (``TritonKernel``'s range trees,
    2.11-2.15)."""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V

    kernel = V.kernel
    if not isinstance(kernel, TritonKernel) or kernel.triton_tensor_ndim() != 1:
        return None
    return kernel.dense_size_list()[0]


#: ``(X).to(tl.int64)``: a cast Triton kernels wrap index expressions in (2.13-2.15)
_INT64_CAST = re.compile(r"\((.*)\)\.to\(tl\.int64\)")
#: an index name plus a number, as Inductor prints ``c + x0`` (2.11-2.15)
_NAME_PLUS_NUMBER = re.compile(r"(?:(\d+) \+ )?([a-z]\d+)(?: \+ (\d+))?")
#: a scalar broadcast to the 1-D block (2.11-2.15)
_BROADCAST = re.compile(r"tl\.broadcast_to\((\w+), \[XBLOCK\]\)")


def triton_consecutive_counters(seed: Any, base: Any, rel: Any) -> tuple[str, str, str] | None:
    """Where the 1-D Triton kernel being generated computed ``base + rel`` (its variables)
    as consecutive counters - ``seed`` and ``base`` scalars it broadcast, ``rel`` a number
    plus its block's own index (``xindex``, under a name such as ``x0``, through casts to
    int64) - ``(seed's scalar, the program's first counter, the block size)`` as Triton
    expressions: lane ``i``'s counter is the first plus ``i`` (``xindex = xoffset +
    arange(XBLOCK)``). None wherever it cannot tell. Read back from the expressions the
    kernel's common-subexpression table generated its variables from, and its range trees
    (``TritonKernel.cse._cache``, ``range_trees``; the same forms in 2.11-2.15)."""
    from torch._inductor.virtualized import V

    kernel = V.kernel
    cache = getattr(getattr(kernel, "cse", None), "_cache", None)
    if triton_block() is None or not isinstance(cache, dict):
        return None
    made_from = {str(var): text for text, var in cache.items() if isinstance(text, str)}
    scalars = [_BROADCAST.fullmatch(made_from.get(str(v), "")) for v in (seed, base)]
    text = made_from.get(str(rel))
    while text is not None and (cast := _INT64_CAST.fullmatch(text)) is not None:
        text = made_from.get(cast.group(1), cast.group(1))  # a variable's own text, or the index itself
    plus = _NAME_PLUS_NUMBER.fullmatch(text or "")
    if None in scalars or plus is None or (plus.group(1) is not None and plus.group(3) is not None):
        return None
    for tree in getattr(kernel, "range_trees", ()):
        for entry in getattr(tree, "nodes", {}).values():
            if entry.name == plus.group(2):  # the block's own index: xindex itself, whole
                if (tree.prefix != "x" or str(entry.expr) != "xindex" or entry.divisor != 1
                        or entry.length != tree.numel):
                    return None
                number = plus.group(1) or plus.group(3) or "0"
                return scalars[0].group(1), f"({scalars[1].group(1)} + ({number} + xoffset))", "XBLOCK"
    return None


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
