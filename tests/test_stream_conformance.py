"""Every implementation of canonical stream v1 (``compile_rng.stream.IMPLEMENTATIONS``:
the C kernel's scalar walk and vectorized batches, Inductor's lowering) against the
independent scalar reference (``tests/reference.py``), which is itself first checked
against the Random123 known-answer vectors.

Bitwise for every value derived from integers (words, uniforms, masks, integers,
dropout); the transcendental transforms (normal, exponential) within a tolerance, since
the reference uses exact float64 math.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
from helpers import f32, ref_tensor

from compile_rng import ops, stream
from compile_rng.ops import lowering  # noqa: F401  (each registers its implementation)
from compile_rng.stream import accelerator_ops  # noqa: F401

# (seed, base): both halves of the key, a block-index carry across 2**32, counters past
# 2**63 with a seed past 2**63, the counter wrapping past 2**64 inside an op.
KEYS = [(0, 0), (0xDEADBEEF12345678, 2**32 - 5), (2**63 + 0x1234, 2**63 + 7), (2**64 - 1, 2**64 - 6)]
P_DROP, P_BERN, LAMBD = 0.3, 0.25, 1.5


@pytest.mark.parametrize("ctr,key,expected", ref.KAT)
def test_the_reference_matches_random123_known_answers(ctr, key, expected):
    assert ref.philox4x32_10(ctr, key) == expected


def _program(size: tuple, strides: tuple):
    def program(key, p, x):
        drop, mask = ops.dropout(key, 0, x, list(strides), P_DROP)
        return {
            "bits": ops.random_bits(key, 0, list(size), list(strides)),
            "u16": ops.uniform(key, 0, list(size), list(strides), 0.0, 1.0, torch.float16),
            "ubf": ops.uniform(key, 0, list(size), list(strides), 0.0, 1.0, torch.bfloat16),
            "u32": ops.uniform(key, 0, list(size), list(strides), 0.0, 1.0, torch.float32),
            "u64": ops.uniform(key, 0, list(size), list(strides), 0.0, 1.0, torch.float64),
            "u32_bounds": ops.uniform(key, 0, list(size), list(strides), -2.0, 3.0, torch.float32),
            "n32": ops.normal(key, 0, list(size), list(strides), 0.0, 1.0, torch.float32),
            "n64": ops.normal(key, 0, list(size), list(strides), 0.0, 1.0, torch.float64),
            "e64": ops.exponential(key, 0, list(size), list(strides), LAMBD, torch.float64),
            "bern": ops.bernoulli(key, 0, list(size), list(strides), P_BERN, torch.float32),
            "bern_t": ops.bernoulli_tensor(key, 0, p, list(strides), torch.float32),
            "drop": drop,
            "mask": mask,
            "int": ops.randint(key, 0, list(size), list(strides), -5, 11, torch.int64),
            "int_big": ops.randint(key, 0, list(size), list(strides), -(2**40), 2**41, torch.int64),
        }

    return program


def _uniform_bounded(seed: int, c: int) -> float:
    v = f32(f32(ref.uniform01(seed, c, "float32") * f32(5.0)) + f32(-2.0))
    return -2.0 if v >= 3.0 else v


def _check(got: dict, seed: int, counters: list[int], p: torch.Tensor, x: torch.Tensor) -> None:
    def exact(name, values, dtype):
        assert torch.equal(got[name].flatten(), ref_tensor(values, dtype)), name

    def close(name, values, tol):
        want = torch.tensor(values, dtype=torch.float64)
        assert (got[name].double().flatten() - want).abs().max() <= tol, name

    assert got["bits"].flatten().tolist() == [ref.bits64(seed, c) for c in counters]
    for name, dtype in (("u16", "float16"), ("ubf", "bfloat16"), ("u32", "float32"), ("u64", "float64")):
        exact(name, [ref.uniform01(seed, c, dtype) for c in counters], getattr(torch, dtype))
    exact("u32_bounds", [_uniform_bounded(seed, c) for c in counters], torch.float32)
    close("n32", [ref.normal_std(seed, c) for c in counters], 2e-4)
    close("n64", [ref.normal_std(seed, c) for c in counters], 1e-12)
    close("e64", [ref.exponential(seed, c, LAMBD) for c in counters], 1e-12)
    exact("bern", [float(ref.keep_bernoulli(seed, c, P_BERN)) for c in counters], torch.float32)
    probs = p.flatten().tolist()
    exact("bern_t", [float(ref.keep_bernoulli(seed, c, q)) for c, q in zip(counters, probs)], torch.float32)
    keep = [ref.keep_bernoulli(seed, c, 1 - P_DROP) for c in counters]
    assert got["mask"].flatten().tolist() == keep
    # ATen's CPU dropout composite: noise = bernoulli(1 - p) in x's dtype, / (1 - p), x * noise
    noise = torch.tensor(keep, dtype=x.dtype).view_as(x)
    assert torch.equal(got["drop"], x * noise.div_(1 - P_DROP))
    assert got["int"].flatten().tolist() == [ref.randint(seed, c, -5, 11) for c in counters]
    assert got["int_big"].flatten().tolist() == [ref.randint(seed, c, -(2**40), 2**41) for c in counters]


def test_every_implementation_registers_itself():
    assert sorted(impl.name for impl in stream.IMPLEMENTATIONS) == ["c-scalar", "c-vectorized", "inductor-lowering", "triton"]


@pytest.mark.parametrize("impl", stream.IMPLEMENTATIONS, ids=lambda i: i.name)
def test_implementation_conforms_to_the_scalar_reference(impl):
    if impl.requires:
        pytest.importorskip(impl.requires)
    gen = torch.Generator().manual_seed(0)
    for size, strides in impl.layouts:
        program = impl.run(_program(size, strides))
        p = torch.rand(size, generator=gen, dtype=torch.float64)
        x = torch.randn(size, generator=gen)
        for seed, base in KEYS:
            got = program(ops.make_key(seed, base), p, x)
            _check(got, seed, ref.counters(base, list(size), list(strides)), p, x)
