"""GPU throughput of compile_rng's Triton kernels against torch, in one run (CUDA only).

Eager (``--numel`` elements, 64M by default, float32 and bfloat16): compile_rng's
uniform, normal and dropout kernels (the functional ops called directly), torch's own
``uniform_``/``normal_``/``F.dropout`` and ``fill_`` (the write floor). Compiled: the
same ops in a ``backend="compile_rng"`` graph and in stock Inductor's; and two graphs
where a draw feeds other work - ``dropout(x) + residual`` and attention probabilities
``dropout(softmax(s)) @ v`` - under compile_rng, stock Inductor, and stock Inductor
without the dropout (what the draw costs at all). Every ratio is against a baseline timed
in the same run: "x torch" is time over torch eager's (or stock Inductor's, for
graphs), "of fill" the fraction of ``fill_``'s bandwidth (bytes moved / time).

    python benchmarks/bench_gpu.py [--numel N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _time(fn: Callable[[], object], reps: int = 20, batch: int = 10) -> tuple[float, float]:
    """Seconds per call of ``fn()``, medians over ``reps`` (CUDA events, after warm-up):
    back to back (``batch`` calls between two events: the GPU's throughput where the host
    keeps ahead of it, as in a training step), and serially (one call between events,
    the host's time to launch it included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def median(calls: int) -> float:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        return sorted(times)[len(times) // 2]

    return median(batch), median(1)


def _time_or_error(fn: Callable[[], object]) -> tuple[float, float] | str:
    """:func:`_time`, or the error's first line: one case that cannot run leaves the
    other rows measured (and says why in the table)."""
    try:
        return _time(fn)
    except Exception as e:  # noqa: BLE001  (reported in the table, not hidden)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


class _Compiled:
    """``torch.compile(fn, backend=backend)`` called on ``args``, compiled afresh when its
    row is timed (Dynamo's cache is reset then: one backend's graph never serves another
    backend's row, nor one dtype's another's)."""

    def __init__(self, fn: Callable, backend: str, *args: torch.Tensor):
        self.fn, self.backend, self.args, self.compiled = fn, backend, args, None

    def __call__(self) -> object:
        if self.compiled is None:
            torch._dynamo.reset()
            self.compiled = torch.compile(self.fn, backend=self.backend)
        return self.compiled(*self.args)


def eager_rows(n: int, dtype: torch.dtype) -> list[dict]:
    import compile_rng
    from compile_rng import ops

    dev = torch.device("cuda")
    size = torch.tensor([], dtype=dtype).element_size()
    out = torch.empty(n, device=dev, dtype=dtype)
    x = torch.randn(n, device=dev).to(dtype)
    key = ops.make_key(1, 0, dev)
    compile_rng.manual_seed(1)
    # bytes moved: a draw writes one element; dropout reads one, writes one and a mask byte
    moved = {"fill_": size * n, "uniform": size * n, "normal": size * n, "dropout": (2 * size + 1) * n}
    cases = {
        "fill_": {"torch eager": lambda: out.fill_(1.0)},
        "uniform": {
            "compile_rng eager": lambda: ops.uniform(key, 0, [n], [1], 0.0, 1.0, dtype),
            "torch eager": lambda: out.uniform_(),
            "compile_rng graph": _Compiled(lambda: torch.rand(n, device=dev, dtype=dtype), "compile_rng"),
            "stock Inductor": _Compiled(lambda: torch.rand(n, device=dev, dtype=dtype), "inductor"),
        },
        "normal": {
            "compile_rng eager": lambda: ops.normal(key, 0, [n], [1], 0.0, 1.0, dtype),
            "torch eager": lambda: out.normal_(),
            "compile_rng graph": _Compiled(lambda: torch.randn(n, device=dev, dtype=dtype), "compile_rng"),
            "stock Inductor": _Compiled(lambda: torch.randn(n, device=dev, dtype=dtype), "inductor"),
        },
        "dropout": {
            "compile_rng eager": lambda: ops.dropout(key, 0, x, [1], 0.1),
            "torch eager": lambda: F.dropout(x, 0.1),
            "compile_rng graph": _Compiled(lambda t: F.dropout(t, 0.1), "compile_rng", x),
            "stock Inductor": _Compiled(lambda t: F.dropout(t, 0.1), "inductor", x),
        },
    }
    rows = []
    for op, impls in cases.items():
        for who, fn in impls.items():
            t = _time_or_error(fn)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "op": op, "impl": who, "bytes": moved[op],
                         "numel": n, "s": t[0] if isinstance(t, tuple) else t,
                         "s_serial": t[1] if isinstance(t, tuple) else t})
    return rows


