"""Issue 64 item 2, the data for its contract decision: what Box-Muller costs on sm_90 with
libdevice's ``log``/``cos``/``sin`` (today's eager kernel), with polynomials that keep
stream v1's formula, and with an angle read from the word's bits (a stream v2), and how
far each lands from the exact math. Nothing here runs on a GPU or changes the stream.

    python benchmarks/normal_transform_study.py [--pairs N]
    python benchmarks/normal_transform_study.py --run cuda          (on a GPU: make gpu-check)
    python benchmarks/normal_transform_study.py --run interpreter   (Triton's interpreter, CPU)

Each variant is one Triton kernel shaped like the eager kernel's block path (a program
writes 512 Philox blocks, four normals each, ``z * std + mean`` stored unmasked), compiled
for sm_90 and walked as ``aot_gpu.py --per-element`` walks it (instructions one thread
executes, per element). Accuracy comes from a numpy model of the same float32 operations
(a fused multiply-add as float64's exact product and one rounding, then float32's), on
``--pairs`` word pairs, in ulps of float32 against float64 math:

* ``libdevice`` (today): ``sqrt(-2 log u1) * cos(angle)``, ``angle = f32(w) * 2**-32 * f32(2 pi)``
  rounded twice; its accuracy is the eager kernel's (the test suite's bound, 4 ulp), not
  modelled here;
* ``v1 polynomials``: the same formula, the same rounded angle (stream v1 unchanged), by
  a log and one shared Cody-Waite reduction with minimax sin and cos, fitted here;
* ``v2 bits angle``: ``cos(2 pi w / 2**32)`` with the quadrant taken from the word's top
  bits and the rest as a signed fraction (no reduction error), the same log: a new
  formula, so a stream version.

``--run`` launches the kernels instead: on a GPU, each modelled variant's values against its
model bit for bit (the question only a GPU answers: do its FMAs round once, as the model's,
so that a CPU kernel could give the same bits?) and each variant's time against torch's
``normal_`` in the same run; in Triton's interpreter, whose ``fma`` rounds twice, against the
model rounding twice (which checks the kernels' operations and the words' layout on CPU).

The polynomials are fitted at start-up (least squares on Chebyshev nodes, coefficients
rounded to float32) to the smallest degree whose float64 error is under a quarter of a
float32 ulp.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# this process compiles for sm_90, or launches on a GPU, unless asked for the interpreter
INTERPRETER = "interpreter" in sys.argv[sys.argv.index("--run") + 1:][:1] if "--run" in sys.argv else False
os.environ["TRITON_INTERPRET"] = "1" if INTERPRETER else "0"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# --- the polynomials ----------------------------------------------------------------------

F32_ULP = 2.0**-24  # relative, at the top of a binade


def _fit(target, lo: float, hi: float, weight, variable, max_degree: int = 12) -> list[float]:
    """Float32 coefficients (constant first) of the lowest-degree polynomial ``P`` in
    ``variable(x)`` with ``|weight(x) * (P - target(x))| < F32_ULP / 4`` on ``[lo, hi]``."""
    x = (lo + hi) / 2 + (hi - lo) / 2 * np.cos(np.pi * (np.arange(4000) + 0.5) / 4000)
    t, v, w = target(x), variable(x), weight(x)
    for degree in range(1, max_degree + 1):
        basis = np.stack([v**k for k in range(degree + 1)], axis=1)
        coefs, *_ = np.linalg.lstsq(basis * w[:, None], t * w, rcond=None)
        coefs = coefs.astype(np.float32).astype(np.float64)
        if np.max(np.abs(w * (basis @ coefs - t))) < F32_ULP / 4:
            return [float(c) for c in coefs]
    raise ValueError("no fit")


SQRT_HALF = math.sqrt(0.5)
# ln(1 + f) = f + f**2 * Q(f) on the reduced mantissa's f = m - 1, m in [sqrt(1/2), sqrt(2))
LOG_Q = _fit(lambda f: (np.log1p(f) - f) / f**2, SQRT_HALF - 1, math.sqrt(2) - 1,
             lambda f: f**2 / np.abs(np.log1p(f)), lambda f: f)
# sin(x) = x + x**3 * S(x**2), cos(x) = 1 - x**2 / 2 + x**4 * C(x**2), |x| <= pi / 4
SIN_S = _fit(lambda x: (np.sin(x) - x) / x**3, 1e-4, math.pi / 4, lambda x: x**3 / np.sin(x), lambda x: x * x)
COS_C = _fit(lambda x: (np.cos(x) - 1 + x * x / 2) / x**4, 1e-4, math.pi / 4, lambda x: x**4 / np.cos(x),
             lambda x: x * x)

LN2_HI = float(np.float32(round(math.log(2) * 2**16) / 2**16))  # 16 bits: e * LN2_HI is exact
LN2_LO = float(np.float32(math.log(2) - LN2_HI))
PIO2_HI = float(np.float32(math.pi / 2))
PIO2_LO = float(np.float32(math.pi / 2 - PIO2_HI))
TWO_PI_32 = float(np.float32(2 * math.pi))
ANGLE_UNIT = float(np.float32(2 * math.pi / 2**32))  # v2: radians per unit of the word
ROUNDER = 1.5 * 2**23  # adding and subtracting it rounds a float32 below 2**22 to an integer

# --- the numpy model ------------------------------------------------------------------------

f32 = np.float32


def _fma(a, b, c):
    if INTERPRETER:  # Triton's interpreter: numpy's float32 multiply, then add
        return a.astype(f32) * b.astype(f32) + c.astype(f32)
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f32)


def _horner(coefs: list[float], x):
    acc = np.full_like(x, f32(coefs[-1]))
    for c in reversed(coefs[:-1]):
        acc = _fma(acc, x, np.full_like(x, f32(c)))
    return acc


def model_log(u):
    """ln(u) for a float32 ``u`` in (0, 1]: exponent and reduced mantissa from the bits."""
    bits = u.view(np.int32)
    e = (bits - np.int32(0x3F3504F3)) >> 23
    f = (bits - (e << 23)).view(f32) - f32(1)
    y = _fma(f * f, _horner(LOG_Q, f), f)
    ef = e.astype(f32)
    return _fma(ef, np.full_like(ef, f32(LN2_HI)), _fma(ef, np.full_like(ef, f32(LN2_LO)), y))


def model_sincos(x, q):
    """cos and sin of ``x + q * pi / 2`` for ``|x| <= pi / 4`` and a quadrant ``q``."""
    x2 = x * x
    s = _fma(x2 * x, _horner(SIN_S, x2), x)
    c = _fma(x2, _fma(x2, _horner(COS_C, x2), np.full_like(x, f32(-0.5))), np.full_like(x, f32(1)))
    return _rotated(c, s, q)


def _rotated(c, s, q):
    """``(cos, sin)`` of ``x + q * pi / 2`` from those of ``x``."""
    swap = (q & 1) == 1
    cos_out, sin_out = np.where(swap, s, c), np.where(swap, c, s)
    return np.where(((q + 1) & 2) == 2, -cos_out, cos_out), np.where((q & 2) == 2, -sin_out, sin_out)


def model_radius(w_even):
    u1 = (w_even.astype(np.int64) + 1).astype(f32) * f32(2.0**-32)
    return np.sqrt(model_log(u1) * f32(-2))


def model_v1(w_even, w_odd):
    angle = w_odd.astype(f32) * f32(2.0**-32) * f32(TWO_PI_32)
    j = (angle * f32(2 / math.pi) + f32(ROUNDER)) - f32(ROUNDER)  # to nearest, ties to even
    r = _fma(j, np.full_like(j, f32(-PIO2_HI)), angle)
    r = _fma(j, np.full_like(j, f32(-PIO2_LO)), r)
    c, s = model_sincos(r, j.astype(np.int32) & 3)
    radius = model_radius(w_even)
    return radius * c, radius * s


def model_v2(w_even, w_odd):
    q, rest = _quadrant_split(w_odd)
    c, s = model_sincos(rest.astype(f32) * f32(ANGLE_UNIT), q)
    radius = model_radius(w_even)
    return radius * c, radius * s


def ulps(got, exact) -> float:
    """Max error in float32 ulps of the exact value (subnormal-free: |z| > 2**-126)."""
    scale = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 2.0**-126))) - 23)
    return float(np.max(np.abs(got.astype(np.float64) - exact) / scale))


def _quadrant_split(w):
    """``(q, rest)``: ``2 pi w / 2**32 = q * pi / 2 + rest * 2 pi / 2**32``, ``|rest| <= 2**29``."""
    shifted = (w.astype(np.uint32) + np.uint32(1 << 29)).astype(np.uint32)
    return (shifted >> 30).astype(np.int32), (shifted & np.uint32((1 << 30) - 1)).astype(np.int32) - np.int32(1 << 29)


def accuracy(pairs: int) -> dict[str, float]:
    """Max ulps of each model against float64 math of its own formula: v1's rounded angle,
    v2's exact ``2 pi w / 2**32`` (reduced exactly, so its zeros are exact)."""
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2**32, size=(2, pairs), dtype=np.uint64).astype(np.uint32)
    # the extremes: the smallest and largest u1, the quadrant boundaries and their neighbours
    edges = np.array([0, 1, 2**32 - 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 3 * 2**30, 2**29, 2**29 - 1], np.uint32)
    w = np.concatenate([w, np.stack([edges, edges[::-1]])], axis=1)
    u1 = ((w[0].astype(np.int64) + 1).astype(f32) * f32(2.0**-32)).astype(np.float64)
    radius = np.sqrt(-2 * np.log(u1))
    angle = (w[1].astype(f32) * f32(2.0**-32) * f32(TWO_PI_32)).astype(np.float64)
    q, rest = _quadrant_split(w[1])
    x = rest.astype(np.float64) * (2 * np.pi / 2**32)
    c, s = _rotated(np.cos(x), np.sin(x), q)
    exact = {"v1 polynomials": (np.cos(angle), np.sin(angle)), "v2 bits angle": (c, s)}
    out = {}
    for name, model in (("v1 polynomials", model_v1), ("v2 bits angle", model_v2)):
        got_c, got_s = model(w[0], w[1])
        want_c, want_s = exact[name]
        out[name] = max(ulps(got_c, radius * want_c), ulps(got_s, radius * want_s))
    return out


