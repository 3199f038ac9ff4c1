"""The parts of the CUDA path that run without a GPU.

* DTensor's accelerator branch (``_dispatch.py``: ``_compute_rng_offsets(spec)`` then
  ``run_dtensor_rng_op``), called as DTensor calls it for a CUDA DTensor, on the local
  shards of a CPU mesh (fake process group, 4 ranks): same values and state advance as
  the tracker's region, so a CUDA mesh gets compile_rng's semantics.
* The backend on a graph whose inputs are fake CUDA tensors: the key is a CUDA input,
  every random op is functional and reads it (no generator, no ``run_dtensor_rng_op``).
* Eager plain-tensor ops draw from the stream of their own device; meta tensors draw nothing.
* What Inductor generates for a CUDA graph (on fake tensors, for an H100, nothing launched:
  ``fake_cuda_inductor``): the random ops stay calls of the Triton kernels, the code that is
  checked (interpreter, AOT compile). The fused lowering's own CUDA code, which compiled
  graphs do not use, is checked too: bitwise in the interpreter and compiled for sm_90.
"""

from __future__ import annotations

import pytest
import torch
from dtensor_reference import accelerator_branch, ceil4, fake_rank, local_zeros, needs_accelerator_branch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import compile_rng
from compile_rng.eager import dispatch_modes, tracker
from compile_rng.compiled import key_input
from compile_rng._torch import dtensor_internals

WORLD = 4
aten = torch.ops.aten


@needs_accelerator_branch
@pytest.mark.parametrize("op", ["uniform_", "native_dropout"])
def test_the_accelerator_branch_runs_in_the_trackers_region(op):
    for rank in range(WORLD):
        with fake_rank(rank, WORLD):
            mesh = DeviceMesh("cpu", list(range(WORLD)))
            results = []
            for branch in ("region", "accelerator"):
                compile_rng.manual_seed(7)
                x = local_zeros((10, 6), mesh, [Shard(0)]) + 1.0
                if branch == "region":  # DTensor's CPU dispatch
                    out = x.uniform_(-1.0, 1.0) if op == "uniform_" else torch.ops.aten.native_dropout(x, 0.3, True)[0]
                    results.append((out.to_local().clone(), compile_rng.get_state()))
                else:
                    local = x.to_local().clone()
                    if op == "uniform_":
                        out = accelerator_branch(x, aten.uniform_.default, local, -1.0, 1.0)
                    else:
                        out = accelerator_branch(x, aten.native_dropout.default, local, 0.3, True)[0]
                    results.append((out, compile_rng.get_state()))
            (want, want_state), (got, got_state) = results
            assert torch.equal(got, want)
            assert got_state == want_state == (7, 60)  # ceil4(10 * 6) on every rank


@needs_accelerator_branch
def test_the_hook_leaves_other_offsets_to_torch_and_uninstall_restores_it():
    calls = []
    hook = tracker.run_dtensor_rng_op_hook(lambda *a, **k: calls.append((a, k)) or "stock")
    assert hook(0, 8, aten.rand.default, [2]) == "stock" and calls == [((0, 8, aten.rand.default, [2]), {})]
    installed = dtensor_internals.dtensor_dispatch().run_dtensor_rng_op
    compile_rng.uninstall()
    try:
        assert dtensor_internals.dtensor_dispatch().run_dtensor_rng_op is installed._compile_rng_stock
    finally:
        compile_rng.install()
    assert dtensor_internals.dtensor_dispatch().run_dtensor_rng_op._compile_rng_stock is installed._compile_rng_stock


def test_a_cuda_graph_gets_a_cuda_key_and_only_functional_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x):
        return (torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x) + torch.randn(3, 4, device=x.device),)

    with FakeTensorMode():
        x = torch.empty(3, 4, device="cuda")
    gm = torch.fx.symbolic_trace(f)
    assert key_input.graph_device(gm, [x]) == torch.device("cuda", 0)
    be = compile_rng.backend(inner="aot_eager")
    be(gm, [x])
    (plan,) = be.plans
    (graph,) = plan.graphs
    # dropout(x), rand_like(x), randn(3, 4): three draws of ceil4(12) counters
    assert plan.total_advance == 3 * ceil4(x.numel())
    assert "torch.ops.compile_rng.dropout" in graph and "torch.ops.compile_rng.normal" in graph
    assert "aten.rand" not in graph and "native_dropout" not in graph and "run_dtensor_rng_op" not in graph


