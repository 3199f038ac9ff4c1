"""Test helpers shared by the test modules (independent of compile_rng's code)."""

import struct

import pytest
import torch

SEEDS = [0, 1, 0xDEADBEEF12345678, 2**63 + 5, 2**64 - 1]

#: torch 2.12's Inductor puts ``compile_fx``'s local ``get_decomp_fn`` (made when a backend
#: passes ``decompositions=``, as compile_rng's does) into its FX-graph cache key, which then
#: fails to pickle: the cache is bypassed for those graphs ("Failed to pickle cache key";
#: 2.11 and 2.13+ do not). Tests of that cache's outcomes skip there.
FX_CACHE_BYPASSED_ON_212 = pytest.mark.skipif(
    torch.__version__.startswith("2.12"),
    reason="torch 2.12's FX-graph cache key holds compile_fx's local get_decomp_fn, which does not pickle: bypassed",
)
BASES = [0, 1, 3, 2**32 - 5, 2**63 + 7, 2**64 - 6]


def f32(x: float) -> float:
    """Round a Python float to float32 (independent of compile_rng)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def ref_tensor(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in units in the last place between same-dtype float tensors."""
    assert a.dtype == b.dtype
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64,
                 torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    ia, ib = a.view(int_dtype).long(), b.view(int_dtype).long()
    # map the sign-magnitude float order onto integers
    sign = torch.iinfo(int_dtype).min
    ia = torch.where(ia < 0, sign - ia, ia)
    ib = torch.where(ib < 0, sign - ib, ib)
    return int((ia - ib).abs().max()) if a.numel() else 0



def cache_outcome(compile_and_run) -> str:
    """Run ``compile_and_run`` (a fresh ``torch.compile`` and its call) after
    ``torch._dynamo.reset()``: ``"served"`` where the compile caches served its graphs
    (AOTAutograd's cache, or Inductor's FX-graph cache for every graph), ``"compiled"``
    where Inductor compiled one and filed it, ``"bypassed"`` where the caches were not asked."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compile_and_run()
    aot, fx = dict(counters["aot_autograd"]), dict(counters["inductor"])
    if aot.get("autograd_cache_hit") or (fx.get("fxgraph_cache_hit") and not fx.get("fxgraph_cache_miss")):
        return "served"
    if fx.get("fxgraph_cache_miss"):
        return "compiled"
    assert fx.get("fxgraph_cache_bypass"), f"no cache outcome: {aot}, {fx}"
    return "bypassed"
