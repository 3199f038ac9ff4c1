"""The Triton kernels compiled ahead of time for NVIDIA GPUs, without a GPU: registers,
spills and compile time per variant and GPU, and (``--per-element``) SASS instructions
per element of uniform, normal and dropout (float32, bfloat16) on sm_90 with the H100
prediction they give, for compile_rng's kernels and for the Triton kernel stock Inductor
generates for the same graph (``rand_like``, ``randn_like``, ``F.dropout`` in training).

    python benchmarks/aot_gpu.py [--arch 80 90 100] [--only dropout ...] [--jobs N]
                                 [--full] [--cache] [--json out.json] [--per-element]

By default the compiles use a fresh Triton cache (real compile times) and the output is
a summary per op; ``--full`` prints every variant; ``--only`` also picks the
``--per-element`` rows (``--only dropout.float32`` for one). Nothing runs on a GPU: the
``--per-element`` figures are a prediction until ``bench_gpu.py`` runs on one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["TRITON_INTERPRET"] = "0"  # this process compiles (--per-element): JIT kernels

from compile_rng.debug import gpu_aot  # noqa: E402

# --- the table ------------------------------------------------------------------------------


def _cell(r: gpu_aot.Compiled) -> str:
    spill = f"{r.resources.spills} B" if r.resources.spills else "0"
    return f"{r.resources.registers:3d} regs, spill {spill}, {r.compile_s:4.1f} s"


def print_full(results: list[gpu_aot.Compiled], archs: tuple[int, ...]) -> None:
    by = {(r.name, r.arch): r for r in results}
    names = list(dict.fromkeys(r.name for r in results))
    width = max(len(n) for n in names)
    print(f"| {'variant':{width}} | " + " | ".join(f"sm_{a}" for a in archs) + " |")
    print(f"| {'-' * width} | " + " | ".join("---" for _ in archs) + " |")
    for n in names:
        print(f"| {n:{width}} | " + " | ".join(_cell(by[n, a]) for a in archs) + " |")


def print_summary(results: list[gpu_aot.Compiled], archs: tuple[int, ...]) -> None:
    """One row per op and dtype group: register range, spill bytes (summed), compile time
    range, over its variants (dtypes, layouts, paths)."""
    groups: dict[tuple[str, int], list[gpu_aot.Compiled]] = defaultdict(list)
    for r in results:
        op = r.name.split(".")[0]
        if op in ("uniform", "normal", "exponential", "dropout"):
            op += " (float64)" if ".float64." in r.name else " (fp16/bf16/fp32)"
        groups[op, r.arch].append(r)
    ops = list(dict.fromkeys(op for op, _ in groups))
    print("| op (variants) | " + " | ".join(f"sm_{a}: regs / spill / compile s" for a in archs) + " |")
    print("| --- | " + " | ".join("---" for _ in archs) + " |")
    for op in ops:
        cells = []
        for a in archs:
            rs = groups[op, a]
            regs = [r.resources.registers for r in rs]
            secs = [r.compile_s for r in rs]
            spill = sum(r.resources.spills for r in rs)
            cells.append(f"{min(regs)}-{max(regs)} / {spill} B / {min(secs):.1f}-{max(secs):.1f}")
        print(f"| {op} ({len(groups[op, archs[0]])}) | " + " | ".join(cells) + " |")
    for a in archs:
        rs = [r for r in results if r.arch == a]
        print(f"sm_{a}: {len(rs)} variants, registers {min(r.resources.registers for r in rs)}-"
              f"{max(r.resources.registers for r in rs)}, spill bytes {sum(r.resources.spills for r in rs)}, "
              f"stack max {max(r.resources.stack for r in rs)} B, compile median "
              f"{statistics.median(r.compile_s for r in rs):.2f} s, total {sum(r.compile_s for r in rs):.0f} s")


# --- instructions per element (sm_90) --------------------------------------------------------

_ADDR = re.compile(r"^/\*([0-9a-f]+)\*/\s+(.*)$")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")
_CALL = re.compile(r"CALL\.REL\.NOINC\s+0x([0-9a-f]+)")


#: SASS opcode -> the unit class the estimate charges it to.
_CLASSES = (
    ("IMAD (multiply, multiply-add, IMAD.MOV moves)", ("IMAD", "IMUL")),
    ("integer ALU (logic, shift, add, compare, select)",
     ("LOP3", "SHF", "IADD3", "VIADD", "LEA", "ISETP", "SEL", "PRMT", "IABS", "IMNMX", "SGXT", "BMSK", "FLO", "POPC")),
    ("fp32/fp64", ("FADD", "FMUL", "FFMA", "FSETP", "FSEL", "FMNMX", "HFMA2", "DADD", "DMUL", "DFMA", "DSETP")),
    ("MUFU (log2, sin, cos, rcp, rsqrt)", ("MUFU",)),
    ("conversion", ("I2F", "F2I", "F2F", "I2I", "F2FP", "I2FP")),
    ("memory", ("LDG", "STG", "LDS", "STS", "LDC", "ULDC", "LDL", "STL")),
)


def _sass_with_addresses(cubin: bytes) -> list[tuple[int, str]]:
    import subprocess

    from compile_rng._torch import triton_internals

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([triton_internals.cuobjdump(), "-sass", str(path)], capture_output=True, text=True).stdout
    out = []
    for line in text.splitlines():
        m = _ADDR.match(line.strip())
        if m and ";" in m.group(2):
            out.append((int(m.group(1), 16), m.group(2).split(";")[0].strip()))
    return out


def executed_per_thread(sass: list[tuple[int, str]]) -> list[str]:
    """The instructions one thread executes on the common path, walked through the static
    SASS from the entry to an EXIT: an unconditional branch is followed; a conditional
    forward branch falls through - ptxas lays out an ``if``'s then-block first, and the
    kernels put the common case there (at most one outer dim; a whole aligned tile) -
    unless the fall-through region holds a rare path, which is then skipped: a subroutine
    call (ptxas's 64-bit division, called only when an operand needs more than 32 bits)
    or table loads (``LDG.E.CONSTANT``: libdevice's Payne-Hanek reduction for sin/cos,
    taken only for |x| > 105615, and the angles here are below 2 pi), or four times the
    Philox multiplies of the other side (``IMAD.HI``, ``IMAD.WIDE``: a fused draw's per-lane words, taken
    only where a program's first counter is not a multiple of four; ptxas may lay out
    either side first). A subroutine still called counts its body once per call. Counting
    the whole body instead (both sides of every ``if``) overstated uniform by a third."""
    by_addr = {a: i for i, (a, _) in enumerate(sass)}

    def multiplies(part: list[tuple[int, str]]) -> int:
        return sum("IMAD.HI" in s or "IMAD.WIDE" in s for _, s in part)

    def other_side(start: int, skipped: list[tuple[int, str]]) -> list[tuple[int, str]]:
        # the branch target's side of an if-else: up to where the skipped side jumps to
        last = _BRANCH.match(skipped[-1][1]) if skipped else None
        end = by_addr.get(int(last.group(2), 16), start) if last and last.group(2) and not last.group(1) else start
        return sass[start:end]

    executed, i, seen = [], 0, set()
    while not sass[i][1].startswith("EXIT"):
        if i in seen:  # an unconditional loop on the path: no common path to count
            raise ValueError(f"the common path loops at SASS line {i}: {sass[i][1]}")
        seen.add(i)
        addr, ins = sass[i]
        m = _BRANCH.match(ins)
        if m and m.group(2):
            target = by_addr[int(m.group(2), 16)]
            skipped = sass[i + 1:target] if target > i else []
            rare = any("LDG.E.CONSTANT" in s or "CALL" in s for _, s in skipped)
            rare = rare or multiplies(skipped) >= 4 * max(1, multiplies(other_side(target, skipped)))
            executed.append(ins)
            i = target if not m.group(1) or rare else i + 1
            continue
        executed.append(ins)
        call = _CALL.search(ins)
        if call:
            j = by_addr[int(call.group(1), 16)]
            while not sass[j][1].startswith("RET"):
                executed.append(sass[j][1])
                j += 1
        i += 1
    executed.append(sass[i][1])
    return executed


def _classify(ins: str) -> str:
    op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
    base = op.split(".")[0]
    for name, ops in _CLASSES:
        if base in ops:
            return name
    return "other (branch, move, barrier...)"


#: H100 SXM5 figures the prediction uses (sources: docs/gpus.md).
H100_SMS, H100_CLOCK_HZ = 132, 1.98e9
H100_HBM_BYTES_PER_S = 3.35e12
FILL_EFFICIENCY = 0.90  # assumed: a large fill_ reaches ~90% of peak HBM bandwidth
#: results per clock per SM (CUDA C++ Programming Guide, arithmetic instruction
#: throughput, compute capability 9.0); "issue": 4 schedulers x 1 warp instruction x 32.
H100_PER_SM_CLOCK = {
    "issue": 128,
    "IMAD (multiply, multiply-add, IMAD.MOV moves)": 64,
    "integer ALU (logic, shift, add, compare, select)": 64,
    "fp32/fp64": 128,  # fp32; the fp64 ops of these variants are few
    "MUFU (log2, sin, cos, rcp, rsqrt)": 16,
    "conversion": 16,
}

#: The per-element table's rows: op x dtype, on 64M elements (bench_gpu.py's and Nsight
#: Compute's size; it sets stock Inductor's size hint, hence its block size).
OPS, DTYPES, N_ELEMENTS = ("uniform", "normal", "dropout"), ("float32", "bfloat16"), 1 << 26


def bytes_per_element(op: str, dtype: str) -> int:
    """Bytes a kernel moves per element: uniform and normal write a value; dropout reads
    one and writes one and a 1-byte keep mask (compile_rng's op and stock's training
    forward, whose mask is saved for the backward, alike)."""
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return 2 * size + 1 if op == "dropout" else size


@dataclass(frozen=True)
class PerElement:
    """One kernel's sm_90 hot path: instructions one thread executes, and the elements it
    produces with them."""

    kernel: str  # what was compiled, for the listing
    registers: int
    executed: tuple[str, ...]  # the common path, one thread
    elements_per_thread: float

    @property
    def total(self) -> float:
        return len(self.executed) / self.elements_per_thread

    def by_class(self) -> dict[str, float]:
        counts = Counter(_classify(i) for i in self.executed)
        return {k: v / self.elements_per_thread for k, v in counts.items()}

    def predict(self, nbytes: int) -> tuple[dict[str, float], str]:
        """ps per element each limit of the H100 model allows, and the binding one.

        ``integer (IMAD + ALU)``: the two integer classes at one class's rate, as if they
        did not overlap - a **fit**, not a prediction: it was chosen to match the H200's
        timings of the kernels Inductor generates from compile_rng's lowering, whose hot
        path is integer work (Philox per element): uniform (69.6 instructions, 21.5 IMAD +
        36.8 ALU: 3.49 ps by the fit) took 234 us on 64M elements, 3.49 ps, and
        ``dropout(x) + residual`` (21.9 + 36.0: 3.46 ps) 237 us, 3.53 ps (``do_bench``,
        2026-11-27); each class at its own rate gave 2.1-2.4. No kernel it was not fitted
        on has been timed against it. The eager kernels, a quarter of that integer work,
        stay memory-bound either way (measured 1.26 ps for uniform against 1.33 modelled)."""
        sm_clocks = H100_SMS * H100_CLOCK_HZ
        per_elem = self.by_class()
        ps = {"issue": self.total / (sm_clocks * H100_PER_SM_CLOCK["issue"]) * 1e12}
        for k, rate in H100_PER_SM_CLOCK.items():
            if k != "issue":
                ps[k] = per_elem.get(k, 0.0) / (sm_clocks * rate) * 1e12
        integer = [k for k in H100_PER_SM_CLOCK if k.startswith(("IMAD", "integer ALU"))]
        ps["integer (IMAD + ALU)"] = sum(per_elem.get(k, 0.0) for k in integer) / (sm_clocks * 64) * 1e12
        ps["HBM"] = nbytes / (H100_HBM_BYTES_PER_S * FILL_EFFICIENCY) * 1e12
        return ps, max(ps, key=ps.get)


def compile_rng_count(op: str, dtype: str) -> PerElement:
    """compile_rng's eager kernel for ``op`` on a contiguous ``dtype`` output: each program
    writes ``BLOCK`` Philox blocks of four elements (``CONTIG``) or ``BLOCK`` elements."""
    from compile_rng.stream import accelerator_ops as ao, triton_kernels as tk

    name = f"{op}.{dtype}.stream"
    result, asm = gpu_aot.compile_variant(name, 90)
    c = dict(ao.specializations()[name].constexprs)
    per_thread = (c["BLOCK"] * 4 if c["CONTIG"] else c["BLOCK"]) / (tk.OPTIONS["num_warps"] * 32)
    executed = executed_per_thread(_sass_with_addresses(asm["cubin"]))
    return PerElement(name, result.resources.registers, tuple(executed), per_thread)


def _stock_graph(op: str):
    """The graph a user compiles with stock torch, as a function of ``x``: ``rand_like``,
    ``randn_like``, and ``F.dropout(x, p)`` in training - whose forward, once AOTAutograd
    has split it, is ``native_dropout``: the values and the keep mask saved for the
    backward, the outputs of compile_rng's dropout."""
    import torch

    return {
        "uniform": lambda x: torch.rand_like(x),
        "normal": lambda x: torch.randn_like(x),
        "dropout": lambda x: torch.native_dropout(x, 0.3, True),
    }[op]


def _compile_rng_graph(op: str):
    """The same draws as compile_rng's compiled graphs hold them (its functional ops on a
    key), as a function of ``(key, x)``; ``None`` where a graph calls the eager kernel
    (``normal``: its transcendental functions come from one implementation)."""
    import torch

    from compile_rng.ops import lowering  # noqa: F401 - registers the lowerings

    return {
        "uniform": lambda key, x: torch.ops.compile_rng.uniform(key, 0, list(x.shape), [1], 0.0, 1.0, x.dtype),
        "normal": None,
        "dropout": lambda key, x: torch.ops.compile_rng.dropout(key, 0, x, [1], 0.3),
    }[op]


def stock_counts(op: str, dtype: str) -> list[PerElement]:
    """Stock Inductor's generated Triton kernel for the same graph on a (fake) H100, one
    count per config its autotuner would try (it picks one by timing them on the GPU).

    The code comes from ``tests/fake_cuda_inductor.py`` (Inductor's decompositions and
    random-op pass, lowering and codegen on fake CUDA tensors, no GPU): a test helper, as
    it uses private torch APIs, which the library keeps in ``compile_rng/_torch/``; this
    script puts ``tests/`` on ``sys.path`` for it. The kernel is compiled with what
    Inductor's launcher hands ``triton.compile`` (signature, constants, attributes,
    options) through :func:`gpu_aot.compile_source`, and walked like compile_rng's.

    Elements per thread: Inductor's 1-D pointwise kernel (size hints ``{'x': n}``) has no
    loop; program ``pid`` covers ``xindex = pid * XBLOCK + arange(0, XBLOCK)``, ``XBLOCK``
    being the config's constexpr, so with ``n % XBLOCK == 0`` (``xmask`` all true) each
    program produces exactly ``XBLOCK`` elements, spread by Triton's blocked layout over
    the program's ``32 * num_warps`` threads (``num_warps`` from the same config), which
    all run the same straight-line path. Per element = per-thread count x threads per
    program / XBLOCK - what Nsight Compute's executed thread-instructions / n gives. A
    thread may hold copies of values another computes too (``rand4x`` draws XBLOCK / 4
    Philox blocks: with XBLOCK 512 on 256 threads each block is computed twice); the
    formula charges those, as the GPU executes them."""
    import torch

    return inductor_counts(f"stock Inductor {op} {dtype}", _stock_graph(op),
                           [((N_ELEMENTS,), getattr(torch, dtype))], as_compiled=True)


def fused_counts(op: str, dtype: str) -> list[PerElement]:
    """compile_rng's draw as Inductor generates it inside a CUDA graph (its lowering: one
    Philox block per four lanes where they hold whole blocks, on uint32 words), counted
    like :func:`stock_counts`; empty where the graph calls the eager kernel."""
    import torch

    fn = _compile_rng_graph(op)
    if fn is None:
        return []
    return inductor_counts(f"compile_rng in a graph {op} {dtype}", fn,
                           [((2,), torch.int64), ((N_ELEMENTS,), getattr(torch, dtype))])


def inductor_counts(label: str, fn, inputs, as_compiled: bool = False) -> list[PerElement]:
    """The one Triton kernel Inductor generates for ``fn`` on fake CUDA inputs (see
    :func:`stock_counts`), counted under each config its autotuner would try."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import fake_cuda_inductor as fci

    code = fci.generated_code(fn, inputs, as_compiled=as_compiled)
    ((name, source),) = fci.triton_kernels(code).items()  # one fused kernel (stock's seed is an aten call)
    hints = re.search(r"size_hints=(\{.*?\})", source).group(1)
    # a loop of the kernel's (not a tl.static_range, unrolled when it compiles: compile_rng's Philox rounds)
    loops = re.search(r"^\s+for (?!.*tl\.static_range)", source, re.M)
    if eval(hints) != {"x": N_ELEMENTS} or loops:  # noqa: S307 - Inductor's literal
        raise RuntimeError(f"{name}: not the 1-D pointwise kernel without a loop this count assumes:\n{source}")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.py"
        path.write_text(fci.jit_source(source))
        for config in fci.launch_configs(source):
            xblock, warps = config["kwargs"]["XBLOCK"], config["num_warps"]
            if N_ELEMENTS % xblock or xblock % (32 * warps):
                raise RuntimeError(f"{name}: XBLOCK {xblock}, {warps} warps: not whole programs of whole threads")
            resources, asm = gpu_aot.compile_source(path, name, 90, **fci.compile_inputs(source, config))
            if resources.spills:
                raise RuntimeError(f"{name}: spills {resources}")
            executed = executed_per_thread(_sass_with_addresses(asm["cubin"]))
            out.append(PerElement(f"{label} (XBLOCK {xblock}, {warps} warps)",
                                  resources.registers, tuple(executed), xblock / (32 * warps)))
    return out


def _listing(p: PerElement, nbytes: int, fill_ps: float) -> None:
    ps, limit = p.predict(nbytes)
    bound = ps[limit]
    print(f"- {p.kernel}: {p.registers} regs, {p.total:.1f} instructions/element: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(p.by_class().items(), key=lambda kv: -kv[1])))
    print("    ps/element by limit: " + ", ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in ps.items()))
    print(f"    predicted {bound:.2f} ps/element = {bound / 1e3:.4f} ns/element ({limit}-bound); "
          f"{ps['HBM'] / bound:.0%} of fill_'s bandwidth at {nbytes} B/element; "
          f"{bound / fill_ps:.2f}x a float32 fill_ ({fill_ps:.2f} ps/element)")


def per_element(only: list[str] | None = None) -> list[dict]:
    """Print, per op and dtype (rows whose ``op.dtype.stream`` contains one of ``only``),
    compile_rng's and stock Inductor's sm_90 instructions per element with the H100
    prediction, then the two side by side; return the table's rows."""
    rows = [(op, dt) for dt in DTYPES for op in OPS if not only or any(s in f"{op}.{dt}.stream" for s in only)]
    print("\nsm_90 SASS per element (common path) and the H100 SXM5 prediction "
          f"({H100_SMS} SMs, {H100_CLOCK_HZ / 1e9:.2f} GHz, HBM {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s, "
          f"fill_ at {FILL_EFFICIENCY:.0%} of it); stock Inductor's kernel of the same graph on "
          f"{N_ELEMENTS} elements, each autotune config:")
    fill_ps = 4 / (H100_HBM_BYTES_PER_S * FILL_EFFICIENCY) * 1e12
    table = []
    for op, dt in rows:
        nbytes = bytes_per_element(op, dt)
        ours, fused, stock = compile_rng_count(op, dt), fused_counts(op, dt), stock_counts(op, dt)
        for p in (ours, *fused, *stock):
            _listing(p, nbytes, fill_ps)
        table.append({"op": op, "dtype": dt, "bytes": nbytes, "compile_rng": ours, "fused": fused[:1], "stock": stock})

    def cell(p: PerElement, nbytes: int) -> str:
        ps, limit = p.predict(nbytes)
        return f"{p.total:.1f} ({p.registers} regs, {ps[limit]:.2f} ps {limit.split(' (')[0]})"

    def config(p: PerElement) -> str:
        return p.kernel[p.kernel.index("(XBLOCK") + 1:-1]

    print("\nInstructions per element, sm_90 hot path (registers, predicted H100 ps/element and its "
          "limit). compile_rng eager: its Triton kernel; in a graph: Inductor's kernel from its lowering "
          "(first autotune config; '-' where a graph calls the eager kernel). Stock Inductor: its first "
          "autotune config (XBLOCK 1024, 4 warps unless marked), then the others its autotuner times on the GPU:")
    print("| op | dtype | B/element | compile_rng eager | compile_rng in a graph | stock Inductor | "
          "eager / stock | graph / stock | stock, other configs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        ours, fused, (first, *others), nbytes = r["compile_rng"], r["fused"], r["stock"], r["bytes"]
        mark = "" if config(first) == "XBLOCK 1024, 4 warps" else f" [{config(first)}]"
        graph = f"{cell(fused[0], nbytes)} | " if fused else "- | "
        ratio = f"{fused[0].total / first.total:.2f}" if fused else "-"
        print(f"| {r['op']} | {r['dtype']} | {nbytes} | {cell(ours, nbytes)} | {graph}{cell(first, nbytes)}{mark} | "
              f"{ours.total / first.total:.2f} | {ratio} | "
              + "; ".join(f"{cell(p, nbytes)} [{config(p)}]" for p in others) + " |")
    return [{"op": r["op"], "dtype": r["dtype"], "compile_rng": r["compile_rng"].total,
             "compile_rng_graph": [p.total for p in r["fused"]], "stock": [p.total for p in r["stock"]]}
            for r in table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(gpu_aot.ARCHS))
    parser.add_argument("--only", nargs="+", default=None, help="variants whose name contains one of these")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--full", action="store_true", help="every variant, not the summary")
    parser.add_argument("--cache", action="store_true", help="use Triton's cache (fast rerun, no real compile times)")
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--per-element", action="store_true",
                        help="sm_90 instructions per element, compile_rng's and stock Inductor's, and the prediction")
    args = parser.parse_args()

    import torch
    import triton

    from compile_rng.stream import accelerator_ops as ao

    archs = gpu_aot.supported_archs(args.arch)
    names = [n for n in ao.specializations() if not args.only or any(s in n for s in args.only)]
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(names)} variants x "
          f"{', '.join(f'sm_{a}' for a in archs)} (skipped, unsupported here: {sorted(set(args.arch) - set(archs))})")
    fresh_cache = contextlib.nullcontext() if args.cache else tempfile.TemporaryDirectory(prefix="compile_rng_aot_")
    with fresh_cache as cache:
        start = time.perf_counter()
        results = gpu_aot.compile_all(names, archs, jobs=args.jobs, cache_dir=cache)
        wall = time.perf_counter() - start
    (print_full if args.full else print_summary)(results, archs)
    print(f"wall {wall:.0f} s for {len(results)} compiles on {args.jobs or os.cpu_count()} workers")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.per_element:
        per_element(args.only)


if __name__ == "__main__":
    main()