def test_eager_plain_ops_draw_on_their_device_and_meta_draws_nothing():
    with dispatch_modes.eager_stream():
        t = torch.rand(5, device="meta")
        assert t.device.type == "meta"
        assert compile_rng.get_state() == (0, 0)
        u = torch.rand(5)
    assert u.device.type == "cpu" and compile_rng.get_state() == (0, ceil4(5))  # only the CPU draw advances


# --- Inductor's code for a CUDA graph ----------------------------------------------------

PHILOX_MULTIPLIERS = ("3528531795", "3449720151")  # 0xD2511F53, 0xCD9E8D57 as Inductor prints them
_OPS = torch.ops.compile_rng
_F32, _I64 = torch.float32, torch.int64


def _dropout_graph(key, x):
    out, mask = _OPS.dropout(key, 5, x, [1], 0.3)
    return out * 2 + 1, mask


#: Graphs of compile_rng's ops on a CUDA key, and their inputs other than the key:
#: ``(shape, dtype, low, high)``, drawn from a CPU generator. Offsets and counter strides
#: are odd (lanes, transposed counters), the seed's and base's high bits set, so the 64-bit
#: carries and every lane are exercised.
FUSED_GRAPHS = {
    "dropout, then pointwise": (_dropout_graph, [((1000,), _F32, -3, 3)]),
    "dropout + residual": (lambda key, x, r: (lambda out, mask: (out + r, mask))(*_OPS.dropout(key, 3, x, [1], 0.1)),
                           [((999,), _F32, -3, 3), ((999,), _F32, -3, 3)]),
    # Inductor computes a bf16 chain in fp32 and rounds once: the op's own outputs here
    "dropout, bf16": (lambda key, x: _OPS.dropout(key, 3, x, [1], 0.1), [((999,), torch.bfloat16, -3, 3)]),
    "uniform, transposed counters": (lambda key: (_OPS.uniform(key, 3, [10, 100], [1, 10], -2.0, 2.0, _F32),), []),
    # every lane's counter a multiple of four: whole blocks only were the lanes consecutive
    "uniform, every fourth counter": (lambda key: (_OPS.uniform(key, 3, [256], [4], 0.0, 1.0, _F32),), []),
    "uniform, fp16": (lambda key: (_OPS.uniform(key, 1, [1001], [1], 0.0, 1.0, torch.float16),), []),
    "uniform, fp64": (lambda key: (_OPS.uniform(key, 2, [333], [1], -1.0, 1.0, torch.float64),), []),
    "bernoulli": (lambda key: (_OPS.bernoulli(key, 7, [999], [1], 0.25, _F32),), []),
    "bernoulli, tensor p": (lambda key, p: (_OPS.bernoulli_tensor(key, 1, p, [1], _F32),), [((777,), _F32, 0, 1)]),
    "randint, small range": (lambda key: (_OPS.randint(key, 2, [500], [1], -5, 7, _I64),), []),
    "randint, range above 2**32": (lambda key: (_OPS.randint(key, 6, [500], [1], -(2**40), 2**41, _I64),), []),
    "random_bits": (lambda key: (_OPS.random_bits(key, 9, [501], [1]),), []),
}


def _inputs(specs, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
            for shape, dtype, low, high in specs]


def test_a_compiled_cuda_graph_draws_in_its_consumers_kernel():
    """On CUDA the draw is generated inside Inductor's Triton kernel with what reads it:
    a dropout and the pointwise ops after it are one kernel, no call of the op's own kernel,
    and so is ``dropout(x) + residual``."""
    pytest.importorskip("triton")
    import fake_cuda_inductor

    from compile_rng.ops import lowering

    assert "cuda" in lowering.FUSED_DEVICE_TYPES
    for name in ("dropout, then pointwise", "dropout + residual"):
        fn, specs = FUSED_GRAPHS[name]
        code = fake_cuda_inductor.generated_code(fn, [((2,), _I64)] + [(s, d) for s, d, *_ in specs])
        assert ".default(key_1" not in code, name  # no call of an op's kernel
        ((source),) = fake_cuda_inductor.triton_kernels(code).values()
        assert all(m in source for m in PHILOX_MULTIPLIERS), name


