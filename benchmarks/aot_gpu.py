"""The Triton kernels compiled ahead of time for NVIDIA GPUs, without a GPU: registers,
spills and compile time per variant and GPU, and (``--per-element``) SASS instructions
per element of uniform, normal and dropout on sm_90 with the H100 prediction they give.

    python benchmarks/aot_gpu.py [--arch 80 90 100] [--only dropout ...] [--jobs N]
                                 [--full] [--cache] [--json out.json] [--per-element]

By default the compiles use a fresh Triton cache (real compile times) and the output is
a summary per op; ``--full`` prints every variant. Nothing runs on a GPU: the
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
from dataclasses import asdict
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
    taken only for |x| > 105615, and the angles here are below 2 pi). A subroutine still
    called counts its body once per call. Counting the whole body instead (both sides of
    every ``if``) overstated uniform by a third."""
    by_addr = {a: i for i, (a, _) in enumerate(sass)}
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

#: variant -> bytes moved per element (fp32): uniform/normal write 4; dropout reads 4,
#: writes 4 and a 1-byte mask.
PER_ELEMENT = {"uniform.float32.stream": 4, "normal.float32.stream": 4, "dropout.float32.stream": 9}


def per_element() -> None:
    from compile_rng.stream import accelerator_ops as ao, triton_kernels as tk

    print("\nsm_90 SASS per element (common path) and the H100 SXM5 prediction "
          f"({H100_SMS} SMs, {H100_CLOCK_HZ / 1e9:.2f} GHz, HBM {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s, "
          f"fill_ at {FILL_EFFICIENCY:.0%} of it):")
    fill_ps = 4 / (H100_HBM_BYTES_PER_S * FILL_EFFICIENCY) * 1e12
    sm_clocks = H100_SMS * H100_CLOCK_HZ
    for name, nbytes in PER_ELEMENT.items():
        result, asm = gpu_aot.compile_variant(name, 90)
        c = dict(ao.specializations()[name].constexprs)
        per_thread = (c["BLOCK"] * 4 if c["CONTIG"] else c["BLOCK"]) / (tk.OPTIONS["num_warps"] * 32)
        executed = executed_per_thread(_sass_with_addresses(asm["cubin"]))
        classes = Counter(_classify(i) for i in executed)
        per_elem = {k: v / per_thread for k, v in classes.items()}
        total = len(executed) / per_thread
        ps = {"issue": total / (sm_clocks * H100_PER_SM_CLOCK["issue"]) * 1e12}
        for k, rate in H100_PER_SM_CLOCK.items():
            if k != "issue":
                ps[k] = per_elem.get(k, 0.0) / (sm_clocks * rate) * 1e12
        ps["HBM"] = nbytes / (H100_HBM_BYTES_PER_S * FILL_EFFICIENCY) * 1e12
        limit = max(ps, key=ps.get)
        bound = ps[limit]
        print(f"- {name}: {result.resources.registers} regs, {total:.1f} instructions/element: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_elem.items(), key=lambda kv: -kv[1])))
        print("    ps/element by limit: " + ", ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in ps.items()))
        print(f"    predicted {bound:.2f} ps/element = {bound / 1e3:.4f} ns/element ({limit}-bound); "
              f"{ps['HBM'] / bound:.0%} of fill_'s bandwidth; {bound / fill_ps:.2f}x a float32 fill_ "
              f"({fill_ps:.2f} ps/element)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(gpu_aot.ARCHS))
    parser.add_argument("--only", nargs="+", default=None, help="variants whose name contains one of these")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--full", action="store_true", help="every variant, not the summary")
    parser.add_argument("--cache", action="store_true", help="use Triton's cache (fast rerun, no real compile times)")
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--per-element", action="store_true", help="sm_90 instructions per element and the prediction")
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
        per_element()


if __name__ == "__main__":
    main()