# --- the kernels ----------------------------------------------------------------------------

from compile_rng.stream.triton_kernels import _box_muller, _in_order, _words  # noqa: E402

_LOG_Q = tl.constexpr(tuple(LOG_Q))
_SIN_S = tl.constexpr(tuple(SIN_S))
_COS_C = tl.constexpr(tuple(COS_C))
_LOG_Q_DEGREE, _SIN_S_DEGREE, _COS_C_DEGREE = (tl.constexpr(len(c) - 1) for c in (LOG_Q, SIN_S, COS_C))
_LN2_HI, _LN2_LO = tl.constexpr(LN2_HI), tl.constexpr(LN2_LO)
_PIO2_HI, _PIO2_LO = tl.constexpr(PIO2_HI), tl.constexpr(PIO2_LO)
_TWO_PI_32, _ANGLE_UNIT, _ROUNDER = tl.constexpr(TWO_PI_32), tl.constexpr(ANGLE_UNIT), tl.constexpr(ROUNDER)
_TWO_OVER_PI = tl.constexpr(float(np.float32(2 / math.pi)))


@triton.jit
def _horner_tl(x, COEFS: tl.constexpr, DEGREE: tl.constexpr):
    acc = tl.full(x.shape, COEFS[DEGREE], tl.float32)  # (len() of a constexpr fails in the interpreter)
    for k in tl.static_range(DEGREE - 1, -1, -1):
        acc = tl.fma(acc, x, COEFS[k])
    return acc


