"""GPU throughput of compile_rng's Triton kernels against torch, in one run (CUDA only).

For 64M float32 elements (``--numel``): ns/element and achieved GB/s of compile_rng's
uniform, normal and dropout (eager calls of the Triton kernels, and the same ops in a
``backend="compile_rng"`` graph), eager torch ``uniform_``/``normal_``/``F.dropout``,
stock Inductor ``torch.rand``/``torch.randn``/``F.dropout``, and ``fill_`` (the write
floor). "of fill" is the fraction of ``fill_``'s bandwidth (bytes moved / time):
the practical peak of this GPU for a pure write.

    python benchmarks/bench_gpu.py [--numel N]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def _time(fn, reps: int = 20) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (CUDA events, after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _time_or_error(fn) -> float | str:
    """:func:`_time`, or the error's first line: one case that cannot run (a torch
    without what a compiled row needs, seen on a GPU image's torch 2.11) leaves the
    other rows measured."""
    try:
        return _time(fn)
    except Exception as e:  # noqa: BLE001  (reported in the table, not hidden)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]


def _compiled(fn, backend: str):
    """``torch.compile(fn, backend=backend)``, or, where that already raises (a backend
    this torch cannot find), a function raising the same error when its row is timed."""
    try:
        return torch.compile(fn, backend=backend)
    except Exception as e:  # noqa: BLE001  (raised again by the row, which reports it)
        def unavailable(*args, error=e):
            raise error

        return unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 << 20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        sys.exit(0)
    import compile_rng
    from compile_rng import ops

    n, dev = args.numel, torch.device("cuda")
    out = torch.empty(n, device=dev)
    x = torch.randn(n, device=dev)
    key = ops.make_key(1, 0, dev)
    compile_rng.manual_seed(1)
    programs = {
        "uniform": lambda: torch.rand(n, device=dev),
        "normal": lambda: torch.randn(n, device=dev),
        "dropout": lambda t: F.dropout(t, 0.1),
    }
    cr_graph = {name: _compiled(fn, "compile_rng") for name, fn in programs.items()}
    stock = {name: _compiled(fn, "inductor") for name, fn in programs.items()}
    # bytes each op moves: writes 4/elem; dropout reads 4, writes 4 and a 1-byte mask
    moved = {"uniform": 4 * n, "normal": 4 * n, "dropout": 9 * n, "fill_": 4 * n}
    rows = [("fill_", "torch", _time(lambda: out.fill_(1.0)))]
    for name in ("uniform", "normal", "dropout"):
        if name == "dropout":
            cases = [
                ("compile_rng eager", lambda: ops.dropout(key, 0, x, [1], 0.1)),
                ("compile_rng graph", lambda: cr_graph["dropout"](x)),
                ("torch eager", lambda: F.dropout(x, 0.1)),
                ("stock Inductor", lambda: stock["dropout"](x)),
            ]
        else:
            op = ops.uniform if name == "uniform" else ops.normal
            lo, hi = (0.0, 1.0)
            eager = (lambda: out.uniform_()) if name == "uniform" else (lambda: out.normal_())
            cases = [
                ("compile_rng eager", lambda op=op, lo=lo, hi=hi: op(key, 0, [n], [1], lo, hi, torch.float32)),
                ("compile_rng graph", cr_graph[name]),
                ("torch eager", eager),
                ("stock Inductor", stock[name]),
            ]
        rows += [(name, who, _time_or_error(fn)) for who, fn in cases]
    fill_bw = moved["fill_"] / rows[0][2]
    print(f"{torch.cuda.get_device_name()}  numel={n}  torch {torch.__version__}")
    print(f"{'op':<9}{'implementation':<20}{'ns/elem':>9}{'GB/s':>9}{'of fill':>9}")
    for name, who, t in rows:
        if isinstance(t, str):
            print(f"{name:<9}{who:<20} failed: {t}")
            continue
        bw = moved[name] / t
        print(f"{name:<9}{who:<20}{t / n * 1e9:>9.4f}{bw / 1e9:>9.0f}{bw / fill_bw:>9.2f}")


if __name__ == "__main__":
    main()
