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


def _dropout_graph(key, x):
    out, mask = torch.ops.compile_rng.dropout(key, 5, x, [1], 0.3)
    return out * 2 + 1, mask


_DROPOUT_INPUTS = [((2,), torch.int64), ((1000,), torch.float32)]


def test_a_compiled_cuda_graph_calls_the_triton_kernels_not_a_fused_loop():
    pytest.importorskip("triton")
    import fake_cuda_inductor

    from compile_rng.ops import lowering

    assert lowering.FUSED_DEVICE_TYPES == ("cpu",)
    code = fake_cuda_inductor.generated_code(_dropout_graph, _DROPOUT_INPUTS)
    assert "torch.ops.compile_rng.dropout.default(key_1, 5, x_1, [1], 0.3)" in code
    kernels = fake_cuda_inductor.triton_kernels(code)
    assert len(kernels) == 1  # the `* 2 + 1`
    assert not any(m in src for src in kernels.values() for m in PHILOX_MULTIPLIERS)


#: Compiles a generated kernel for sm_90 in a process without the interpreter; prints
#: ``ptxas -v``'s resources, the cubin's registers and its SASS length as JSON.
_AOT_SCRIPT = """
import importlib.util, json, sys
from compile_rng.debug import gpu_aot
from compile_rng._torch import triton_internals
path, name, meta = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = importlib.util.spec_from_file_location("generated", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
attrs = {tuple(k): v for k, v in meta["attrs"]}
bound = triton_internals.Bound(meta["signature"], {"XBLOCK": meta["XBLOCK"]}, attrs, meta["options"])
asm = triton_internals.compile_for(getattr(module, name), bound, 90)
resources, registers, instructions = gpu_aot.inspect(asm, 90, meta["options"])
print(json.dumps([resources.registers, resources.spills, registers, instructions]))
"""


def test_the_fused_lowerings_cuda_code_is_bitwise_and_compiles_for_sm90(monkeypatch, tmp_path):
    """Option kept open, not shipped: with the fused loops turned on for CUDA graphs, the
    Triton code Inductor generates for a dropout gives the reference's bits in Triton's
    interpreter and compiles for sm_90 without spills."""
    pytest.importorskip("triton")
    import importlib.util
    import json
    import os
    import re
    import subprocess
    import sys

    import fake_cuda_inductor

    from compile_rng.ops import lowering
    from compile_rng import ops

    monkeypatch.setattr(lowering, "FUSED_DEVICE_TYPES", ("cpu", "cuda"))
    with lowering.fused_loops():  # whatever this CPU's rule for a kernel call
        code = fake_cuda_inductor.generated_code(lambda key, x: torch.ops.compile_rng.dropout(key, 5, x, [1], 0.3),
                                                 _DROPOUT_INPUTS)
    assert "torch.ops.compile_rng.dropout.default(" not in code  # fused: no call of the op
    ((name, source),) = fake_cuda_inductor.triton_kernels(code).items()
    assert all(m in source for m in PHILOX_MULTIPLIERS)
    path = tmp_path / "generated_kernel.py"
    path.write_text(fake_cuda_inductor.jit_source(source))

    # Bitwise: in Triton's interpreter (conftest set TRITON_INTERPRET=1 where there is no
    # GPU), or on the GPU.
    spec = importlib.util.spec_from_file_location("generated_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    key = ops.make_key(2**63 + 0x5EED, 2**32 - 7)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    out, mask = torch.empty(1000, device=dev), torch.empty(1000, dtype=torch.bool, device=dev)
    tensors = {"key_1": key.to(dev), "x_1": x.to(dev), "buf0": out, "buf1": mask}
    call = re.search(rf"{name}\.run\((.*?), stream=", code).group(1).split(", ")
    xblock = 1024  # Inductor's usual pointwise block for 1000 elements, 4 warps
    getattr(module, name)[(1,)](*[tensors[a] if a in tensors else int(a) for a in call], XBLOCK=xblock)
    want_out, want_mask = ops.dropout(key, 5, x, [1], 0.3)
    assert torch.equal(out.cpu(), want_out) and torch.equal(mask.cpu(), want_mask)

    # Ahead of time for sm_90, in a process without the interpreter.
    meta = fake_cuda_inductor.triton_meta(source)
    payload = {
        "signature": {k: v for k, v in meta["signature"].items() if v != "constexpr"} | {"XBLOCK": "constexpr"},
        "attrs": [[list(k), v] for k, v in meta["configs"][0].items()],
        "options": {"num_warps": 4, "enable_fp_fusion": meta["enable_fp_fusion"]},
        "XBLOCK": xblock,
    }
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, str(path), name, json.dumps(payload)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    registers, spills, cubin_registers, instructions = json.loads(done.stdout.strip().splitlines()[-1])
    assert spills == 0 and registers == cubin_registers and instructions > 0