@triton.jit
def _log_tl(u):
    bits = u.to(tl.int32, bitcast=True)
    e = (bits - 0x3F3504F3) >> 23
    f = (bits - (e << 23)).to(tl.float32, bitcast=True) - 1.0
    y = tl.fma(f * f, _horner_tl(f, _LOG_Q, _LOG_Q_DEGREE), f)
    ef = e.to(tl.float32)
    return tl.fma(ef, _LN2_HI, tl.fma(ef, _LN2_LO, y))


@triton.jit
def _sincos_tl(x, q):
    x2 = x * x
    s = tl.fma(x2 * x, _horner_tl(x2, _SIN_S, _SIN_S_DEGREE), x)
    c = tl.fma(x2, tl.fma(x2, _horner_tl(x2, _COS_C, _COS_C_DEGREE), -0.5), 1.0)
    swap = (q & 1) == 1
    cos_out = tl.where(swap, s, c)
    sin_out = tl.where(swap, c, s)
    cos_out = tl.where(((q + 1) & 2) == 2, -cos_out, cos_out)
    sin_out = tl.where((q & 2) == 2, -sin_out, sin_out)
    return cos_out, sin_out


@triton.jit
def _radius_tl(w_even):
    u1 = (w_even.to(tl.int64) + 1).to(tl.float32) * 2.3283064365386963e-10
    return tl.sqrt_rn(_log_tl(u1) * -2.0)


