"""Every functional op compiled by Inductor equals the eager kernel: bitwise for
integer-derived values, within 4 ulp for the transcendental transforms.

One compile per group of ops serves the whole module: the key is a tensor input, so
seeds and bases sweep without recompiling.
"""

import functools

import pytest
import reference as ref
import torch
from helpers import BASES, SEEDS, ulp_distance

from compile_rng import ops
from compile_rng.ops import lowering  # registers the lowerings

X = torch.randn(5, 37, dtype=torch.float32)
XB = torch.randn(5, 37, dtype=torch.bfloat16)
P = torch.rand(5, 37, dtype=torch.float64)
SIZE, STRIDES = [5, 37], [100, 1]  # a shard-like layout: rows of a 100-wide tensor

EXACT = ["u32", "u16", "ubf", "u64", "ub", "bern", "bern_t", "drop", "mask", "dropb", "maskb", "int", "int_big", "bits"]
TRANSCENDENTAL = ["n32", "n64", "nb", "e32", "e64"]


def all_ops(key, x, xb, p):
    u = lambda off, lo, hi, dt: ops.uniform(key, off, SIZE, STRIDES, lo, hi, dt)  # noqa: E731
    drop, mask = ops.dropout(key, 7, x, STRIDES, 0.3)
    dropb, maskb = ops.dropout(key, 7, xb, STRIDES, 0.5)
    return {
        "u32": u(0, 0.0, 1.0, torch.float32),
        "u16": u(1, 0.0, 1.0, torch.float16),
        "ubf": u(2, -2.0, 3.0, torch.bfloat16),
        "u64": u(3, 0.0, 1.0, torch.float64),
        "ub": u(4, -1.5, 2.5, torch.float32),
        "n32": ops.normal(key, 5, SIZE, STRIDES, 0.0, 1.0, torch.float32),
        "n32_affine": ops.normal(key, 5, SIZE, STRIDES, 0.5, 2.0, torch.float32),
        "n64": ops.normal(key, 5, SIZE, STRIDES, 0.0, 1.0, torch.float64),
        "nb": ops.normal(key, 5, SIZE, STRIDES, 0.0, 1.0, torch.bfloat16),
        "e32": ops.exponential(key, 6, SIZE, STRIDES, 1.5, torch.float32),
        "e64": ops.exponential(key, 6, SIZE, STRIDES, 1.5, torch.float64),
        "bern": ops.bernoulli(key, 8, SIZE, STRIDES, 0.25, torch.float32),
        "bern_t": ops.bernoulli_tensor(key, 9, p, STRIDES, torch.float32),
        "drop": drop, "mask": mask, "dropb": dropb, "maskb": maskb,
        "int": ops.randint(key, 10, SIZE, STRIDES, -5, 11, torch.int64),
        "int_big": ops.randint(key, 11, SIZE, STRIDES, -(2**40), 2**41, torch.int64),
        "bits": ops.random_bits(key, 12, SIZE, STRIDES),
    }


# Compiled in groups: gcc's time grows faster than the loop Inductor fuses ops of one
# shape into. All twenty in one loop cost gcc twice the CPU time of these four loops
# (132 s against 69 s on a 2-core EPYC with AVX-512).
GROUPS = [
    ["u32", "u16", "ubf", "u64", "ub"],
    ["n32", "n32_affine", "n64", "nb", "e32", "e64"],
    ["bern", "bern_t", "drop", "mask", "dropb", "maskb"],
    ["int", "int_big", "bits"],
]


def some_ops(names, key, x, xb, p):
    return {name: value for name, value in all_ops(key, x, xb, p).items() if name in names}


@pytest.fixture(scope="module")
def compiled():
    """The fused loops, whatever this CPU (without AVX-512 a compiled graph would call the
    eager ops instead: :func:`test_without_avx512_every_static_stream_takes_the_eager_op`)."""
    torch._dynamo.reset()
    assert sorted(sum(GROUPS, [])) == sorted(all_ops(ops.make_key(0, 0), X, XB, P))
    graphs = [torch.compile(functools.partial(some_ops, names), backend="inductor", fullgraph=True) for names in GROUPS]

    def run(*args):
        with lowering.fused_loops():
            return {name: value for graph in graphs for name, value in graph(*args).items()}

    return run


@pytest.fixture(scope="module")
def max_ulp():
    seen = {}
    yield seen
    print("\nmax ulp eager vs inductor:", seen)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("base", BASES)
def test_inductor_equals_eager(compiled, max_ulp, seed, base):
    key = ops.make_key(seed, base)
    got, want = compiled(key, X, XB, P), all_ops(key, X, XB, P)
    for name in EXACT:
        assert torch.equal(got[name], want[name]), name
    for name in TRANSCENDENTAL:
        d = ulp_distance(got[name], want[name])
        max_ulp[name] = max(max_ulp.get(name, 0), d)
        assert d <= 4, (name, d)
    # ulps are measured on standard values: a mean cancels digits and magnifies them.
    err = (got["n32_affine"].double() - want["n32_affine"].double()).abs()
    assert bool((err <= 4 * 2.0**-23 * (2.0 * want["n32"].double().abs() + 0.5)).all())


def test_inductor_words_match_reference(compiled):
    # uniform float64 is W * 2**-32: it exposes the compiled Philox words exactly.
    for seed, base in [(2**64 - 1, 2**64 - 6), (0xDEADBEEF12345678, 2**32 - 5)]:
        got = compiled(ops.make_key(seed, base), X, XB, P)["u64"]
        cs = ref.counters(base + 3, SIZE, STRIDES)
        assert (got.flatten() * 2**32).long().tolist() == [ref.word(seed, c) for c in cs]


