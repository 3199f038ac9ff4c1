"""Inductor's code for a CUDA graph, generated on a machine with no GPU (no launch).

Lowering a graph of fake CUDA tensors needs no device; generating its code asks the
device for its properties and Triton for its active driver, and neither exists here.
:func:`generated_code` answers those questions for an H100 (sm_90) and returns the
module Inductor would compile: the wrapper and the Triton kernels' sources.

Every private torch API the tests use for this lives here, each with its reason (Triton's
are in :mod:`compile_rng._torch.triton_internals`); checked with torch 2.13.0 (triton 3.8.0, a
CPU build) and 2.15.0 (triton 3.9.0, a CUDA build with no driver). The patches last only
for the call.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable, Iterator, Sequence
from unittest import mock

import torch
from torch._inductor.debug import DebugContext  # Scheduler logs IR through V.debug
from torch._inductor.graph import GraphLowering  # lowering + codegen without compiling
from torch._inductor.runtime import hints  # the names a kernel's decorator uses
from torch._inductor.runtime.hints import DeviceProperties  # kernels' triton_meta
from torch._inductor.virtualized import V  # the graph handler lowerings read
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

H100 = dict(major=9, minor=0, multi_processor_count=132, regs_per_multiprocessor=65536,
            max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)


@contextlib.contextmanager
def _an_h100() -> Iterator[None]:
    from torch._dynamo.device_interface import get_interface_for_device

    from compile_rng._torch import triton_internals

    props = types.SimpleNamespace(name="NVIDIA H100 (fake)", total_memory=80 << 30, gcnArchName="", **H100)
    interface = get_interface_for_device("cuda")
    h100 = DeviceProperties(type="cuda", index=0, cc=90, **{k: v for k, v in H100.items() if k != "minor"})
    patches = [
        # the scheduler picks Triton by the device's capability (torch.cuda, both builds)
        mock.patch("torch.cuda.get_device_properties", lambda *a, **k: props),
        mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)),
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.current_device", lambda: 0),
        # Dynamo's device interface bound the torch.cuda functions at import
        mock.patch.object(interface, "get_device_properties", lambda *a, **k: props),
        mock.patch.object(interface, "get_compute_capability", lambda *a, **k: 90),
        mock.patch.object(interface, "is_available", lambda *a, **k: True),
        # DeviceProperties.create is functools.cache'd on the device: answer directly
        mock.patch.object(DeviceProperties, "create", lambda *a, **k: h100),
        # the kernels' cache key asks Triton's active driver, which needs libcuda
        mock.patch("torch.utils._triton.triton_backend", lambda: triton_internals.backend(90)),
        mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "fake-h100"),
        # codegen loads each new kernel's module, whose first line selects the GPU driver
        # (libcuda); a kernel already in Inductor's cache skipped it, so a fresh cache failed
        mock.patch("torch._inductor.runtime.triton_helpers.set_driver_to_gpu", lambda: None),
    ]
    # has_triton() is functools.cache'd: the first caller's device fixes its answer for the
    # process. Ask afresh under the fake H100, and forget that answer on the way out.
    from torch.utils._triton import has_triton

    with contextlib.ExitStack() as stack:
        stack.callback(has_triton.cache_clear)
        for p in patches:
            stack.enter_context(p)
        has_triton.cache_clear()
        yield


def generated_code(fn: Callable, inputs: Sequence[tuple[Sequence[int], torch.dtype]], *,
                   as_compiled: bool = False) -> str:
    """The module Inductor generates for ``fn`` (aten/custom ops on tensors) called on
    CUDA tensors of the given ``(shape, dtype)``s.

    ``as_compiled``: first rewrite the graph as ``torch.compile`` would before lowering
    it: Inductor's decompositions (``F.dropout``'s ``native_dropout`` into ``rand > p``
    and multiplies, ``rand_like`` into ``rand``) and the joint-graph pass that turns
    ``aten.rand``/``randn`` into Inductor's own random (``prims.inductor_random`` drawn
    in the kernel from one seed per graph), unless ``config.fallback_random``. Without
    it the graph is lowered as traced (compile_rng's custom ops need neither step)."""
    fake = FakeTensorMode()
    with fake:
        args = [torch.empty(list(shape), dtype=dtype, device="cuda") for shape, dtype in inputs]
    if as_compiled:
        from torch._inductor.decomposition import select_decomp_table  # Inductor's decompositions
        from torch._inductor.fx_passes.replace_random import replace_random_passes  # joint-graph pass

        gm = make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*args)
        with _an_h100(), V.set_fake_mode(fake):
            replace_random_passes(gm)
            gm.recompile()
    else:
        gm = make_fx(fn, tracing_mode="fake")(*args)
    with _an_h100():
        graph = GraphLowering(gm, example_inputs=args)
        with V.set_graph_handler(graph), V.set_fake_mode(fake), DebugContext():
            graph.run(*args)
            code = graph.codegen()[0]
    return getattr(code, "value", code)