@triton.jit
def _angle_v1(w_odd):
    angle = w_odd.to(tl.float32) * 2.3283064365386963e-10 * _TWO_PI_32
    j = (angle * _TWO_OVER_PI + _ROUNDER) - _ROUNDER
    r = tl.fma(j, -_PIO2_HI, angle)
    return _sincos_tl(tl.fma(j, -_PIO2_LO, r), j.to(tl.int32) & 3)


@triton.jit
def _angle_v2(w_odd):
    shifted = w_odd + (1 << 29)
    rest = (shifted & ((1 << 30) - 1)).to(tl.int32) - (1 << 29)
    return _sincos_tl(rest.to(tl.float32) * _ANGLE_UNIT, (shifted >> 30).to(tl.int32))


@triton.jit
def _normals(w_even, w_odd, VARIANT: tl.constexpr):
    if VARIANT == 3:  # no transform: the Philox words and the store alone
        z_cos, z_sin = w_even.to(tl.float32) * 2.3283064365386963e-10, w_odd.to(tl.float32) * 2.3283064365386963e-10
    elif VARIANT == 0:
        z_cos, z_sin = _box_muller(w_even, w_odd, tl.float32)
    else:
        if VARIANT == 1:
            c, s = _angle_v1(w_odd)
        else:
            c, s = _angle_v2(w_odd)
        radius = _radius_tl(w_even)
        z_cos, z_sin = radius * c, radius * s
    return z_cos, z_sin


