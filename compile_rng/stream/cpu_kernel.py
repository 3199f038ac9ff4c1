"""Builds and calls the eager CPU Philox kernel (``csrc/philox.c``).

The kernel is plain C (no torch headers), so it compiles in well under a second with
the C compiler Inductor already needs. The same source is built once per instruction
set (:data:`ISA_FLAGS`); :func:`isa` says which build runs, chosen from what the CPU
reports or forced with ``COMPILE_RNG_CPU_ISA``. Every build gives the same bits
(canonical stream v1). Shared objects are cached under ``$COMPILE_RNG_CACHE`` (default
``~/.cache/compile_rng``) by a hash of the source, compiler and flags; concurrent ranks
race safely because each writes a private file and renames it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import torch

#: The kernel source every build compiles.
SOURCE = Path(__file__).with_name("csrc") / "philox.c"
_MACHINE = platform.machine().lower()
_X86 = _MACHINE in ("x86_64", "amd64")
#: Flags of every build. No float contraction, so the float transforms round exactly
#: like torch's and Inductor's separate mul/add, whatever the instruction set.
#: -fno-trapping-math changes no value (the kernel never reads floating-point exception
#: flags); it lets the vectorizer turn conditional float operations into selects where
#: the instruction set has no masked operations (AVX2, SSE2, NEON: without it dropout and
#: normal stayed scalar, 3-5x slower). -fschedule-insns -fsched-pressure turn on GCC's
#: register-pressure-aware scheduling before register allocation (off by default on
#: x86): it interleaves the kernel's independent chains (Box-Muller's Horner steps are
#: latency-bound), normal 10-15% faster on every x86 build; scheduling changes no value.
COMMON_FLAGS = [
    "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fschedule-insns", "-fsched-pressure",
    "-fPIC", "-shared", "-pthread", "-std=gnu11",
]
#: Compiler flags of each build. Explicit feature flags, not -march=native: a build is
#: then the same on every machine that can run it, and one machine can build and test
#: every level it supports.
ISA_FLAGS = {
    "avx512": ["-march=x86-64", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx2": ["-march=x86-64", "-mavx2"],
    "neon": ["-march=armv8-a"],
    # x86-64's own baseline (SSE2), whatever the compiler's default; elsewhere plain C
    "baseline": ["-march=x86-64"] if _X86 else [],
}
#: Threads come from OpenMP: the process's one libgomp, which torch and Inductor's kernels
#: use too (see parallel_for in csrc/philox.c). A compiler without OpenMP (Apple's clang)
#: gets the pthread fallback build instead.
OPENMP_FLAGS = ["-fopenmp"]
ISA_ENV = "COMPILE_RNG_CPU_ISA"
# /proc/cpuinfo flags each x86 build needs.
_X86_REQUIRES = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2"}}


@functools.cache
def _cpu_flags() -> set[str]:
    """The x86 feature flags the OS reports (lower case), empty if it cannot say."""
    try:
        with open("/proc/cpuinfo") as f:  # Linux
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:  # macOS
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"], capture_output=True, text=True
        ).stdout
        return set(out.lower().split())
    except OSError:
        return set()


def supported_isas() -> list[str]:
    """The builds this CPU can run, fastest first (the first is the default)."""
    if _MACHINE in ("aarch64", "arm64"):
        return ["neon"]  # Advanced SIMD is part of every AArch64 CPU: NEON is its baseline
    if _X86:
        flags = _cpu_flags()
        return [name for name, needs in _X86_REQUIRES.items() if needs <= flags] + ["baseline"]
    return ["baseline"]


@functools.cache
def _chosen(forced: str | None) -> str:
    supported = supported_isas()
    if not forced:
        return supported[0]
    if forced not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISA_FLAGS)}")
    if forced not in supported:
        raise RuntimeError(
            f"{ISA_ENV}={forced!r}, but this CPU ({platform.machine()}) only runs {', '.join(supported)}"
        )
    return forced


def isa() -> str:
    """The instruction-set build of the CPU kernel in use: ``avx512``, ``avx2``, ``neon``
    or ``baseline``. The best one this CPU runs, unless ``COMPILE_RNG_CPU_ISA`` names
    another (an error if the CPU cannot run it)."""
    return _chosen(os.environ.get(ISA_ENV) or None)


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    raise RuntimeError(
        "compile_rng needs a C compiler for its eager CPU kernel (the same one "
        "torch.compile's Inductor uses); install gcc or set CC."
    )


def _build(name: str) -> Path:
    """The shared object of build ``name`` (compiled on first use, then cached): with
    OpenMP where the compiler has it, else the pthread fallback."""
    source = SOURCE.read_bytes()
    cc = _compiler()
    cache = Path(os.environ.get("COMPILE_RNG_CACHE", Path.home() / ".cache" / "compile_rng"))
    cache.mkdir(parents=True, exist_ok=True)
    targets = []
    for threads in (OPENMP_FLAGS, []):
        flags = [*COMMON_FLAGS, *ISA_FLAGS[name], *threads]
        digest = hashlib.sha256(source + " ".join([cc, *flags]).encode()).hexdigest()[:16]
        targets.append((cache / f"philox-{name}-{digest}.so", flags))
    for target, _ in targets:
        if target.exists():  # the fallback exists only where OpenMP failed
            return target
    for target, flags in targets:
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
        os.close(fd)
        result = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
    others = [other for other in supported_isas() if other != name]
    raise RuntimeError(
        f"compiling {SOURCE} for {name} with {cc} failed"
        + (f" (set {ISA_ENV} to {' or '.join(others)} to use another build)" if others else "")
        + f":\n{result.stderr}"
    )


def _library() -> ctypes.CDLL:
    return _load(isa())


@functools.cache
def _load(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build(name)))
    lib.cr_isa.restype = ctypes.c_char_p
    built = lib.cr_isa().decode()
    if built != name:  # the flags did not select the intended code path
        raise RuntimeError(f"compile_rng's CPU kernel built for {name} reports {built}")
    fn = lib.cr_philox_words
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64,
        ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
        ctypes.c_uint32, ctypes.c_int, ctypes.c_int,
    ]
    fast = lib.cr_fast_f32
    fast.restype = ctypes.c_int
    fast.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
        ctypes.c_uint64, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_uint64, ctypes.c_float,
        ctypes.c_int,
    ]
    normal = lib.cr_normal_f32
    normal.restype = ctypes.c_int
    normal.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_float, ctypes.c_float, ctypes.c_int,
    ]
    integers = lib.cr_integers
    integers.restype = ctypes.c_int
    integers.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
        ctypes.c_uint64, ctypes.c_int,
    ]
    normal_at = lib.cr_normal_f32_at
    normal_at.restype = ctypes.c_int
    normal_at.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p,
        ctypes.c_float, ctypes.c_float, ctypes.c_int,
    ]
    return lib


def normal_f32(
    seed: int, base: int, size: list[int], strides: list[int], mean: float, std: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 normals at counters ``base + sum(idx * strides)``: the one implementation
    of float32 Box-Muller (eager and compiled both call it). Written into ``out`` (a
    contiguous float32 tensor of ``size``) if given."""
    out = torch.empty(list(size), dtype=torch.float32) if out is None else out
    if out.numel():
        ndim = len(size)
        arr = ctypes.c_int64 * max(ndim, 1)
        rc = _library().cr_normal_f32(
            out.data_ptr(), out.numel(), seed % 2**64, base % 2**64, ndim, arr(*size), arr(*strides),
            mean, std, torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"compile_rng CPU kernel failed (code {rc}, ndim={ndim})")
    return out


