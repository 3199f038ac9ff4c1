"""The Triton kernels compile for the GPUs users have, checked without a GPU.

Triton compiles ahead of time for a named GPU with no GPU and no driver
(:mod:`compile_rng.debug.gpu_aot`): every variant compile_rng launches
(:func:`compile_rng.stream.accelerator_ops.specializations`) must compile for sm_80 (A100),
sm_90 (H100) and sm_100 (B200, where the installed triton has its ptxas) with no spill
bytes; registers per thread are recorded (``benchmarks/aot_gpu.py`` prints them). The
default suite compiles a representative subset (every op, both layouts, every
dtype-specific path); the sweep of every variant is marked slow and sweep (`make test-all`).

Skipped only where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the AOT check compiles with triton (pip install 'compile_rng[gpu]')")

from compile_rng import ops  # noqa: E402
from compile_rng.stream import accelerator_ops as ao  # noqa: E402
from compile_rng.debug import gpu_aot  # noqa: E402
from compile_rng._torch import triton_internals  # noqa: E402
from compile_rng.stream import triton_kernels as tk  # noqa: E402

ARCHS = gpu_aot.supported_archs()

#: Every op on both layouts, the float64 compute path, bfloat16's rounding, bool stores,
#: the randint high word with and without the modulo, bernoulli's tensor probabilities.
REPRESENTATIVE = [
    "uniform.bfloat16.stream", "uniform.float64.strided",
    "normal.float32.stream", "normal.float64.strided",
    "exponential.float16.strided",
    "bernoulli.bool.stream",
    "bernoulli_tensor.float32.p_float64.strided", "bernoulli_tensor.bfloat16.p_float16.stream",
    "dropout.float32.stream", "dropout.bfloat16.strided",
    "randint.int64.hi.stream", "randint.int64.hi.nomod.strided", "randint.int8.lo.stream",
    "random_bits.int64.stream",
]

#: Registers per thread above this would cost occupancy worth a look. The largest variant,
#: float64 normal with libdevice's sin/cos, takes 198-222 (triton 3.8) and 198-228 (3.9);
#: float32 ops at most 96, integers 108.
REGISTER_BUDGET = 240


def _variant_key(step: tk.Launch) -> tuple:
    return triton_internals.bind(tk._stream_kernel, 90, step.args, {**dict(step.constexprs), **tk.OPTIONS}).variant_key()


def _check(results: list[gpu_aot.Compiled]) -> None:
    for r in results:
        assert r.resources.spills == 0, (r.name, r.arch, r.resources)
        assert r.resources.registers == r.cubin_registers, (r.name, r.arch)  # our ptxas run = Triton's
        assert r.resources.registers <= REGISTER_BUDGET, (r.name, r.arch, r.resources.registers)
        assert r.sass_instructions > 0


# --- the enumeration --------------------------------------------------------------------


def test_names_and_variants_correspond_one_to_one():
    specs = ao.specializations()
    keys = {_variant_key(step) for step in specs.values()}
    assert len(keys) == len(specs) == 194
    assert set(REPRESENTATIVE) <= set(specs)


def test_every_launch_uses_an_enumerated_variant():
    """Launches as the ops make them, with values that would pick other variants if any
    scalar were typed by its value or any pointer specialized on its alignment: offsets
    and strides past 2**31, a seed word past 2**63, parameters whose bit patterns are 0,
    more dims than a launch takes, sources that start mid-storage."""
    known = {_variant_key(step): name for name, step in ao.specializations().items()}
    key = ops.make_key(2**63 + 5, 2**64 - 3)
    odd = torch.zeros(37, dtype=torch.float16)[1:]  # 2-byte aligned
    with tk.recording() as seen:
        ao.uniform(key, 2**40, [3, 5], [2**33, 1], 0.0, 1.0, torch.float32)
        ao.uniform(key, 0, [1], [1], -2.5, 3.0, torch.float64)
        ao.normal(key, 7, [2, 3, 2, 2, 5], [300, 90, 40, 11, 2], 0.0, 1.0, torch.bfloat16)
        ao.exponential(key, 2**62, [9], [3], 0.5, torch.float16)
        ao.bernoulli(key, 1, [4, 4], [4, 1], 0.9, torch.int64)
        ao.bernoulli_tensor(key, 0, odd.view(4, 9), [9, 1], torch.bool)
        ao.dropout(key, 3, odd.view(6, 6), [12, 2], 0.0)
        ao.dropout(key, 2**35, torch.ones(1000), [1], 0.5)
        ao.randint(key, 5, [10], [1], 0, 2**63, torch.int64)
        ao.randint(key, 5, [10], [7], -(2**40), 2**41, torch.float64)
        ao.randint(key, 5, [3, 3], [3, 1], 1, 2, torch.uint8)
        ao.random_bits(key, 2**63 - 1, [2, 2], [1, 2])
    assert len(seen) > 12  # the five-dim layout loops on the host
    for step in seen:
        assert known.get(_variant_key(step)) == tk.variant_name(step)


def test_the_gpus_checked():
    assert {80, 90} <= set(ARCHS)  # every triton with the NVIDIA backend has these
    assert set(ARCHS) <= set(gpu_aot.ARCHS)


# --- ptxas's report ---------------------------------------------------------------------

_LOG_SM90_NORMAL_F64 = """\
ptxas info    : 284 bytes gmem
ptxas info    : Compiling entry function '_stream_kernel' for 'sm_90a'
ptxas info    : Function properties for _stream_kernel
    48 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 202 registers, used 1 barriers, 48 bytes cumulative stack size
