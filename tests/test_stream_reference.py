"""The eager functional ops against the independent pure-Python reference, bitwise."""

import math

import pytest
import reference as ref
import torch
from helpers import BASES, SEEDS, f32, ref_tensor

import compile_rng
from compile_rng import ops
from compile_rng.stream.cpu_kernel import philox_words

# compile_rng's kernels against the pure-Python reference: no torch internals involved
pytestmark = pytest.mark.torch_independent

# (size, counter strides): contiguous streams, 0-d, empty, odd sizes, and a shard-like
# layout whose strides come from a larger global tensor.
LAYOUTS = [((), ()), ((0,), (1,)), ((7,), (1,)), ((3, 5), (5, 1)), ((2, 3, 5), (15, 5, 1)), ((3, 4), (10, 1))]


@pytest.mark.parametrize("ctr,key,expected", [k for k in ref.KAT if k[0][3] == 0])
def test_c_kernel_matches_known_answers(ctr, key, expected):
    # The KAT block as lanes 0..3 of a 4-element stream: counter words 0 and 1 are the
    # block index halves; word 2 is c2; word 3 is always 0 in the kernel.
    seed = key[0] | key[1] << 32
    base = (ctr[0] | ctr[1] << 32) << 2
    words, _ = philox_words(seed, base % 2**64, [4], [1], c2=ctr[2])
    assert tuple(words.tolist()) == expected


def _counters(base, size, strides):
    return ref.counters(base, list(size), list(strides))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("base", BASES)
def test_words_match_reference(seed, base):
    for size, strides in LAYOUTS:
        words, lanes = philox_words(seed, base, list(size), list(strides), lanes=True)
        cs = _counters(base, size, strides)
        assert words.flatten().tolist() == [ref.word(seed, c) for c in cs]
        assert lanes.flatten().tolist() == [c % 4 for c in cs]


def test_words_multithreaded_match_single_threaded():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = philox_words(7, 2**64 - 1000, [300, 1000], [1000, 1])
        torch.set_num_threads(4)
        many, _ = philox_words(7, 2**64 - 1000, [300, 1000], [1000, 1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert one[0, :8].tolist() == [ref.word(7, (2**64 - 1000 + i) % 2**64) for i in range(8)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("seed", SEEDS[::2])
@pytest.mark.parametrize("base", BASES[::2])
def test_uniform01_matches_reference(dtype, seed, base):
    name = str(dtype).split(".")[1]
    for size, strides in LAYOUTS:
        out = ops.uniform(ops.make_key(seed, base), 0, size, strides, 0.0, 1.0, dtype)
        expected = [ref.uniform01(seed, c, name) for c in _counters(base, size, strides)]
        assert out.dtype == dtype and tuple(out.shape) == size
        assert torch.equal(out.flatten(), ref_tensor(expected, dtype))


def test_offset_argument_shifts_the_counter():
    key = ops.make_key(11, 2**64 - 2)
    a = ops.uniform(key, 5, [6], [1], 0.0, 1.0, torch.float64)
    b = ops.uniform(ops.make_key(11, 3), 0, [6], [1], 0.0, 1.0, torch.float64)
    assert torch.equal(a, b)


@pytest.mark.parametrize("low,high", [(-2.0, 3.0), (0.5, 0.75), (-1e3, 1e3)])
def test_uniform_bounds_match_reference_fp32(low, high):
    seed, base = 99, 2**32 - 5
    out = ops.uniform(ops.make_key(seed, base), 0, [257], [1], low, high, torch.float32)
    expected = []
    for c in range(base, base + 257):
        v = f32(f32(ref.uniform01(seed, c, "float32") * f32(high - low)) + f32(low))
        expected.append(low if v >= high else v)
    assert torch.equal(out, ref_tensor(expected, torch.float32))
    assert bool((out >= low).all()) and bool((out < high).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_uniform_never_returns_one(dtype):
    # Words at the top of the range map to the largest value below 1.
    for seed in range(4):
        out = ops.uniform(ops.make_key(seed, 0), 0, [1 << 16], [1], 0.0, 1.0, dtype)
        assert float(out.max()) < 1.0
    bits = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}[dtype]
    top = torch.tensor((2**bits - 1) * 2.0**-bits, dtype=torch.float64).to(dtype)
    assert float(top) < 1.0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.float64, 1e-12)])
def test_normal_matches_reference(dtype, tol):
    for seed in SEEDS[:3]:
        for base in BASES:
            out = ops.normal(ops.make_key(seed, base), 0, [3, 5], [5, 1], 0.0, 1.0, dtype)
            expected = ref_tensor([ref.normal_std(seed, c) for c in _counters(base, [3, 5], [5, 1])], torch.float64)
            assert (out.double().flatten() - expected).abs().max() < tol