_KERNEL = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)''', device_str='cuda'\)", re.S)


def triton_kernels(code: str) -> dict[str, str]:
    """The Triton kernels of a generated module: name -> source (decorators included)."""
    return dict(_KERNEL.findall(code))


def jit_source(kernel_source: str) -> str:
    """A generated kernel as a plain ``@triton.jit`` module: Inductor's autotuning
    decorator (which would compile on the device) dropped, its helpers imported (the
    ``@triton.jit`` helper functions the kernel calls come before the decorator)."""
    start = kernel_source.index("@triton_heuristics.")
    body = kernel_source[kernel_source.index("@triton.jit"):start] + kernel_source[kernel_source.index("\n@triton.jit", start) + 1:]
    return (
        "import triton\nimport triton.language as tl\n"
        "from torch._inductor.runtime import triton_helpers\n"
        "from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math\n\n" + body
    )


def triton_meta(kernel_source: str) -> dict:
    """The ``triton_meta`` Inductor gave a kernel: signature, constants, attributes."""
    text = re.search(r"triton_meta=(\{.*?\}),\n", kernel_source, re.S).group(1)
    return eval(text, {"DeviceProperties": lambda **k: k})  # noqa: S307 - Inductor's own literal


def launch_configs(kernel_source: str) -> list[dict]:
    """The configs Inductor's autotuner would try for a generated kernel on the (fake)
    H100: its ``@triton_heuristics.<kind>(...)`` decorator evaluated with
    ``return_configs=True`` (the heuristics' own switch; checked with torch 2.13). Each:
    ``{"kwargs": {"XBLOCK": ...}, "num_warps": ..., "num_stages": ...}``. Where there are
    several, the autotuner picks one by timing them on the GPU."""
    from torch._inductor.runtime import triton_heuristics  # the kernels' config heuristics

    start = kernel_source.index("@triton_heuristics.")
    call = kernel_source[start + 1:kernel_source.index("\n@triton.jit", start)]
    call = call.rstrip().removesuffix(")") + ", return_configs=True)"
    with _an_h100():
        configs = eval(call, {"triton_heuristics": triton_heuristics,  # noqa: S307 - Inductor's own code
                              "DeviceProperties": DeviceProperties, "__file__": None,
                              **{name: getattr(hints, name) for name in ("AutotuneHint", "ReductionHint", "TileHint")}})
    return [{"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]


def _literal(kernel_source: str, prefix: str) -> str:
    """The dict literal after ``prefix`` in a kernel's decorator, its nested braces
    (a reduction's ``tiling_scores``) included."""
    start = kernel_source.index(prefix) + len(prefix)
    depth = 0
    for end, ch in enumerate(kernel_source[start:], start):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return kernel_source[start:end + 1]
    raise ValueError(f"no balanced literal after {prefix!r}")


def compile_inputs(kernel_source: str, config: dict) -> dict:
    """What Inductor's autotuner hands ``triton.compile`` for a generated kernel under one
    of its :func:`launch_configs` (``CachingAutotuner._create_compile_meta`` and
    ``_create_compile_options``, torch 2.13): the signature (constexprs included), the
    constants (the config's block sizes), the attributes (``configs[0]``: 16-divisibility)
    and the options. ``debug`` is Inductor's ``assert_indirect_indexing``."""
    meta = triton_meta(kernel_source)
    inductor = eval(_literal(kernel_source, "inductor_meta="),  # noqa: S307 - Inductor's own literal
                    {"AutotuneHint": hints.AutotuneHint, "set": set})
    options = {
        "num_warps": config["num_warps"], "num_stages": config["num_stages"],
        "debug": inductor.get("assert_indirect_indexing", True), "sanitize_overflow": False,
        "enable_fp_fusion": meta.get("enable_fp_fusion", True),
        "launch_cooperative_grid": False, "launch_pdl": meta.get("launch_pdl", False),
    }
    if meta.get("disable_ftz", False):
        options["enable_reflect_ftz"] = False
    return {"signature": dict(meta["signature"]), "constants": {**meta["constants"], **config["kwargs"]},
            "attrs": dict(meta["configs"][0]), "options": options}


_BUFFER = re.compile(r"(\w+) = empty_strided_cuda\(\(([\d, ]*)\), \(([\d, ]*)\), torch\.(\w+)\)$")
_REUSE = re.compile(r"(\w+) = (\w+); del \w+  # reuse$")
_LAUNCH = re.compile(r"(\w+)\.run\((.*), stream=\w+\)$")
_SKIPPED = re.compile(r"args\.clear\(\)|assert_|with torch\.cuda\._DeviceGuard|torch\.cuda\.set_device|#|del |"
                      r"\w+ = get_raw_stream\(")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def interpret(code: str, inputs: Sequence[torch.Tensor], tmp_dir: str, xblock: int = 1024) -> tuple[torch.Tensor, ...]:
    """Run a :func:`generated_code` module's ``call`` on ``inputs`` (on ``inputs``' device:
    CPU tensors in Triton's interpreter, which the tests' conftest selects where there is no
    GPU): each Triton kernel is launched over its 1-D range in programs of ``xblock``
    elements, in the wrapper's order. Only the wrapper lines of a graph that is all Triton
    kernels are understood (arguments, buffers, reuse, launches, the return): any other
    line - a call of an op's eager kernel, say - raises."""
    import importlib.util
    from pathlib import Path

    kernels, env, device = {}, {}, inputs[0].device
    for name, source in triton_kernels(code).items():
        path = Path(tmp_dir) / f"{name}.py"
        path.write_text(jit_source(source))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernels[name] = getattr(module, name)
    body = code[code.index("def call(self, args):"):].splitlines()[1:]
    for line in (raw.strip() for raw in body):
        if line.endswith("= args"):
            env.update(zip((n.strip() for n in line.removesuffix("= args").split(",") if n.strip()), inputs))
        elif line.startswith("return ("):
            return tuple(env[n.strip()] for n in line[len("return ("):-1].split(",") if n.strip())
        elif m := _BUFFER.match(line):
            env[m[1]] = torch.empty_strided(_ints(m[2]), _ints(m[3]), dtype=getattr(torch, m[4]), device=device)
        elif m := _REUSE.match(line):
            env[m[1]] = env[m[2]]
        elif m := _LAUNCH.match(line):
            args = [env[a] if a in env else int(a) for a in (a.strip() for a in m[2].split(","))]
            numel = args[-1]  # the 1-D kernel's xnumel
            kernels[m[1]][((numel + xblock - 1) // xblock,)](*args, XBLOCK=xblock)
        elif line and not _SKIPPED.match(line):
            raise ValueError(f"a wrapper line interpret() does not run: {line}")
    raise ValueError("the generated call returned nothing")
