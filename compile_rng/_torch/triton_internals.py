"""Every non-public Triton API compile_rng uses, in one place.

Only the ahead-of-time compile check (:mod:`compile_rng.debug.gpu_aot`) needs them: compiling
the kernels for a named NVIDIA GPU on a machine with no GPU and no driver, which Triton
supports (``triton.compile(ASTSource(...), target=GPUTarget(...))``) but documents only
for its own tests and tools. Each item says why; all were checked on triton 3.8.0 (beside
torch 2.13.0) and 3.9.0 (beside torch 2.15.0). The kernels themselves
(:mod:`compile_rng.stream.triton_kernels`) use only ``triton.jit`` and ``triton.language``.

Importing this module imports triton.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import triton

# ``triton.compile`` and ``ASTSource`` are the compiler entry points of triton.compiler;
# ``GPUTarget`` names a GPU without asking a driver (3.8, 3.9: triton.backends.compiler).
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as _nvidia
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

def target(arch: int) -> GPUTarget:
    """An NVIDIA GPU of compute capability ``arch`` (80 = A100, 90 = H100, 100 = B200)."""
    return GPUTarget("cuda", arch, 32)


def backend(arch: int) -> Any:
    """Triton's compiler backend for GPU ``arch``, made without a driver (what a launch's
    binder and Inductor's kernel cache key ask the active driver for)."""
    return make_backend(target(arch))


def jit_function(kernel: Any) -> JITFunction:
    """``kernel`` as a :class:`JITFunction`. Under ``TRITON_INTERPRET=1`` ``@triton.jit``
    returns an ``InterpretedFunction``, which has no argument binder; rebuilt from its
    Python function and jit options (``.fn``, ``.kwargs`` in 3.8 and 3.9) it binds
    arguments exactly as the launcher would. Such a rebuilt kernel cannot be compiled
    (the functions it calls are still interpreted): compile in a process without the
    interpreter."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


@dataclass(frozen=True)
class Bound:
    """What Triton's launcher derives from a launch's arguments: the compiled variant's
    signature (argument types), constexprs and attributes, and the compile options."""

    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]

    def variant_key(self) -> tuple:
        """What tells one compiled variant from another (the launcher's cache key, less
        the options, which compile_rng passes alike to every launch)."""
        return (
            tuple(self.signature.items()),
            tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
            tuple(sorted((k, repr(v)) for k, v in self.attrs.items())),
        )


def bind(kernel: Any, arch: int, args: tuple, kwargs: Mapping[str, Any]) -> Bound:
    """Bind a launch's arguments as ``kernel[grid](*args, **kwargs)`` would on GPU ``arch``.

    ``create_function_from_signature`` builds the launcher's binder (it types each
    argument, e.g. an int by its value unless annotated) and ``JITFunction._pack_args``
    turns its result into ``triton.compile``'s inputs: both are what ``JITFunction.run``
    calls (3.8, 3.9), so the variant found here is the one a launch would compile. Needs
    no device: the backend is made for a named target."""
    fn = jit_function(kernel)
    made = backend(arch)
    binder = create_function_from_signature(fn.signature, fn.params, made)
    kwargs = dict(kwargs)
    bound_args, specialization, options = binder(*args, **kwargs)
    opts, signature, constexprs, attrs = fn._pack_args(made, kwargs, bound_args, specialization, options)
    return Bound(dict(signature), dict(constexprs), dict(attrs), dict(opts.__dict__))


def compiled_kernel(kernel: Any, bound: Bound, arch: int) -> Any:
    """Triton's ``CompiledKernel`` of ``kernel``'s variant ``bound`` for GPU ``arch`` (not
    loaded: no device needed). Uses Triton's on-disk cache (``TRITON_CACHE_DIR``) like a
    launch would."""
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("compile_rng: the AOT compile needs the kernels imported without TRITON_INTERPRET=1")
    src = ASTSource(kernel, bound.signature, bound.constexprs, bound.attrs)
    return triton.compile(src, target=target(arch), options=bound.options)


def compile_for(kernel: Any, bound: Bound, arch: int) -> dict[str, Any]:
    """Compile ``kernel``'s variant ``bound`` for GPU ``arch``; returns the stages'
    outputs by name (``ttir``, ``ttgir``, ``llir``, ``ptx``, ``cubin``)."""
    return dict(compiled_kernel(kernel, bound, arch).asm)


def ptxas(arch: int) -> str:
    """The ptxas Triton itself runs for ``arch`` (its wheel ships one for Hopper and
    older and a newer one for Blackwell; ``get_ptxas`` picks, 3.8 and 3.9)."""
    return _nvidia.get_ptxas(arch).path


def ptxas_flags(arch: int, options: Mapping[str, Any]) -> list[str]:
    """The flags Triton's ``make_cubin`` gives ptxas that change code generation
    (``--fmad=false`` without fp fusion; ``--regAllocOptLevel=2``, its workaround for a
    ptxas 13 bug; ``--gpu-name`` with the ``a`` suffix from sm_90 on), as in 3.8 and 3.9,
    so that a separate ``ptxas -v`` run reports the registers of the cubin Triton built."""
    fmad = [] if options.get("enable_fp_fusion", True) else ["--fmad=false"]
    return [*fmad, "--regAllocOptLevel=2", f"--gpu-name={gpu_name(arch)}"]


def cuobjdump() -> str:
    """The cuobjdump in Triton's wheel (reads a cubin's resource usage and SASS)."""
    return triton.knobs.nvidia.cuobjdump.path


def gpu_name(arch: int) -> str:
    """ptxas's name of GPU ``arch`` as Triton passes it (``sm_80``, ``sm_90a``, ``sm_100a``)."""
    return _nvidia.sm_arch_from_capability(arch)


@functools.cache
def supports(arch: int) -> bool:
    """Whether this triton can compile for ``arch``: the ptxas it would run lists the GPU
    among its allowed ``--gpu-name`` values."""
    try:
        tool = ptxas(arch)
        help_text = subprocess.run([tool, "--help"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError, RuntimeError, AttributeError):
        return False
    return f"'{gpu_name(arch)}'" in help_text