def test_one_compile_serves_every_key(compiled):
    compiled(ops.make_key(7, 0), X, XB, P)  # compiled here if no test before this one did
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in range(3):
        compiled(ops.make_key(seed, seed * 1000), X, XB, P)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


def test_large_streams_take_the_c_kernel_with_the_same_bits():
    from compile_rng import stream
    from compile_rng.stream.cpu_kernel import philox_words
    from compile_rng.ops.lowering import EXTERN_MIN_NUMEL

    n = EXTERN_MIN_NUMEL + 13  # the larger threshold: the C kernel whatever Inductor's ISA
    seed, base = 0xDEADBEEF12345678, 2**64 - 7  # crosses the counter wrap
    key = ops.make_key(seed, base)
    x = torch.randn(n)

    def big(key, x):
        return (ops.uniform(key, 0, [n], [1], -1.0, 3.0, torch.float32),
                ops.bernoulli(key, 1, [n], [1], 0.3, torch.float32),
                *ops.dropout(key, 2, x, [1], 0.2))

    torch._dynamo.reset()
    got = torch.compile(big, backend="inductor", fullgraph=True)(key, x)
    m = stream.TensorMath()
    words = lambda off: philox_words(seed, base + off, [n], [1])[0]  # noqa: E731  (the generic path)
    want = (
        stream.uniform(m, words(0), torch.float32, -1.0, 3.0),
        stream.bernoulli_scalar(m, words(1), torch.float32, 0.3),
        stream.dropout_apply(m, x, stream.dropout_keep(m, words(2), 0.2), torch.float32, 0.2),
        stream.dropout_keep(m, words(2), 0.2),
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa, extern", [("avx512", False), ("avx2", True)])
def test_without_avx512_short_streams_take_the_c_kernel(monkeypatch, isa, extern):
    """The fused loop's 64-bit multiplies have no AVX2/NEON instruction: there, a stream
    of any static length calls the C kernel; AVX-512 keeps short ones fused. Same bits
    either way."""
    from compile_rng._torch.inductor_internals import inductor_caches_off
    from compile_rng.stream.cpu_kernel import fast_f32

    calls = []
    monkeypatch.setattr(lowering, "inductor_vector_isa", lambda: isa)
    monkeypatch.setattr(ops, "fast_f32", lambda *a, **k: calls.append(1) or fast_f32(*a, **k))
    n = 45
    key = ops.make_key(7, 2**32 - 3)
    fn = lambda key: ops.uniform(key, 0, [n], [1], 0.0, 1.0, torch.float32)  # noqa: E731
    torch._dynamo.reset()
    with inductor_caches_off():  # their keys do not hold the choice
        got = torch.compile(fn, backend="inductor", fullgraph=True)(key)
    assert bool(calls) == extern
    calls.clear()
    assert torch.equal(got, fn(key)) and calls  # the eager op: the C kernel


def _exact_ops(key, x, p, size, strides):
    return (*ops.dropout(key, 0, x, strides, 0.3),
            ops.uniform(key, 1, size, strides, -2.0, 3.0, torch.bfloat16),
            ops.randint(key, 2, size, strides, -(2**40), 2**41, torch.int64),
            ops.bernoulli_tensor(key, 3, p, strides, torch.float64),
            ops.random_bits(key, 4, size, strides))


@pytest.mark.parametrize("isa, extern", [("avx512", False), ("avx2", True)])
def test_without_avx512_every_static_stream_takes_the_eager_op(monkeypatch, isa, extern):
    """Without AVX-512 every dtype, layout and size calls the eager op (no fused loop for
    gcc to build); with AVX-512 these stay fused (short, not float32, or strided). The
    same bits either way: both equal the eager op."""
    from compile_rng._torch.inductor_internals import inductor_caches_off

    externs, extern_call = [], lowering._extern
    monkeypatch.setattr(lowering, "inductor_vector_isa", lambda: isa)
    monkeypatch.setattr(lowering, "_extern", lambda op, *a: externs.append(op) or extern_call(op, *a))
    size, strides = [3, 32], [40, 1]  # rows of a 40-wide tensor: a strided stream
    key = ops.make_key(11, 2**32 - 5)
    x = torch.randn(*size, dtype=torch.float64)
    p = torch.rand(*size, dtype=torch.float64)
    fn = functools.partial(_exact_ops, size=size, strides=strides)
    torch._dynamo.reset()
    with inductor_caches_off():
        got = torch.compile(fn, backend="inductor", fullgraph=True)(key, x, p)
    assert len(externs) == (5 if extern else 0)
    for a, b in zip(got, fn(key, x, p)):
        assert torch.equal(a, b)


def test_fused_loops_lower_every_stream_to_its_loop(monkeypatch):
    """What the fixture above relies on: under ``fused_loops()`` no op is a call, whatever
    the CPU (the compile it saves is the fixture's own)."""
    monkeypatch.setattr(lowering, "inductor_vector_isa", lambda: "avx2")
    cpu = torch.device("cpu")
    assert lowering._extern_worthy(cpu, [3, 32], [40, 1], torch.float64)
    with lowering.fused_loops():
        assert not lowering._extern_worthy(cpu, [3, 32], [40, 1], torch.float64)
        assert not lowering._extern_worthy(cpu, [1 << 20], [1], torch.float32)
    assert lowering._extern_worthy(cpu, [3, 32], [40, 1], torch.float64)
    # a CUDA graph's rule is not this CPU's: its draws are fused (tests/test_accelerator_path.py)
    assert not lowering._extern_worthy(torch.device("cuda"), [1 << 20], [1], torch.float32)
