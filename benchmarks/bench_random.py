"""Random-number throughput: compile_rng vs eager PyTorch vs stock Inductor vs memset.

Every figure is measured in the same run on the same machine; ratios are what to
compare (absolute times drift). Prints the CPU and, per row, the instruction set it ran
with: compile_rng's CPU kernel build (``compile_rng.stream.cpu_kernel.isa()``), ATen's CPU
capability for eager torch and Inductor's vector ISA for its generated C++.
``--isa avx2 baseline ...`` measures each named build of compile_rng's kernel in turn
(forced with ``COMPILE_RNG_CPU_ISA``), each with its own baselines; ``--baseline-isa avx2``
forces torch's side to AVX2 as well (``ATEN_CPU_CAPABILITY``, which ATen reads at start-up
and Inductor's ``pick_vec_isa`` honours), so an AVX-512 machine measures what an AVX2-only
one would run: ``--isa avx2 --baseline-isa avx2``. For each build and thread count (1 and
all cores) it times:

* compile_rng: ``torch.rand`` / ``torch.randn`` / ``F.dropout`` compiled with
  ``backend="compile_rng"`` (the whole user path: wrapper + the lowering's choice of a
  fused Philox loop or a call of the eager op), with ``--fused`` the same with the
  choice made as on AVX-512 (", fused": float32 under 256K elements and float64 fused),
  and the eager functional ops (the C kernel plus tensor transforms);
* baselines: eager ``uniform_`` / ``normal_`` / ``F.dropout``, the same three compiled
  by stock Inductor, and ``fill_`` (memset floor);
* ``F.dropout`` of a ``channels_last`` 4-D tensor (a CNN's activation): eager, stock
  Inductor and compile_rng.

``--dtype float64`` times float64 values (a float64 training run's). Prints ns/element
(the best of ``--repeat`` runs: on a shared machine the fastest run is the least
disturbed) with ratios, and the first call's seconds (a compiled case's compile, cold or
from the caches), and writes JSON. ``--size`` and ``--repeat`` shrink it for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable

#: ``--baseline-isa`` values -> ``ATEN_CPU_CAPABILITY`` ("default": ATen's scalar build).
BASELINE_ISAS = ("avx512", "avx2", "default")


def _force_torch_isa(argv: list[str]) -> None:
    """Sets ``ATEN_CPU_CAPABILITY`` from ``--baseline-isa`` before torch is imported: ATen
    picks its kernels once, at start-up."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--baseline-isa=") else (
            argv[i + 1] if arg == "--baseline-isa" and i + 1 < len(argv) else None)
        if value in BASELINE_ISAS:
            os.environ["ATEN_CPU_CAPABILITY"] = value
            # Inductor's caches do not key on ATEN_CPU_CAPABILITY (torch 2.13): a kernel
            # cached under one capability and loaded under another aborted here with
            # "corrupted size vs. prev_size". Each forced capability gets its own cache.
            if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
                import getpass
                import tempfile

                os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
                    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_aten_{value}")


_force_torch_isa(sys.argv[1:])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import compile_rng  # noqa: E402
from compile_rng.stream import cpu_kernel  # noqa: E402
from compile_rng import ops  # noqa: E402
from compile_rng.launch import progress  # noqa: E402
from compile_rng._torch import inductor_internals  # noqa: E402
from compile_rng._torch.inductor_internals import inductor_vector_isa  # noqa: E402