def test_normal_mean_std_are_affine():
    key = ops.make_key(5, 17)
    z = ops.normal(key, 0, [1000], [1], 0.0, 1.0, torch.float64)
    x = ops.normal(key, 0, [1000], [1], 3.0, 0.5, torch.float64)
    assert torch.equal(x, z * 0.5 + 3.0)


def test_exponential_matches_reference():
    seed, base = 3, 2**63 + 7
    out = ops.exponential(ops.make_key(seed, base), 0, [101], [1], 2.5, torch.float64)
    expected = [ref.exponential(seed, base + i, 2.5) for i in range(101)]
    assert (out - torch.tensor(expected, dtype=torch.float64)).abs().max() < 1e-12
    assert bool((out >= 0).all()) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_bernoulli_scalar_matches_reference(p):
    seed, base = 8, 2**32 - 5
    for dtype in (torch.float32, torch.bfloat16):
        out = ops.bernoulli(ops.make_key(seed, base), 0, [500], [1], p, dtype)
        expected = [float(ref.keep_bernoulli(seed, base + i, p)) for i in range(500)]
        assert torch.equal(out, ref_tensor(expected, dtype))


def test_bernoulli_tensor_matches_reference():
    seed, base = 8, 1
    p = torch.linspace(0, 1, 64, dtype=torch.float32).reshape(8, 8)
    out = ops.bernoulli_tensor(ops.make_key(seed, base), 0, p, [8, 1], torch.float32)
    expected = [float(ref.keep_bernoulli(seed, base + i, float(p.flatten()[i]))) for i in range(64)]
    assert torch.equal(out.flatten(), ref_tensor(expected, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dropout_matches_reference(dtype):
    seed, base, p = 21, 2**64 - 6, 0.3
    x = torch.randn(4, 33, dtype=dtype)
    out, mask = ops.dropout(ops.make_key(seed, base), 0, x, [33, 1], p)
    keep = [ref.keep_bernoulli(seed, (base + i) % 2**64, 1 - p) for i in range(x.numel())]
    assert mask.flatten().tolist() == keep
    # ATen's CPU dropout composite: noise = bernoulli(1 - p) in x's dtype, noise / (1 - p), x * noise
    noise = torch.tensor(keep, dtype=dtype).view_as(x)
    expected = x * noise.div_(1 - p)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("low,high", [(0, 10), (-5, 7), (0, 2**32), (-(2**40), 2**40), (-(2**62), 2**62), (0, 2**63 - 1)])
def test_randint_matches_reference(low, high):
    seed, base = 12, 2**63 + 7
    out = ops.randint(ops.make_key(seed, base), 0, [2, 50], [50, 1], low, high, torch.int64)
    expected = [ref.randint(seed, base + i, low, high) for i in range(100)]
    assert out.flatten().tolist() == expected
    assert int(out.min()) >= low and int(out.max()) < high


def test_random_bits_match_reference():
    seed, base = 2**64 - 1, 2**32 - 5
    out = ops.random_bits(ops.make_key(seed, base), 0, [64], [1])
    assert out.tolist() == [ref.bits64(seed, base + i) for i in range(64)]


def test_streams_of_distinct_ops_are_disjoint_blocks():
    # ceil4 advance: an op starting at offset ceil4(n) never shares a block with the previous op.
    key = ops.make_key(4, 0)
    first = ops.uniform(key, 0, [5], [1], 0.0, 1.0, torch.float64)
    second = ops.uniform(key, 8, [3], [1], 0.0, 1.0, torch.float64)
    assert math.isclose(float(second[0]), ref.uniform01(4, 8, "float64"))
    assert not set(first.tolist()) & set(second.tolist())


def test_chunked_eager_kernels_equal_one_block(monkeypatch):
    # Row blocks must reproduce the single-block result exactly (counters and tensor args).
    key = ops.make_key(3, 2**64 - 40)
    x = torch.randn(37, 11)
    p = torch.rand(37, 11)
    cases = lambda: [  # noqa: E731
        ops.uniform(key, 5, [37, 11], [20, 1], -1.0, 2.0, torch.float32),
        ops.normal(key, 5, [37, 11], [11, 1], 0.0, 1.0, torch.float64),
        ops.dropout(key, 1, x, [11, 1], 0.3)[0],
        ops.dropout(key, 1, x, [11, 1], 0.3)[1],
        ops.bernoulli_tensor(key, 2, p, [11, 1], torch.float32),
        ops.randint(key, 0, [37, 11], [11, 1], 0, 2**40, torch.int64),
    ]
    whole = cases()
    monkeypatch.setattr(ops, "CHUNK", 50)  # several rows per block, uneven last block
    for a, b in zip(whole, cases()):
        assert torch.equal(a, b)
    monkeypatch.setattr(ops, "CHUNK", 5)  # one row per block
    for a, b in zip(whole, cases()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("base", [0, 2, 2**64 - 400])
def test_normal_batches_and_tails_match_reference(base):
    # 1000 elements: whole 128-element batches of blocks, then a tail, across the counter wrap
    seed = 77
    out = ops.normal(ops.make_key(seed, base), 0, [8, 125], [125, 1], 0.0, 1.0, torch.float32)
    expected = torch.tensor([ref.normal_std(seed, (base + i) % 2**64) for i in range(1000)], dtype=torch.float64)
    assert (out.double().flatten() - expected).abs().max() < 2e-4
    # bitwise: the batch path (one Box-Muller per word pair) == the per-element path
    from compile_rng.stream.cpu_kernel import normal_f32_at

    assert torch.equal(out.flatten(), normal_f32_at(seed, base, torch.arange(1000), 0.0, 1.0))
    strided = ops.normal(ops.make_key(seed, base), 0, [8, 125], [250, 2], 0.0, 1.0, torch.float32)
    expected = torch.tensor([ref.normal_std(seed, (base + 250 * r + 2 * c) % 2**64) for r in range(8) for c in range(125)],
                            dtype=torch.float64)
    assert (strided.double().flatten() - expected).abs().max() < 2e-4


@pytest.mark.parametrize("op", ["uniform_", "normal_", "bernoulli_"])
def test_eager_in_place_fill_equals_the_functional_op(op):
    # contiguous float32 targets are filled in place by the C kernel; others take the
    # functional op and a copy: both must give the functional op's values
    from compile_rng.eager import dispatch_modes

    base = torch.zeros(6, 40)
    targets = {"contiguous": base[:3], "strided": base[3:, ::2], "float64": torch.zeros(3, 40, dtype=torch.float64)}
    for name, target in targets.items():
        compile_rng.manual_seed(31)
        ptr = target.data_ptr()
        with dispatch_modes.eager_stream():
            getattr(target, op)()
        size = list(target.shape)
        strides = [size[1], 1]
        key = ops.make_key(31, 0)
        functional, args = {"uniform_": (ops.uniform, (0.0, 1.0)), "normal_": (ops.normal, (0.0, 1.0)),
                            "bernoulli_": (ops.bernoulli, (0.5,))}[op]
        want = functional(key, 0, size, strides, *args, target.dtype)
        assert torch.equal(target, want) and target.data_ptr() == ptr, name
    assert torch.equal(base[3:, 1::2], torch.zeros(3, 20))  # the strided fill touched only its view


def test_rows_of_contiguous_streams_take_the_vectorized_kernel(monkeypatch):
    # A step's draw: each dim-0 row of the local batch is a contiguous stream at its row's
    # counters of the global batch, rows ``strides[0]`` apart. float32 uniform, bernoulli
    # and dropout run the vectorized kernel once per row, bitwise equal to the reference.
    from compile_rng.stream.cpu_kernel import fast_f32

    calls = []
    monkeypatch.setattr(ops, "fast_f32", lambda *a, **k: calls.append(a[3] % 2**64) or fast_f32(*a, **k))
    monkeypatch.setattr(ops, "FAST_ROW_MIN", 1)
    seed, base, p = 5, 2**64 - 70, 0.3
    size, strides = [3, 2, 17], [50, 17, 1]
    counters = [(base + 50 * r + i) % 2**64 for r in range(3) for i in range(34)]
    key = ops.make_key(seed, base)
    x = torch.randn(size)
    uniform = ops.uniform(key, 0, size, strides, 0.0, 1.0, torch.float32)
    bern = ops.bernoulli(key, 0, size, strides, 0.25, torch.float32)
    drop, mask = ops.dropout(key, 0, x, strides, p)
    # other dtypes take the kernel's keep mask (float64: eager CPU dropout's bernoulli_)
    bern64 = ops.bernoulli(key, 0, size, strides, 0.25, torch.float64)
    drop64, mask64 = ops.dropout(key, 0, x.double(), strides, p)
    x_strided = torch.randn(3, 17, 2).transpose(1, 2)  # float32, not contiguous: the keep-mask path too
    drop_s, mask_s = ops.dropout(key, 0, x_strided, strides, p)
    assert calls == [(base + 50 * r) % 2**64 for r in range(3)] * 6  # one call per row and op
    assert torch.equal(uniform.flatten(), ref_tensor([ref.uniform01(seed, c, "float32") for c in counters], torch.float32))
    for b, dtype in ((bern, torch.float32), (bern64, torch.float64)):
        assert b.dtype == dtype and b.flatten().tolist() == [float(ref.keep_bernoulli(seed, c, 0.25)) for c in counters]
    keep = [ref.keep_bernoulli(seed, c, 1 - p) for c in counters]
    for d, m, x_ in ((drop, mask, x), (drop64, mask64, x.double()), (drop_s, mask_s, x_strided)):
        assert m.flatten().tolist() == keep
        # ATen's CPU dropout composite: noise = bernoulli(1 - p) in x's dtype, / (1 - p), x * noise
        assert torch.equal(d, x_ * torch.tensor(keep, dtype=x_.dtype).view_as(x_).div_(1 - p))

    # the default threshold: rows of 4096 elements take it, and equal the generic path
    size, strides = [2, 4096], [5000, 1]
    x = torch.randn(size)
    programs = lambda: [ops.uniform(key, 3, size, strides, -1.0, 2.0, torch.float32),  # noqa: E731
                        ops.bernoulli(key, 3, size, strides, 0.5, torch.bfloat16), *ops.dropout(key, 3, x, strides, p),
                        *ops.dropout(key, 3, x.double(), strides, p)]
    monkeypatch.setattr(ops, "FAST_ROW_MIN", 4096)
    calls.clear()
    fast = programs()
    assert len(calls) == 8
    monkeypatch.setattr(ops, "FAST_ROW_MIN", 2**62)
    calls.clear()
    for got, generic in zip(fast, programs()):
        assert torch.equal(got, generic)
    assert not calls


def test_an_output_is_allocated_once(monkeypatch):
    """The functional ops allocate their output where the C kernel fills it and nowhere
    else: a buffer made and dropped for another dtype or layout would stay reserved in an
    accelerator's caching allocator."""
    from compile_rng import ops as ops_module

    made = []
    stock_empty = ops_module._empty
    monkeypatch.setattr(ops_module, "_empty", lambda *a: made.append(a[1:]) or stock_empty(*a))
    key = ops.make_key(3, 0)
    ops.uniform(key, 0, [64], [1], 0.0, 1.0, torch.float32)
    assert made == [([64], torch.float32)]  # the C kernel's output
    made.clear()
    for dtype in (torch.float64, torch.bfloat16):  # the general path makes its own
        assert ops.uniform(key, 0, [64], [1], 0.0, 1.0, dtype).dtype == dtype
    assert ops.bernoulli(key, 0, [8, 8], [1, 8], 0.5, torch.bfloat16).dtype == torch.bfloat16  # a transposed window
    assert made == []


_CALLS = [  # (op, arguments after the key): every functional op
    (torch.ops.compile_rng.uniform.default, (4, [3, 5], [5, 1], -1.0, 2.0, torch.float32)),
    (torch.ops.compile_rng.normal.default, (4, [3, 5], [5, 1], 0.5, 2.0, torch.float64)),
    (torch.ops.compile_rng.exponential.default, (8, [7], [1], 1.5, torch.float32)),
    (torch.ops.compile_rng.bernoulli.default, (0, [9], [1], 0.3, torch.float32)),
    (torch.ops.compile_rng.bernoulli_tensor.default, (0, torch.linspace(0, 1, 6), [1], torch.float32)),
    (torch.ops.compile_rng.dropout.default, (12, torch.ones(2, 6), [6, 1], 0.25)),
    (torch.ops.compile_rng.randint.default, (0, [10], [1], -3, 9, torch.int64)),
    (torch.ops.compile_rng.random_bits.default, (4, [5], [1])),
]


@pytest.mark.parametrize("op, args", _CALLS, ids=[str(op) for op, _ in _CALLS])
def test_eager_calls_skip_the_custom_ops_dispatch_and_draw_its_values(op, args):
    from torch.profiler import profile

    key = ops.make_key(2**64 - 9, 2**40)
    with profile() as prof:
        direct = ops.call(op, key, *args)
    assert not any(e.name == op.name() for e in prof.events())  # the kernel, called directly
    with profile() as prof:
        through = op(key, *args)
    assert any(e.name == op.name() for e in prof.events())  # the profiler sees a dispatched op
    for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (direct, through))):
        assert torch.equal(a, b)


def test_a_call_under_a_dispatch_mode_goes_through_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    op, args = _CALLS[0]
    with Recording():
        ops.call(op, ops.make_key(1, 0), *args)
    assert op in seen