def test_a_uniform_whose_scaling_an_fma_would_round_and_exponential_call_the_eager_kernel():
    """``u * (high - low) + low``: Inductor's Triton lets ptxas contract it into an FMA,
    which rounds once where the contract rounds twice, so a CUDA graph calls the eager
    kernel (compiled without contraction) unless ``low`` is 0 or the product is exact."""
    pytest.importorskip("triton")
    import fake_cuda_inductor

    from compile_rng.ops import lowering  # noqa: F401 - registers the lowerings

    def graph(low, high):
        return lambda key: (_OPS.uniform(key, 3, [64], [1], low, high, _F32) * 2,)

    for (low, high), fused in {(0.0, 3.0): True, (-2.0, 2.0): True, (-2.0, 3.0): False, (-0.1, 0.1): False}.items():
        code = fake_cuda_inductor.generated_code(graph(low, high), [((2,), _I64)])
        assert ("torch.ops.compile_rng.uniform.default(" not in code) == fused, (low, high)
    # exponential's log, too, is the eager kernel's on CUDA (the one the GPU suite checks)
    code = fake_cuda_inductor.generated_code(lambda key: (_OPS.exponential(key, 1, [64], [1], 2.0, _F32) * 2,),
                                             [((2,), _I64)])
    assert "torch.ops.compile_rng.exponential.default(" in code


