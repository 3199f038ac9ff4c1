"""compile_rng's random-op kernels in C++ (``csrc/random_op_kernels.cpp``), built at first use.

On torch 2.13+ each random op has a kernel in C++ at a dispatch key (torch's ``Fake``) that
only a stream's thread state includes (``include``, switched with the stream's handler by
:mod:`compile_rng.eager.random_kernels`), with a fallthrough there for every other op:
outside every stream no dispatch reaches compile_rng, and every random op runs torch's
kernels as stock torch. Inside a stream the kernel calls compile_rng's Python kernel
(:mod:`compile_rng.eager.random_kernels`), over torch's kernels below the key, redispatched
at each call. On torch 2.11 and 2.12, whose ``Fake`` key sits above the Python key (a
dispatch mode's inner ops exclude it), the kernels sit at each backend key instead, over
torch's kernel there: outside a stream they call it at once, with no Python frame and the
GIL left released. The module is compiled with the system's C++ compiler (``$CXX``, else
``g++``/``c++``/``clang++``) against the installed torch's headers and libraries, once per
torch build and source, and cached beside the C kernels (``$COMPILE_RNG_CACHE``, default
``~/.cache/compile_rng``; ``make setup`` builds it ahead). Where it cannot be built,
:func:`load` returns None after one warning, and Python kernels sit at the backend keys.

Inside the eager stream the common fills - ``bernoulli_(p)``, ``uniform_``, ``normal_`` on a
plain dense float32 CPU tensor, ``bernoulli_(p)``, rand's ``uniform_(0, 1)`` and (in half
precision) ``normal_`` in the other float dtypes, ``exponential_``, ``random_(low, high)`` on
a dense integer one - take a lane
in C++ in front of the Python kernel: their counters from one Python call
(:func:`compile_rng.eager.short_draws.lane_counter`, the short path's own), then
compile_rng's CPU kernel into the tensor with the GIL released; ``rand``, ``randn``,
``randint`` and their ``*_like`` run torch's kernel, whose fill takes the lane
(:data:`~compile_rng.eager.short_draws.LANE_FACTORIES`). What the lane does not serve takes
the Python kernel, nothing reserved first. The installer hands the lane what it calls
(``set_lane``).

The C++ source uses five private torch C++ APIs, named in its header with the releases
checked (``at::impl::ThreadLocalPythonObjects``,
``OperatorHandle::getComputedKernelForDispatchKey``, ``TorchDispatchModeTLS::stack_len``,
``PyObjectSlot::load_pyobj``, the ``Fake`` dispatch key); the ABI to build with is read through
:func:`compile_rng._torch.core_internals.cxx11_abi`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from compile_rng._torch.core_internals import cxx11_abi

SOURCE = Path(__file__).with_name("csrc") / "random_op_kernels.cpp"
_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _command(cxx: str, name: str, output: str) -> list[str]:
    # torch's headers and libraries where its wheel puts them (what
    # torch.utils.cpp_extension's include_paths/library_paths give for a CPU extension,
    # without its CUDA probing, which warns on a CUDA build of torch with no CUDA runtime)
    root = Path(torch.__file__).resolve().parent
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include",
                sysconfig.get_paths()["include"]]
    libraries = [root / "lib"]
    return [
        cxx, "-O2", "-shared", "-fPIC", "-std=c++20", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi())}", f"-DCOMPILE_RNG_MODULE={name}",
        *(f"-I{path}" for path in includes), str(SOURCE), "-o", output,
        *(f"-L{path}" for path in libraries), *(f"-l{lib}" for lib in _LIBRARIES),
        *(f"-Wl,-rpath,{path}" for path in libraries),
    ]


def _cache() -> Path:
    cache = Path(os.environ.get("COMPILE_RNG_CACHE", Path.home() / ".cache" / "compile_rng"))
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One build at a time on this machine (test workers and ranks start together)."""
    with open(cache / "random_op_kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build() -> tuple[str, Path]:
    """``(module name, shared object)`` of the kernels for this torch, compiled if not
    cached. Raises RuntimeError (with the compiler's output) where it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    identity = b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), torch.__file__.encode(),
                           cxx.encode(), sys.version.encode()])
    name = f"compile_rng_random_op_kernels_{hashlib.sha256(identity).hexdigest()[:16]}"
    cache = _cache()
    target = cache / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return name, target
    with _locked(cache):
        if target.exists():  # another process built it while this one waited
            return name, target
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
        os.close(fd)
        result = subprocess.run(_command(cxx, name, tmp), capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {SOURCE} with {cxx} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, target)
    return name, target


@functools.cache
def load() -> ModuleType | None:
    """The built module (``serve``, ``set_lane``, ``include``, ``clear_lane``, ``clear``, ``LIVE_KEY``), or
    None - with one warning saying what that costs - where it cannot be built or loaded."""
    try:
        name, path = build()
        spec = importlib.util.spec_from_loader(name, importlib.machinery.ExtensionFileLoader(name, str(path)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, RuntimeError) as error:
        warnings.warn(
            f"compile_rng could not build its C++ random-op kernels ({str(error).splitlines()[0]}); it uses "
            "Python kernels instead: once a stream has run in this process, every random op enters Python "
            "(~1-2 us more per op) and holds the GIL for its whole run. Install a C++ compiler (g++) to avoid it",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
