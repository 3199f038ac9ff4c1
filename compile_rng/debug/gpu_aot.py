"""Ahead-of-time compile check of the Triton kernels for named NVIDIA GPUs, on a machine
with no GPU and no driver.

Triton's interpreter checks the kernels' values on CPU but accepts code the NVIDIA
backend rejects or compiles badly (64-bit integer paths, casts, constexpr branches,
register pressure). Here every variant compile_rng can launch
(:func:`compile_rng.stream.accelerator_ops.specializations`) goes through Triton's real pipeline
for a named GPU (Triton IR -> LLVM -> PTX -> ptxas -> cubin), and the PTX through
``ptxas -v`` (the ptxas Triton runs, with its flags) for registers per thread, stack
frame and spill bytes.

Compiles run in worker processes (``python -m compile_rng.debug.gpu_aot --serve``), in
parallel: the AOT compiler needs the kernels as JIT functions, and a process that set
``TRITON_INTERPRET=1`` (the test suite) holds them interpreted. Triton's on-disk cache
(``TRITON_CACHE_DIR``) serves repeated compiles.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

#: The GPUs checked: A100 (sm_80), H100 (sm_90), B200 (sm_100).
ARCHS = (80, 90, 100)


@dataclass(frozen=True)
class Resources:
    """What ``ptxas -v`` reports for one kernel."""

    registers: int  # per thread
    stack: int  # bytes of stack frame
    spill_stores: int  # bytes
    spill_loads: int  # bytes

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class Compiled:
    """One variant compiled for one GPU."""

    name: str  # triton_kernels.variant_name
    arch: int
    resources: Resources
    cubin_registers: int  # registers recorded in the cubin Triton built (cuobjdump)
    compile_s: float  # triton.compile, all stages (small when Triton's cache served it)
    sass_instructions: int  # instructions in the cubin's SASS


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")
_PTXAS_FRAME = re.compile(
    r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_CUBIN_REG = re.compile(r"\bREG:(\d+)")
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+([^;]*);", re.M)


def parse_ptxas(log: str) -> Resources:
    """The resources of the entry kernel in a ``ptxas -v`` log. Functions it calls
    (libdevice's slow path of fp64 ``sin``/``cos`` is not inlined) add their spills; the
    stack is the entry's cumulative one where ptxas reports it."""
    frames = _PTXAS_FRAME.findall(log)
    used = [int(v) for v in _PTXAS_USED.findall(log)]
    if not frames or not used:
        raise ValueError(f"compile_rng: no kernel in the ptxas log:\n{log}")
    stack = max([int(v) for v in _PTXAS_CUMULATIVE.findall(log)] + [int(frames[0][1])])
    return Resources(
        registers=max(used), stack=stack,
        spill_stores=sum(int(f[2]) for f in frames), spill_loads=sum(int(f[3]) for f in frames),
    )


def supported_archs(archs: Iterable[int] = ARCHS) -> tuple[int, ...]:
    """The GPUs of ``archs`` the installed triton can compile for."""
    from compile_rng._torch import triton_internals

    return tuple(a for a in archs if triton_internals.supports(a))


def sass(cubin: bytes) -> list[str]:
    """The cubin's SASS instructions (opcode and operands, predicates included), in order."""
    from compile_rng._torch import triton_internals

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = _run([triton_internals.cuobjdump(), "-sass", str(path)])
    return [m.strip() for m in _SASS_LINE.findall(text)]


def _cubin_registers(cubin: bytes) -> int:
    from compile_rng._torch import triton_internals

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = _run([triton_internals.cuobjdump(), "--dump-resource-usage", str(path)])
    (regs,) = _CUBIN_REG.findall(usage)
    return int(regs)


def _ptxas_resources(ptx: str, arch: int, options: dict) -> Resources:
    from compile_rng._torch import triton_internals

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [triton_internals.ptxas(arch), "-v", *triton_internals.ptxas_flags(arch, options),
               str(src), "-o", str(Path(tmp) / "kernel.o")]
        return parse_ptxas(_run(cmd, stderr=True))


def _run(cmd: Sequence[str], stderr: bool = False) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compile_rng: {' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + (done.stderr if stderr else "")


def compile_variant(name: str, arch: int) -> tuple[Compiled, dict]:
    """Compile variant ``name`` for GPU ``arch`` in this process (which must not run the
    interpreter); returns the result and Triton's stage outputs (``ptx``, ``cubin``...)."""
    from compile_rng._torch import triton_internals
    from compile_rng.stream import accelerator_ops, triton_kernels

    step = accelerator_ops.specializations()[name]
    kernel = triton_kernels._stream_kernel
    bound = triton_internals.bind(kernel, arch, step.args, {**dict(step.constexprs), **triton_kernels.OPTIONS})
    start = time.perf_counter()
    asm = triton_internals.compile_for(kernel, bound, arch)
    seconds = time.perf_counter() - start
    resources, cubin_registers, instructions = inspect(asm, arch, bound.options)
    return Compiled(name, arch, resources, cubin_registers, seconds, instructions), asm


def compile_source(path: str | Path, name: str, arch: int, signature: dict, constants: dict, attrs: dict,
                   options: dict) -> tuple[Resources, dict]:
    """Compile the ``@triton.jit`` kernel ``name`` of the Python file ``path`` (a kernel
    someone else generated: stock Inductor's, say) for GPU ``arch``, as ``triton.compile``
    gets it: the signature (constexprs included), constants, attributes and options its
    launcher would pass. In this process, which must not run the interpreter; returns
    ``ptxas -v``'s resources and Triton's stage outputs."""
    import importlib.util

    from compile_rng._torch import triton_internals

    spec = importlib.util.spec_from_file_location(f"compile_rng_aot_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bound = triton_internals.Bound(dict(signature), dict(constants), dict(attrs), dict(options))
    asm = triton_internals.compile_for(getattr(module, name), bound, arch)
    return _ptxas_resources(asm["ptx"], arch, options), asm


def inspect(asm: dict, arch: int, options: dict) -> tuple[Resources, int, int]:
    """Of one compiled kernel (Triton's stage outputs for GPU ``arch``, compiled with
    ``options``): ``ptxas -v``'s resources, the cubin's registers, its SASS length."""
    return _ptxas_resources(asm["ptx"], arch, options), _cubin_registers(asm["cubin"]), len(sass(asm["cubin"]))


_RESULT = "compile_rng-aot-result "  # marks the worker's answer lines (Triton may print too)


def _serve() -> None:
    """Worker loop: one ``[name, arch]`` JSON line in, one result line out."""
    for line in sys.stdin:
        name, arch = json.loads(line)
        try:
            answer = {"ok": asdict(compile_variant(name, arch)[0])}
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            answer = {"error": f"{name} for sm_{arch}:\n{traceback.format_exc()}"}
        print(_RESULT + json.dumps(answer), flush=True)


class _Worker:
    """A ``python -m compile_rng.debug.gpu_aot --serve`` process. A fresh interpreter rather
    than a multiprocessing worker: the kernels must be imported as JIT functions, and a
    spawned multiprocessing child re-imports the parent's main module, which may have
    imported them interpreted (the test suite sets ``TRITON_INTERPRET=1``)."""

    def __init__(self, cache_dir: str | None):
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        if cache_dir is not None:
            env["TRITON_CACHE_DIR"] = cache_dir
        root = str(Path(__file__).resolve().parents[2])  # importable from a source checkout too
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "compile_rng.debug.gpu_aot", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )

    def compile(self, name: str, arch: int) -> Compiled:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([name, arch]) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(_RESULT):
                answer = json.loads(line[len(_RESULT):])
                if "error" in answer:
                    raise RuntimeError(f"compile_rng: AOT compile of {answer['error']}")
                fields = answer["ok"]
                return Compiled(**{**fields, "resources": Resources(**fields["resources"])})
        raise RuntimeError(f"compile_rng: the AOT worker died compiling {name} for sm_{arch}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def compile_all(
    names: Iterable[str], archs: Iterable[int] = ARCHS, jobs: int | None = None, cache_dir: str | None = None
) -> list[Compiled]:
    """Compile every variant of ``names`` for every GPU of ``archs``, ``jobs`` at a time
    in worker processes (default: one per CPU); results in task order (names outer).
    ``cache_dir``: Triton's cache directory for the workers (default: Triton's own, so a
    rerun is fast; a fresh directory measures real compile times). Raises if a variant
    fails to compile."""
    tasks = queue.SimpleQueue()
    order = [(name, arch) for name in names for arch in archs]
    for i, task in enumerate(order):
        tasks.put((i, task))
    results: list[Compiled | None] = [None] * len(order)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(order)))

    def drive() -> None:
        worker = _Worker(cache_dir)
        try:
            while True:
                try:
                    i, (name, arch) = tasks.get_nowait()
                except queue.Empty:
                    return
                results[i] = worker.compile(name, arch)
        finally:
            worker.close()

    with ThreadPoolExecutor(jobs) as pool:
        for done in [pool.submit(drive) for _ in range(jobs)]:
            done.result()
    return [r for r in results if r is not None]


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