@triton.jit
def _study_kernel(out_ptr, seed: tl.int64, mean: tl.float32, std: tl.float32,
                  VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    lo = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
    w0, w1, w2, w3 = _words(lo, tl.zeros_like(lo), k0, k1, 0)
    z0, z1 = _normals(w0, w1, VARIANT)
    z2, z3 = _normals(w2, w3, VARIANT)
    at = tl.multiple_of(tl.program_id(0).to(tl.int64) * 4 * BLOCK, 4)
    tl.store(out_ptr + at + tl.arange(0, 4 * BLOCK), _in_order(z0, z1, z2, z3) * std + mean)


VARIANTS = ("libdevice (today)", "v1 polynomials", "v2 bits angle", "no transform (words as uniforms)")


def instructions(variant: int) -> tuple[float, int]:
    """sm_90 instructions per element on the kernel's path, and registers per thread."""
    import torch

    from aot_gpu import _sass_with_addresses, executed_per_thread
    from compile_rng._torch import triton_internals
    from compile_rng.debug import gpu_aot
    from compile_rng.stream import triton_kernels as tk

    block = tk._BLOCKS
    options = {"VARIANT": variant, "BLOCK": block, **tk.OPTIONS}
    bound = triton_internals.bind(_study_kernel, 90, (torch.zeros(8), 5, 0.0, 1.0), options)
    asm = triton_internals.compile_for(_study_kernel, bound, 90)
    resources, *_ = gpu_aot.inspect(asm, 90, bound.options)
    executed = executed_per_thread(_sass_with_addresses(asm["cubin"]))
    return len(executed) / (4 * block / (tk.OPTIONS["num_warps"] * 32)), resources.registers


def modelled(variant: int, seed: int, n: int) -> np.ndarray | None:
    """What the study kernel writes for ``variant`` at elements ``0..n-1`` (mean 0, std 1) by
    the numpy model, from the CPU kernel's words of the canonical stream; None for libdevice."""
    from compile_rng.stream import cpu_kernel

    words, _ = cpu_kernel.philox_words(seed, 0, [n], [1], pair=True)
    w_even, w_odd = words[0::2].numpy().astype(np.uint32).T  # element 2p's (W[2p], W[2p+1])
    if variant == 0:
        return None
    if variant == 3:
        unit = f32(2.0**-32)
        z_cos, z_sin = w_even.astype(f32) * unit, w_odd.astype(f32) * unit
    else:
        z_cos, z_sin = (model_v1 if variant == 1 else model_v2)(w_even, w_odd)
    return np.stack([z_cos, z_sin], axis=1).reshape(n)


def launched(programs: int) -> None:
    """Launch each variant over ``programs`` programs: bitwise against its model, and (on a
    GPU) its time against torch's ``normal_`` of as many float32 elements."""
    import torch

    from compile_rng.stream import triton_kernels as tk

    device = "cpu" if INTERPRETER else "cuda"
    seed, n = 0x243F6A8885A308D3, 4 * tk._BLOCKS * programs
    where = "Triton's interpreter (fma rounded twice)" if INTERPRETER else torch.cuda.get_device_name()
    print(f"{where}; {n} elements, seed {seed:#x}")
    print("| variant | elements not bitwise its model | max ulps from the model | ms per launch | x torch normal_ |")
    print("| --- | --- | --- | --- | --- |")
    base = _time(lambda: torch.empty(n, device=device).normal_(), device)
    for variant, name in enumerate(VARIANTS):
        out = torch.empty(n, device=device)

        def launch(variant=variant, out=out):
            _study_kernel[(programs,)](out, seed, 0.0, 1.0, VARIANT=variant, BLOCK=tk._BLOCKS, **tk.OPTIONS)

        launch()
        got, want = out.cpu().numpy(), modelled(variant, seed, n)
        off = "-" if want is None else str(int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))))
        apart = "-" if want is None else f"{ulps(got, want.astype(np.float64)):.2f}"
        ms = _time(launch, device)
        timing = "- | -" if ms is None else f"{ms:.3f} | {ms / base:.2f}"
        print(f"| {name} | {off} | {apart} | {timing} |")
    if base is not None:
        print(f"torch normal_: {base:.3f} ms")


def _time(fn, device: str, reps: int = 20) -> float | None:
    """Milliseconds per call of ``fn`` back to back (CUDA events), None off a GPU."""
    if device != "cuda":
        return None
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1 << 20)
    parser.add_argument("--run", choices=("cuda", "interpreter"),
                        help="launch the kernels (bitwise against the models, timed on a GPU) instead of compiling")
    parser.add_argument("--programs", type=int, default=None,
                        help="programs per launch (2048 elements each; default 32768 on a GPU, 4 in the interpreter)")
    args = parser.parse_args()
    if args.run:
        launched(args.programs or (4 if INTERPRETER else 32768))
        return
    print(f"triton {triton.__version__}; polynomial degrees: log Q {len(LOG_Q) - 1}, "
          f"sin S {len(SIN_S) - 1} (in x**2), cos C {len(COS_C) - 1} (in x**2)")
    errors = accuracy(args.pairs)
    counts = [instructions(v) for v in range(len(VARIANTS))]
    uniform = 27.7  # aot_gpu.py --per-element: the eager uniform, float32
    print(f"\nsm_90, per element; max ulps on {args.pairs} pairs against float64 math (the numpy model); "
          f"issue 64's target: <= 1.5x the eager uniform's {uniform} = {1.5 * uniform:.1f}")
    print("| variant | formula | instructions / element | registers | max ulp of its formula |")
    print("| --- | --- | --- | --- | --- |")
    formulas = ("v1: cos(f32 angle)", "v1: cos(f32 angle)", "v2: cos(2 pi w / 2**32)", "-")
    for name, formula, (count, registers) in zip(VARIANTS, formulas, counts):
        error = f"{errors[name]:.2f}" if name in errors else ("-" if formula == "-" else "<= 4 (the test suite's bound)")
        print(f"| {name} | {formula} | {count:.1f} | {registers} | {error} |")


if __name__ == "__main__":
    main()