def test_the_fma_rule_holds_on_the_extreme_draws():
    """The rule above, checked on numbers: where it says exact, ``u * span`` in float32
    equals the float64 product for the largest and a spread of ``u``; where it says not,
    one of them is inexact (so the rule is not merely conservative)."""
    from compile_rng import stream
    from compile_rng.ops import lowering

    cuda = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bits = stream.UNIFORM_BITS[dtype]
        k = torch.cat([torch.arange(2**bits - 257, 2**bits), torch.arange(1, 2**bits, max(1, 2**bits // 4099))])
        u = k.double() * 2.0**-bits
        for span in (1.0, 4.0, 6.0, 0.2, 5.0, 2.0 / 3.0, 1e-40):
            span32 = float(torch.tensor(span, dtype=torch.float32))
            exact = torch.equal((u.float() * span32).double(), u * span32)
            assert lowering._scaling_exact(cuda, -span / 2, span / 2, dtype) == exact, (dtype, span)


@pytest.mark.parametrize("name", list(FUSED_GRAPHS))
def test_the_generated_cuda_kernels_give_the_eager_ops_bits(name, tmp_path):
    """The Triton Inductor generates for each op of a CUDA graph - Philox on int32 words,
    one wrapping 64-bit product per multiply - run in Triton's interpreter (on a GPU where
    there is one), bitwise equal to the eager op on the CPU (the C kernel, checked apart
    against the scalar reference)."""
    pytest.importorskip("triton")
    import fake_cuda_inductor

    from compile_rng import ops
    from compile_rng.ops import lowering  # noqa: F401 - registers the lowerings

    fn, specs = FUSED_GRAPHS[name]
    key, args = ops.make_key(2**63 + 0x5EED, 2**64 - 7), _inputs(specs)
    code = fake_cuda_inductor.generated_code(fn, [((2,), _I64)] + [(s, d) for s, d, *_ in specs])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = fake_cuda_inductor.interpret(code, [t.to(dev) for t in (key, *args)], str(tmp_path))
    want = fn(key, *args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, name
        if g.dtype == torch.bfloat16 and dev == "cpu":
            # Triton's interpreter truncates the store's float32 -> bfloat16 cast (GPUs
            # round to nearest even, as torch does): the bf16 values are checked on a GPU
            continue
        if name == "dropout + residual" and g.dtype == _F32 and dev == "cuda":
            # the add after the draw: Inductor lets ptxas contract it with the dropout's
            # scaling into an FMA (stock Inductor's graphs alike), which skips rounding the
            # dropout's output (half its ulp at most: |x / 0.9| < 4), so the sum may round
            # to its neighbour; the mask is bitwise (on an H200: 61 of 999 sums differed,
            # by 2**-23 at most)
            torch.testing.assert_close(g.cpu(), w, rtol=2**-23, atol=2**-23)
            continue
        assert torch.equal(g.cpu(), w), name


#: Graphs whose counters start a Philox block (base + offset = 0 mod 2**64 or 2**64 - 4: the
#: key of the test above, wrapping past 2**64) and run on in order, and graphs whose do not.
ALIGNED = ("dropout + residual", "bernoulli")
NOT_ALIGNED = ("dropout, then pointwise", "uniform, transposed counters", "uniform, every fourth counter")


@pytest.mark.parametrize("xblock", [1024, 16, 4, 2])
def test_four_lanes_share_a_philox_block_where_their_counters_are_one(xblock, tmp_path, monkeypatch):
    """A fused kernel draws one Philox block per four lanes where a program's lanes hold
    whole blocks in order (``compile_rng.ops.triton_words``), else a block per lane. With
    the per-lane path broken (every word 0), the aligned graphs still give the eager ops'
    bits in programs of 4 lanes or more - the shared path drew them, tail included (999
    elements) - and the others do not: each path is the one taken where it should be."""
    pytest.importorskip("triton")
    import fake_cuda_inductor

    from compile_rng import ops
    from compile_rng.ops import lowering, triton_words  # noqa: F401 - registers the lowerings

    broken = triton_words._LANES.replace("return word", "return word * 0")
    assert broken != triton_words._LANES
    monkeypatch.setattr(triton_words, "_LANES", broken)
    key = ops.make_key(2**63 + 0x5EED, 2**64 - 7)
    for name in ALIGNED + NOT_ALIGNED:
        fn, specs = FUSED_GRAPHS[name]
        args = _inputs(specs)
        code = fake_cuda_inductor.generated_code(fn, [((2,), _I64)] + [(s, d) for s, d, *_ in specs])
        got = fake_cuda_inductor.interpret(code, [key, *args], str(tmp_path), xblock=xblock)
        shared = name in ALIGNED and xblock >= 4
        assert all(torch.equal(g, w) for g, w in zip(got, fn(key, *args))) == shared, name


def test_the_kernel_says_where_its_lanes_hold_consecutive_counters():
    """The kernel draws from the program's first counter, with no lane checked, exactly where
    it computed the counters as a number plus its block's index: a stream, whatever its
    offset; not a transposed or strided window, whose check of every lane the values above
    depend on."""
    pytest.importorskip("triton")
    import re

    import fake_cuda_inductor

    from compile_rng.ops import lowering  # noqa: F401 - registers the lowerings

    consecutive = {"dropout, then pointwise", "dropout + residual", "dropout, bf16", "uniform, fp16",
                   "uniform, fp64", "bernoulli", "bernoulli, tensor p"}
    for name in consecutive | {"uniform, transposed counters", "uniform, every fourth counter"}:
        fn, specs = FUSED_GRAPHS[name]
        code = fake_cuda_inductor.generated_code(fn, [((2,), _I64)] + [(s, d) for s, d, *_ in specs])
        from_first = re.findall(r"= compile_rng_words_from\d+\(\w+, \(\w+ \+ \(\d+ \+ xoffset\)\), XBLOCK\)", code)
        checked = re.findall(r"= compile_rng_word\d+\(\w+, \(\w+ \+ \w+\), XBLOCK\)", code)
        assert (len(from_first), len(checked)) == ((1, 0) if name in consecutive else (0, 1)), (name, code)


def test_a_kernel_without_helpers_draws_the_eager_bits_inline(tmp_path, monkeypatch):
    """A template's epilogue (a matmul's, under max-autotune) is rendered from its template,
    without the helper functions a kernel's source holds: there the words are computed by
    lines in the kernel's body, a block per lane - run here on the generated 1-D kernels
    (told they hold no helpers), bitwise equal to the eager ops. (No template kernel is
    generated without a GPU to tune on: the detection itself is unchecked here.)"""
    pytest.importorskip("triton")
    import fake_cuda_inductor

    from compile_rng import ops
    from compile_rng._torch import inductor_internals
    from compile_rng.ops import lowering  # noqa: F401 - registers the lowerings

    monkeypatch.setattr(inductor_internals, "triton_kernel_holds_helpers", lambda: False)
    key = ops.make_key(2**63 + 0x5EED, 2**64 - 7)
    for name in ALIGNED + NOT_ALIGNED:
        fn, specs = FUSED_GRAPHS[name]
        args = _inputs(specs)
        code = fake_cuda_inductor.generated_code(fn, [((2,), _I64)] + [(s, d) for s, d, *_ in specs])
        assert "@triton.jit\ndef compile_rng" not in code and "compile_rng_0_word" in code, name
        got = fake_cuda_inductor.interpret(code, [key, *args], str(tmp_path))
        assert all(torch.equal(g, w) for g, w in zip(got, fn(key, *args))), name


#: Compiles a generated kernel for sm_90 in a process without the interpreter, as the
#: autotuner's first config would; prints ``ptxas -v``'s resources, the cubin's registers
#: and its SASS length as JSON.
_AOT_SCRIPT = """
import json, sys
from compile_rng.debug import gpu_aot
path, name, inputs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
inputs["attrs"] = {tuple(k): v for k, v in inputs["attrs"]}
resources, asm = gpu_aot.compile_source(path, name, 90, **inputs)
_, registers, instructions = gpu_aot.inspect(asm, 90, inputs["options"])
print(json.dumps([resources.registers, resources.spills, registers, instructions]))
"""


@pytest.mark.parametrize("graph", ["1-D dropout", "2-D: a row's normalization, then dropout"])
def test_the_generated_dropout_kernel_compiles_for_sm90_without_spills(graph, tmp_path):
    """The fused dropout Inductor generates for a CUDA graph compiles ahead of time for
    sm_90 (in a process without the interpreter) with no spills: a 1-D pointwise kernel
    (four lanes share a Philox block) and a 2-D persistent reduction (a block per lane)."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys

    import fake_cuda_inductor

    from compile_rng.ops import lowering  # noqa: F401 - registers the lowerings

    if graph == "1-D dropout":
        fn, specs = FUSED_GRAPHS["dropout, then pointwise"]
        inputs = [(s, d) for s, d, *_ in specs]
    else:
        fn, inputs = (lambda key, x: (_OPS.dropout(key, 0, x / x.sum(-1, keepdim=True), [64, 1], 0.3)[0],)), [((64, 64), _F32)]
    code = fake_cuda_inductor.generated_code(fn, [((2,), _I64)] + inputs)
    ((name, source),) = fake_cuda_inductor.triton_kernels(code).items()
    import re

    if graph == "1-D dropout":  # consecutive counters: no lane checked
        assert re.search(r"= compile_rng_words_from\d+\(\w+, \(\w+ \+ \(\d+ \+ xoffset\)\), XBLOCK\)", source), source
    else:  # the 2-D tile: a block per lane
        assert re.search(r"= compile_rng_word\d+\(\w+, \(\w+ \+ \w+\), 1\)", source), source
    path = tmp_path / "generated_kernel.py"
    path.write_text(fake_cuda_inductor.jit_source(source))
    inputs = fake_cuda_inductor.compile_inputs(source, fake_cuda_inductor.launch_configs(source)[0])
    inputs["attrs"] = [[list(k), v] for k, v in inputs["attrs"].items()]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, str(path), name, json.dumps(inputs)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    registers, spills, cubin_registers, instructions = json.loads(done.stdout.strip().splitlines()[-1])
    assert spills == 0 and registers == cubin_registers and instructions > 0


def test_uninstall_takes_the_inductor_op_back_and_the_next_cuda_graph_adds_it_again():
    """``ops.compile_rng_word`` is in Inductor's op handlers from the first lowering of a
    CUDA graph's draw until ``uninstall()``, which takes it back; a later CUDA graph's
    lowering adds it again."""
    pytest.importorskip("triton")
    import fake_cuda_inductor
    from torch._inductor.codegen.triton import TritonOverrides
    from torch._inductor.ops_handler import DefaultHandler

    from compile_rng.ops import lowering, triton_words  # noqa: F401 - registers the lowerings

    fn, specs = FUSED_GRAPHS["dropout + residual"]
    inputs = [((2,), _I64)] + [(s, d) for s, d, *_ in specs]
    fake_cuda_inductor.generated_code(fn, inputs)
    assert triton_words.OP in vars(TritonOverrides) and triton_words.OP in vars(DefaultHandler)
    compile_rng.uninstall()
    try:
        assert triton_words.OP not in vars(TritonOverrides) and triton_words.OP not in vars(DefaultHandler)
        assert "compile_rng_word" in fake_cuda_inductor.generated_code(fn, inputs)
        assert triton_words.OP in vars(TritonOverrides)
    finally:
        compile_rng.install()