def normal_f32_at(seed: int, base: int, counters: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """float32 normals at counters ``base + counters`` (int64, taken mod 2**64): the
    values :func:`normal_f32` gives those counters, for a few scattered elements."""
    counters = counters.to(torch.int64).contiguous().view(-1)
    out = torch.empty(counters.numel(), dtype=torch.float32)
    if out.numel():
        rc = _library().cr_normal_f32_at(
            out.data_ptr(), out.numel(), seed % 2**64, base % 2**64, counters.data_ptr(), mean, std,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"compile_rng CPU kernel failed (code {rc})")
    return out


FAST_UNIFORM, FAST_BERNOULLI, FAST_DROPOUT = 0, 1, 2


def to_float32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, overflowing to infinity), as torch rounds it;
    struct, not a tensor: this runs on every call of a small op (a tensor costs ~3 us)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def fast_uniform_ok(high: float) -> bool:
    """The fast kernel compares with ``high`` in float32, exact only if it is a float32."""
    return to_float32(high) == high


def fast_f32(
    op: int,
    numel: int,
    seed: int,
    base: int,
    *,
    low: float = 0.0,
    high: float = 1.0,
    threshold: int = 0,
    scale: float = 0.0,
    x: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 values of a contiguous stream (counter ``base + i``), computed directly.

    ``op``: :data:`FAST_UNIFORM` (``[low, high)``), :data:`FAST_BERNOULLI` (``W <
    threshold``), :data:`FAST_DROPOUT` (of the contiguous float32 ``x``; also returns the
    keep mask). Bitwise equal to the generic path; returns a flat tensor, or ``out`` (a
    contiguous float32 tensor of ``numel`` elements) filled, and dropout's mask likewise
    (``mask``: a contiguous bool tensor of ``numel`` elements). Uniform needs ``high``
    exactly representable in float32 (see :func:`fast_uniform_ok`).
    """
    out = torch.empty(numel, dtype=torch.float32) if out is None else out
    if op == FAST_DROPOUT and mask is None:
        mask = torch.empty(numel, dtype=torch.bool)
    if numel:
        rc = _library().cr_fast_f32(
            op, out.data_ptr(), mask.data_ptr() if mask is not None else None,
            x.data_ptr() if x is not None else None, numel, seed % 2**64, base % 2**64,
            low, to_float32(high - low), high, threshold, scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"compile_rng CPU kernel failed (code {rc})")
    return out, mask


#: the widest range :func:`integers` draws (a larger one takes a second word per value)
INTEGERS_MAX_SPAN = 2**32


def integers(seed: int, base: int, low: int, high: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (a contiguous integer CPU tensor whose dtype holds every value of ``[low,
    high)``) filled with the contiguous stream's integers (counter ``base + i``): ``low + W
    mod (high - low)``, ``0 < high - low <=`` :data:`INTEGERS_MAX_SPAN` (the contract's
    one-word case)."""
    if out.numel():
        rc = _library().cr_integers(out.data_ptr(), out.element_size(), out.numel(), seed % 2**64, base % 2**64,
                                    low % 2**64, high - low, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"compile_rng CPU kernel failed (code {rc}, span {high - low})")
    return out


def kernel_addresses() -> dict[str, int]:
    """The addresses of the C functions C++ callers take (:func:`fast_f32`'s, :func:`normal_f32`'s,
    and the word kernels': :func:`integers`' ``cr_integers``, ``cr_bernoulli_bits``,
    ``cr_unit_uniform_bits``, ``cr_open_unit_bits``, see ``csrc/philox.c``) in this process's
    build, by name."""
    lib = _library()
    names = ("cr_fast_f32", "cr_normal_f32", "cr_integers", "cr_bernoulli_bits", "cr_unit_uniform_bits",
             "cr_open_unit_bits")
    return {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names}


def philox_words(
    seed: int,
    base: int,
    size: list[int],
    strides: list[int],
    *,
    c2: int = 0,
    pair: bool = False,
    lanes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stream words for every element of a ``size``-shaped output (int64 in [0, 2**32)).

    Element ``idx`` has counter ``base + sum(idx[d] * strides[d]) mod 2**64``. Returns
    ``words`` shaped ``size`` (or ``size + [2]`` with ``pair=True``: the Box-Muller pair
    ``(W[2p], W[2p+1])`` of the element's lane) and, if requested, the lanes ``n & 3``.
    ``c2`` selects the third counter word (0 for the canonical stream, 1 for the
    high halves of 64-bit integers).
    """
    numel = math.prod(size)
    words = torch.empty([*size, 2] if pair else list(size), dtype=torch.int64)
    lane_out = torch.empty(list(size), dtype=torch.int64) if lanes else None
    if numel:
        ndim = len(size)
        arr = ctypes.c_int64 * max(ndim, 1)
        rc = _library().cr_philox_words(
            words.data_ptr(),
            lane_out.data_ptr() if lane_out is not None else None,
            numel,
            seed % 2**64,
            base % 2**64,
            ndim,
            arr(*size),
            arr(*strides),
            c2,
            int(pair),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"compile_rng CPU kernel failed (code {rc}, ndim={ndim})")
    return words, lane_out