ptxas info    : Compile time = 335.083 ms
ptxas info    : Function properties for __internal_trig_reduction_slowpathd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
_LOG_SM80_SPILL = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_stream_kernel' for 'sm_80'
ptxas info    : Function properties for _stream_kernel
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size, 512 bytes cmem[0]
"""


def test_ptxas_logs_parse():
    assert gpu_aot.parse_ptxas(_LOG_SM90_NORMAL_F64) == gpu_aot.Resources(202, 48, 0, 0)
    spilled = gpu_aot.parse_ptxas(_LOG_SM80_SPILL)
    assert spilled == gpu_aot.Resources(64, 8, 4, 4) and spilled.spills == 8
    with pytest.raises(ValueError, match="no kernel"):
        gpu_aot.parse_ptxas("ptxas info    : 0 bytes gmem\n")


# --- compiles -----------------------------------------------------------------------------


def test_representative_variants_compile_without_spills():
    results = gpu_aot.compile_all(REPRESENTATIVE, ARCHS)
    assert [(r.name, r.arch) for r in results] == [(n, a) for n in REPRESENTATIVE for a in ARCHS]
    _check(results)


@pytest.mark.slow
@pytest.mark.sweep  # 194 variants x 3 targets: ~4.5 min on 2 cores, only in `make test-all`
def test_every_variant_compiles_without_spills():
    names = list(ao.specializations())
    results = gpu_aot.compile_all(names, ARCHS)
    assert len(results) == len(names) * len(ARCHS)
    _check(results)


def test_the_table_script_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "aot_gpu.py"
    run = subprocess.run([sys.executable, str(script), "--only", "random_bits.int64.stream", "--arch", "90",
                          "--cache", "--full"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "| random_bits.int64.stream |" in run.stdout and "spill 0" in run.stdout


# --- stock Inductor's kernel of the same graph --------------------------------------------


def test_stock_inductor_generates_one_random_kernel_per_graph_with_its_configs():
    """What ``aot_gpu.py --per-element`` compiles for stock Inductor: the graph lowered as
    torch.compile would (decompositions, Inductor's own random), on a fake H100, gives one
    Triton kernel that draws in the kernel, and the autotune configs divide it into whole
    programs of whole threads (the per-element count's divisor)."""
    import torch.nn.functional  # noqa: F401 - the graphs are F.dropout's and rand_like's

    import fake_cuda_inductor

    n = 1 << 20
    for dtype in (torch.float32, torch.bfloat16):
        for fn in (lambda x: torch.rand_like(x), lambda x: torch.native_dropout(x, 0.3, True)):
            code = fake_cuda_inductor.generated_code(fn, [((n,), dtype)], as_compiled=True)
            ((name, source),) = fake_cuda_inductor.triton_kernels(code).items()
            assert "inductor_random" in name and ("rand4x(" in source or "tl.rand(" in source)
            configs = fake_cuda_inductor.launch_configs(source)
            assert configs
            for config in configs:
                xblock, warps = config["kwargs"]["XBLOCK"], config["num_warps"]
                assert n % xblock == 0 and xblock % (32 * warps) == 0, config
                inputs = fake_cuda_inductor.compile_inputs(source, config)
                assert inputs["constants"]["XBLOCK"] == xblock and inputs["options"]["num_warps"] == warps
                assert inputs["signature"]["XBLOCK"] == "constexpr"


def test_per_element_reports_compile_rng_and_stock_inductor():
    """``aot_gpu.py --per-element`` on one row: compile_rng's eager kernel, its draw inside
    a graph's Inductor kernel and stock Inductor's (each autotune config), all compiled for
    sm_90 and walked the same way."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "aot_gpu.py"
    run = subprocess.run([sys.executable, str(script), "--only", "dropout.float32.stream", "--arch", "90",
                          "--cache", "--per-element"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    count = r"([\d.]+) \(\d+ regs[^|]*\| "
    row = re.search(r"^\| dropout \| float32 \| 9 \| " + 3 * count + r"([\d.]+) \| ([\d.]+) \|", run.stdout, re.M)
    assert row, run.stdout
    ours, graph, stock, ratio, graph_ratio = map(float, row.groups())
    # hot paths of a few dozen instructions, not a walk gone astray
    assert 0 < ours < 200 and 0 < graph < 200 and 0 < stock < 1000
    assert abs(ratio - ours / stock) < 0.01 and abs(graph_ratio - graph / stock) < 0.01
    assert "- stock Inductor dropout float32 (XBLOCK" in run.stdout
    assert "- compile_rng in a graph dropout float32 (XBLOCK" in run.stdout


@pytest.mark.slow
def test_the_normal_transform_study_runs():
    """``benchmarks/normal_transform_study.py`` (issue 64's contract data): its kernels compile
    for sm_90, its models of stream v1's formula (polynomials) and of an angle from the
    word's bits stay within the 4-ulp bound of float64 math, and its kernels, launched in
    Triton's interpreter, write their models' bits."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "normal_transform_study.py"
    run = subprocess.run([sys.executable, str(script), "--pairs", "4096"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {m[0]: (float(m[1]), m[2]) for m in re.findall(r"^\| ([^|]+?) \| [^|]+ \| ([\d.]+) \| \d+ \| ([^|]+?) \|$",
                                                        run.stdout, re.M)}
    assert set(rows) == {"libdevice (today)", "v1 polynomials", "v2 bits angle", "no transform (words as uniforms)"}
    assert float(rows["v1 polynomials"][1]) <= 4 and float(rows["v2 bits angle"][1]) <= 4
    assert rows["no transform (words as uniforms)"][0] < rows["v1 polynomials"][0] < rows["libdevice (today)"][0]
    # launched in Triton's interpreter: every modelled variant's values are its model's bits
    # (the interpreter's fma rounding twice, as the model then does), at the canonical words
    run = subprocess.run([sys.executable, str(script), "--run", "interpreter"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    launched = dict(re.findall(r"^\| ([^|]+?) \| (\d+|-) \|", run.stdout, re.M))
    assert launched == {"libdevice (today)": "-", "v1 polynomials": "0", "v2 bits angle": "0",
                        "no transform (words as uniforms)": "0"}


_STATIC_ARG_TYPES = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from compile_rng import ops
from compile_rng._torch import inductor_internals, triton_internals
from compile_rng.stream import triton_kernels as tk

x = torch.randn(4096).bfloat16()
(step,) = tk.plan(tk.DROPOUT, torch.empty_like(x), ops.make_key(1, 0), 0, [1], mask=torch.empty(4096, dtype=torch.bool),
                  source=x, a=2.0, i_a=5)
bound = triton_internals.bind(tk._stream_kernel, 90, step.args, {**dict(step.constexprs), **tk.OPTIONS})
kernel = inductor_internals.static_cuda_kernel(triton_internals.compiled_kernel(tk._stream_kernel, bound, 90))
print(kernel.arg_tys, kernel.num_warps)
"""


def test_torchs_static_launcher_reads_the_kernels_arguments():
    """The GPU check times the eager kernel launched by torch's static CUDA launcher
    (Inductor's route past Triton's Python launcher, ``bench_gpu.py --host``): the launcher's
    reading of a compiled sm_90 variant (no GPU: nothing loaded) takes one argument per
    non-constexpr parameter of the kernel, typed as the kernel declares it - a pointer
    for each tensor, int64 and int32 scalars as annotated - and the launch's warps."""
    import subprocess
    import sys

    fn = triton_internals.jit_function(tk._stream_kernel)
    codes = {"": "O", "i64": "l", "i32": "i"}  # the parameters as Triton reads their annotations
    want = "".join(codes[p.annotation] for p in fn.params
                   if not p.is_constexpr)
    run = subprocess.run([sys.executable, "-c", _STATIC_ARG_TYPES], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [want, str(tk.OPTIONS["num_warps"])]
    assert want == "OOOOlllliiilllllll"  # 4 tensors, then the scalars in the kernel's order