def timeit(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """``(best of repeat calls, the first call)``: the first compiles a compiled case."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    fn()  # warm up
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples), first


def _fused_loop(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` compiled by compile_rng with the lowering's choice made as on AVX-512:
    float32 streams under 256K elements and every other dtype stay a fused loop."""
    from unittest import mock

    from compile_rng.ops import lowering

    compiled = torch.compile(fn, backend=compile_rng.backend())

    def call() -> object:
        with mock.patch.object(lowering, "inductor_vector_isa", lambda: "avx512"):
            return compiled()

    return call


def cases(n: int, dtype: torch.dtype, fused: bool) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (group, zero-argument callable producing n random values of ``dtype``);
    ``fused`` adds compile_rng's compiles with the lowering's choice made as on AVX-512."""
    buf = torch.empty(n, dtype=dtype)
    x = torch.randn(n, dtype=dtype)
    image = torch.randn(n // 64, 4, 4, 4, dtype=dtype).contiguous(memory_format=torch.channels_last)  # a CNN's
    key = ops.make_key(1, 0)
    crng = lambda f: torch.compile(f, backend=compile_rng.backend())  # noqa: E731
    stock = lambda f: torch.compile(f)  # noqa: E731
    found = {
        "memset fill_": ("floor", lambda: buf.fill_(1.0)),
        "eager uniform_": ("uniform", lambda: buf.uniform_()),
        "inductor torch.rand": ("uniform", stock(lambda: torch.rand(n, dtype=dtype))),
        "compile_rng torch.rand": ("uniform", crng(lambda: torch.rand(n, dtype=dtype))),
        "compile_rng eager op uniform": ("uniform", lambda: ops.uniform(key, 0, [n], [1], 0.0, 1.0, dtype)),
        "eager normal_": ("normal", lambda: buf.normal_()),
        "inductor torch.randn": ("normal", stock(lambda: torch.randn(n, dtype=dtype))),
        "compile_rng torch.randn": ("normal", crng(lambda: torch.randn(n, dtype=dtype))),
        "compile_rng eager op normal": ("normal", lambda: ops.normal(key, 0, [n], [1], 0.0, 1.0, dtype)),
        "eager dropout": ("dropout", lambda: F.dropout(x, 0.1)),
        "inductor dropout": ("dropout", stock(lambda: F.dropout(x, 0.1))),
        "compile_rng dropout": ("dropout", crng(lambda: F.dropout(x, 0.1))),
        "eager dropout, ch-last": ("dropout channels_last", lambda: F.dropout(image, 0.1)),
        "inductor dropout, ch-last": ("dropout channels_last", stock(lambda: F.dropout(image, 0.1))),
        "compile_rng dropout, ch-last": ("dropout channels_last", crng(lambda: F.dropout(image, 0.1))),
    }
    if fused:
        found["compile_rng torch.rand, fused"] = ("uniform", _fused_loop(lambda: torch.rand(n, dtype=dtype)))
        found["compile_rng dropout, fused"] = ("dropout", _fused_loop(lambda: F.dropout(x, 0.1)))
    return found


BASELINES = {"uniform": "eager uniform_", "normal": "eager normal_", "dropout": "eager dropout",
             "dropout channels_last": "eager dropout, ch-last"}
STOCK = {"uniform": "inductor torch.rand", "normal": "inductor torch.randn", "dropout": "inductor dropout",
         "dropout channels_last": "inductor dropout, ch-last"}


def torch_isas() -> dict[str, str]:
    """The instruction sets torch's baselines run: ATen's CPU capability (eager kernels)
    and the vector ISA Inductor generates C++ for."""
    return {"eager": torch.backends.cpu.get_cpu_capability().lower(),
            "inductor": inductor_vector_isa() or "none"}


def row_isa(case: str, kernel_isa: str, baselines: dict[str, str]) -> str:
    """The instruction set a case ran with."""
    if case.startswith("compile_rng"):
        return kernel_isa
    if case.startswith("inductor"):
        return baselines["inductor"]
    return "-" if case.startswith("memset") else baselines["eager"]


def cpu_name() -> str:
    """The CPU model (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def run(n: int, repeat: int, threads: list[int], isa: str, dtype: torch.dtype, fused: bool) -> list[dict]:
    """Every case at every thread count with the CPU kernel's ``isa`` build."""
    os.environ[cpu_kernel.ISA_ENV] = isa
    cpu_kernel.isa()  # a build this CPU cannot run fails here, before any timing
    rows = []
    baselines = torch_isas()
    for t in threads:
        torch.set_num_threads(t)
        torch._dynamo.reset()  # Inductor bakes the thread count into its kernels
        timed = {}
        for name, (group, fn) in cases(n, dtype, fused).items():
            progress(f"{isa}, {t} thread(s): {name} (compile, warm-up, {repeat} timed runs)")
            timed[name] = (group, *timeit(fn, repeat))
        memset = timed["memset fill_"][1]
        for name, (group, sec, first) in timed.items():
            row = {"isa": isa, "threads": t, "case": name, "group": group, "ran_isa": row_isa(name, isa, baselines),
                   "ns_per_elem": sec / n * 1e9, "x_memset": sec / memset, "first_call_s": first}
            if group in BASELINES:
                row["speedup_vs_eager"] = timed[BASELINES[group]][1] / sec
                row["speedup_vs_inductor"] = timed[STOCK[group]][1] / sec
            rows.append(row)
    return rows


def print_table(rows: list[dict], n: int, cpu: str, dtype: torch.dtype) -> None:
    print(f"\n{cpu}; {n:,} {str(dtype).removeprefix('torch.')} elements; best of repeats; speedup > 1 means faster than the baseline")
    header = (f"{'kernel':<8} {'threads':>7}  {'case':<30} {'ran as':<12} {'ns/elem':>8} {'x memset':>9} "
              f"{'vs eager':>9} {'vs inductor':>12} {'1st call s':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        eager = f"{r['speedup_vs_eager']:.2f}x" if "speedup_vs_eager" in r else ""
        ind = f"{r['speedup_vs_inductor']:.2f}x" if "speedup_vs_inductor" in r else ""
        print(f"{r['isa']:<8} {r['threads']:>7}  {r['case']:<30} {r['ran_isa']:<12} {r['ns_per_elem']:>8.2f} "
              f"{r['x_memset']:>9.1f} {eager:>9} {ind:>12} {r['first_call_s']:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16 * 2**20)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--fused", action="store_true",
                        help="also time compile_rng's compiles with the lowering's choice made as on AVX-512")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", default="bench-random.json")
    parser.add_argument("--threads", type=int, nargs="*", help="thread counts (default: 1 and all cores)")
    parser.add_argument("--isa", nargs="*", choices=list(cpu_kernel.ISA_FLAGS),
                        help="CPU kernel builds to measure in turn (default: the one chosen for this CPU)")
    parser.add_argument("--baseline-isa", choices=BASELINE_ISAS,
                        help="force eager torch (ATen) and Inductor to this instruction set (sets ATEN_CPU_CAPABILITY "
                             "before torch starts; default: what the CPU supports, or ATEN_CPU_CAPABILITY if set)")
    args = parser.parse_args()
    threads = args.threads or sorted({1, os.cpu_count() or 1})
    default = cpu_kernel.isa()
    isas = args.isa or [default]
    cpu = cpu_name()
    baselines = torch_isas()
    print(f"CPU: {cpu}; compile_rng CPU kernel: {default} (this CPU runs {', '.join(cpu_kernel.supported_isas())}); "
          f"measuring {', '.join(isas)}")
    print(f"torch {torch.__version__}: eager ATen kernels {baselines['eager']}, Inductor C++ {baselines['inductor']}"
          + (f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})" if os.environ.get("ATEN_CPU_CAPABILITY") else ""))
    dtype = getattr(torch, args.dtype)
    # --fused compiles the same graphs twice with different code: no cache may answer
    with inductor_internals.inductor_caches_off() if args.fused else contextlib.nullcontext():
        rows = [row for isa in isas for row in run(args.size, args.repeat, threads, isa, dtype, args.fused)]
    print_table(rows, args.size, cpu, dtype)
    with open(args.json, "w") as f:
        json.dump({"size": args.size, "dtype": args.dtype, "torch": torch.__version__, "cpu": cpu, "torch_isas": baselines, "rows": rows},
                  f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