def graph_rows(n: int) -> list[dict]:
    """The draw inside a graph: ``dropout(x) + residual`` (float32, ``n`` elements) and
    attention probabilities ``dropout(softmax(s), 0.1) @ v`` (bfloat16, ``n`` scores)."""
    dev = torch.device("cuda")
    x, r = torch.randn(n, device=dev), torch.randn(n, device=dev)
    seq = 1024
    heads = max(1, n // (seq * seq))
    s = torch.randn(heads, seq, seq, device=dev, dtype=torch.bfloat16)
    v = torch.randn(heads, seq, 64, device=dev, dtype=torch.bfloat16)
    graphs = {
        "dropout(x) + residual": (lambda a, b: F.dropout(a, 0.1) + b, lambda a, b: a + b, (x, r)),
        "dropout(softmax(s)) @ v": (
            lambda a, b: F.dropout(torch.softmax(a, -1), 0.1) @ b, lambda a, b: torch.softmax(a, -1) @ b, (s, v)),
    }
    rows = []
    for name, (with_dropout, without, args) in graphs.items():
        for who, fn, backend in (("compile_rng", with_dropout, "compile_rng"), ("stock Inductor", with_dropout, "inductor"),
                                 ("stock Inductor, no dropout", without, "inductor")):
            t = _time_or_error(_Compiled(fn, backend, *args))
            rows.append({"graph": name, "impl": who, "s": t[0] if isinstance(t, tuple) else t})
    return rows


def host_costs(n: int = 4096, reps: int = 300) -> str:
    """Microseconds of host time per call of a small draw (``n`` float32 elements: the GPU
    waits on the host), split into the layers a compile_rng draw passes: the custom op's
    dispatch, the op's argument handling and launch plan, and Triton's launch; and a
    dropout in a ``compile_rng.step`` against torch's."""
    import time

    from compile_rng import ops
    from compile_rng.stream import accelerator_ops as ao, triton_kernels as tk

    dev = torch.device("cuda")
    key, out = ops.make_key(1, 0, dev), torch.empty(n, device=dev)
    steps = tk.plan(tk.UNIFORM, out, key, 0, [1], a=0.0, b=1.0)
    (step,) = steps
    constexprs = dict(step.constexprs)

    def per_call(fn) -> float:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1e6

    static = _static_launch(step)
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.randn(64, n // 64, device=dev)
    rows = {
        "torch uniform_": lambda: out.uniform_(),
        "torch.empty": lambda: torch.empty(n, device=dev),
        "compile_rng ops.uniform (custom op)": lambda: ops.uniform(key, 0, [n], [1], 0.0, 1.0, torch.float32),
        "ops.call (the kernel, no dispatch)": lambda: ops.call(
            torch.ops.compile_rng.uniform.default, key, 0, [n], [1], 0.0, 1.0, torch.float32),
        "accelerator_ops.uniform (no dispatch)": lambda: ao.uniform(key, 0, [n], [1], 0.0, 1.0, torch.float32),
        "triton_kernels.plan only": lambda: tk.plan(tk.UNIFORM, out, key, 0, [1], a=0.0, b=1.0),
        "Triton launch only": lambda: tk._stream_kernel[step.grid](*step.args, **constexprs, **tk.OPTIONS),
        "torch's static CUDA launcher only": lambda: static(*step.grid, stream, *step.args),
        "torch F.dropout (stock)": lambda: F.dropout(x, 0.1),
    }
    lines = [f"  {name:<40}{per_call(fn):8.1f} us/call" for name, fn in rows.items()]
    lines.append(f"  torch's static CUDA launcher, bitwise as Triton's launch (bfloat16 dropout, shard-window rows): "
                 f"{_static_launches_agree(dev)}")
    # what an eager model pays: a dropout inside a step (its microbatch's rows of the batch)
    import compile_rng

    with compile_rng.step(x.shape[0]):
        lines.append(f"  {'F.dropout in a compile_rng.step':<40}{per_call(lambda: F.dropout(x, 0.1)):8.1f} us/call")
    # where a compile_rng call's host time goes, function by function
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    with compile_rng.step(x.shape[0]):
        profile.enable()
        for _ in range(reps):
            F.dropout(x, 0.1)
        torch.cuda.synchronize()
        profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    return "\n".join(lines) + f"\n\ncProfile of {reps} F.dropout calls in a step:\n" + text.getvalue()


def _static_launch(step) -> Callable[..., None]:
    """``step``'s kernel variant, compiled by a launch, as torch's static CUDA launcher
    (Inductor's) launches it: the route to a draw without Triton's Python launcher."""
    import tempfile

    from compile_rng._torch import inductor_internals
    from compile_rng.stream import triton_kernels as tk

    compiled = tk._stream_kernel[step.grid](*step.args, **dict(step.constexprs), **tk.OPTIONS)
    with tempfile.TemporaryDirectory() as cubins:
        return inductor_internals.static_cuda_launch(inductor_internals.static_cuda_kernel(compiled),
                                                     torch.cuda.current_device(), cubins)


def _static_launches_agree(dev: torch.device) -> bool:
    """A bfloat16 dropout over rows of a shard window (whole and partial tiles, two grid
    launches) written by Triton's launches and by the static launcher's: the same bits."""
    from compile_rng import ops
    from compile_rng.stream import triton_kernels as tk

    key = ops.make_key(3, 2**32 - 8, dev)
    x = torch.randn(3, 5000, device=dev).bfloat16()
    strides = [5003, 1]
    outs = []
    for static in (False, True):
        out, mask = torch.empty_like(x), torch.empty(x.shape, dtype=torch.bool, device=dev)
        for step in tk.plan(tk.DROPOUT, out, key, 1, strides, mask=mask, source=x, a=1 / 0.7,
                            i_a=int(0.7 * 2**32)):
            if static:
                _static_launch(step)(*step.grid, torch.cuda.current_stream().cuda_stream, *step.args)
            else:
                tk._stream_kernel[step.grid](*step.args, **dict(step.constexprs), **tk.OPTIONS)
        outs.append((out, mask))
    torch.cuda.synchronize()
    (a, a_mask), (b, b_mask) = outs
    return bool(torch.equal(a, b) and torch.equal(a_mask, b_mask) and a_mask.any() and not a_mask.all())


def ncu_launches(n: int) -> None:
    """One launch each of the uniform, normal and dropout kernels (float32, ``n``
    elements, a plain stream), for Nsight Compute to count what they execute."""
    from compile_rng import ops

    dev = torch.device("cuda")
    key, x = ops.make_key(1, 0, dev), torch.randn(n, device=dev)
    ops.uniform(key, 0, [n], [1], 0.0, 1.0, torch.float32)
    ops.normal(key, 0, [n], [1], 0.0, 1.0, torch.float32)
    ops.dropout(key, 0, x, [1], 0.1)
    torch.cuda.synchronize()
    print(f"ncu launches: uniform, normal, dropout; float32; numel={n}")


def _fmt(t: float | str, digits: int = 4) -> str:
    return f"{t * 1e3:.{digits}f} ms" if isinstance(t, float) else f"failed: {t}"


def report(eager: list[dict], graphs: list[dict]) -> str:
    lines = [f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
             f"{__import__('triton').__version__}  numel={eager[0]['numel']}"]
    lines.append("back to back (the GPU's throughput); serial: one call at a time, the host's launch included")
    lines.append(f"{'dtype':<9}{'op':<9}{'implementation':<20}{'ns/elem':>9}{'GB/s':>8}{'of fill':>9}{'x torch':>9}"
                 f"{'serial ns/elem':>16}")
    for dtype in dict.fromkeys(r["dtype"] for r in eager):
        rows = [r for r in eager if r["dtype"] == dtype]
        fill = next(r for r in rows if r["op"] == "fill_")
        fill_bw = fill["bytes"] / fill["s"] if isinstance(fill["s"], float) else None
        for r in rows:
            if not isinstance(r["s"], float):
                lines.append(f"{dtype:<9}{r['op']:<9}{r['impl']:<20} failed: {r['s']}")
                continue
            baseline_impl = "stock Inductor" if "graph" in r["impl"] else "torch eager"
            base = next((b["s"] for b in rows if b["op"] == r["op"] and b["impl"] == baseline_impl), None)
            ratio = f"{r['s'] / base:9.2f}" if isinstance(base, float) and r["impl"] != baseline_impl else f"{'':9}"
            bw = r["bytes"] / r["s"]
            of_fill = f"{bw / fill_bw:9.2f}" if fill_bw else f"{'':9}"
            lines.append(f"{dtype:<9}{r['op']:<9}{r['impl']:<20}{r['s'] / r['numel'] * 1e9:9.4f}{bw / 1e9:8.0f}{of_fill}{ratio}"
                         f"{r['s_serial'] / r['numel'] * 1e9:16.4f}")
    lines.append("")
    lines.append(f"{'graph (back to back)':<26}{'implementation':<28}{'time':>12}{'x stock':>9}{'x no dropout':>14}")
    for name in dict.fromkeys(r["graph"] for r in graphs):
        rows = {r["impl"]: r["s"] for r in graphs if r["graph"] == name}
        stock, bare = rows.get("stock Inductor"), rows.get("stock Inductor, no dropout")
        for who, t in rows.items():
            x_stock = f"{t / stock:9.2f}" if isinstance(t, float) and isinstance(stock, float) else f"{'':9}"
            x_bare = f"{t / bare:14.2f}" if isinstance(t, float) and isinstance(bare, float) else f"{'':14}"
            lines.append(f"{name:<26}{who:<28}{_fmt(t):>12}{x_stock}{x_bare}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 << 20)
    parser.add_argument("--json", default=None, help="write every timing here")
    parser.add_argument("--host", action="store_true",
                        help="only the host's time per call of small draws, split into its parts")
    parser.add_argument("--ncu-launches", action="store_true",
                        help="launch uniform, normal and dropout (float32) once each, for a profiler")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        sys.exit(0)
    if args.ncu_launches:
        ncu_launches(args.numel)
        return
    if args.host:
        print(host_costs())
        # outside a stream (never imported, after a step, uninstalled), the GIL, inside
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_random_ops

        print(bench_random_ops.table(bench_random_ops.measure("cuda", reps=300), "cuda"))
        return
    eager = [row for dtype in (torch.float32, torch.bfloat16) for row in eager_rows(args.numel, dtype)]
    graphs = graph_rows(args.numel)
    print(report(eager, graphs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "eager": eager, "graphs": graphs}, f, indent=1)


if __name__ == "__main__":
    main()
