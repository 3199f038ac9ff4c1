"""Every instruction-set build of the CPU kernel (``compile_rng.stream.cpu_kernel.ISA_FLAGS``)
gives canonical stream v1, bitwise.

Each x86 level this CPU runs (baseline, AVX2, AVX-512) is forced in turn with
``COMPILE_RNG_CPU_ISA`` and checked against the independent scalar reference
(``tests/reference.py``, itself pinned to Random123's known answers): the conformance
program of ``test_stream_conformance``, then contiguous streams of many sizes and offsets
that start and end inside the vector batches, across the counter wrap. Normals must also
be bitwise equal across builds (one implementation, same bits everywhere). The aarch64
NEON build is cross-compiled and run under qemu-user where both are installed.
"""

from __future__ import annotations

import shutil
import struct
import subprocess

import pytest
import reference as ref
import test_stream_conformance as conformance
import torch

from compile_rng import ops, stream
from compile_rng.stream.cpu_kernel import (
    COMMON_FLAGS,
    ISA_ENV,
    ISA_FLAGS,
    SOURCE,
    _compiler,
    _load,
    isa,
    normal_f32,
    philox_words,
    supported_isas,
)

# compile_rng's C kernel builds (per ISA, under qemu): the same on every torch version
pytestmark = pytest.mark.torch_independent

SUPPORTED = supported_isas()
BUILDS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in SUPPORTED, reason=f"this CPU does not run {name}"))
    for name in ISA_FLAGS
]
P_DROP, P_BERN = 0.3, 0.25
# Counters around the 2**64 wrap; every stream below lies inside this window.
WINDOW_START, WINDOW = 2**64 - 301, 1400
SEED = 0xDEADBEEF12345678


@pytest.fixture
def build(request, monkeypatch) -> str:
    """Forces the parametrized build for the test."""
    monkeypatch.setenv(ISA_ENV, request.param)
    assert isa() == request.param
    return request.param


def test_isa_is_the_best_supported_build_unless_forced(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert isa() == SUPPORTED[0]
    assert _load(isa()).cr_isa() == isa().encode()  # the loaded code path, not just a name
    unsupported = next(name for name in ISA_FLAGS if name not in SUPPORTED)
    monkeypatch.setenv(ISA_ENV, unsupported)
    with pytest.raises(RuntimeError, match=f"{ISA_ENV}='{unsupported}'.*only runs"):
        isa()
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="expected one of"):
        isa()


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_known_answers(build):
    for ctr, key, expected in ref.KAT:
        if ctr[3]:
            continue  # the kernel's fourth counter word is always 0
        seed = key[0] | key[1] << 32
        words, _ = philox_words(seed, (ctr[0] | ctr[1] << 32) << 2, [4], [1], c2=ctr[2])
        assert tuple(words.tolist()) == expected
    # the vectorized batches: counter 0 with key 0 is the first known answer
    u = ops.uniform(ops.make_key(0, 0), 0, [4096], [1], 0.0, 1.0, torch.float32)
    assert u[:4].tolist() == [(w >> 8) * 2.0**-24 for w in ref.KAT[0][2]]


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_conformance_program(build):
    layouts = [impl.layouts for impl in stream.IMPLEMENTATIONS if impl.name in ("c-scalar", "c-vectorized")]
    program_inputs = torch.Generator().manual_seed(0)
    for size, strides in [layout for group in layouts for layout in group]:
        program = conformance._program(size, strides)
        p = torch.rand(size, generator=program_inputs, dtype=torch.float64)
        x = torch.randn(size, generator=program_inputs)
        for seed, base in conformance.KEYS:
            got = program(ops.make_key(seed, base), p, x)
            conformance._check(got, seed, ref.counters(base, list(size), list(strides)), p, x)


def _window_words() -> torch.Tensor:
    """Reference words of counters WINDOW_START + i, i < WINDOW (mod 2**64), as int64."""
    blocks = {}
    words = []
    for i in range(WINDOW):
        n = (WINDOW_START + i) % 2**64
        if n >> 2 not in blocks:
            blocks[n >> 2] = ref.block(SEED, n)
        words.append(blocks[n >> 2][n & 3])
    return torch.tensor(words, dtype=torch.int64)


WORDS = _window_words()


def _tail_cases() -> list[tuple[int, int]]:
    """(start in the window, size): heads and tails around every build's batch size."""
    sizes = [*range(1, 18), 127, 128, 129, 143, 144, 145, 255, 256, 257, 289, 383, 577, 1031]
    return [(start, size) for start in (0, 1, 2, 3, 5, 298, 301) for size in sizes if start + size <= WINDOW]


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_vector_heads_and_tails_match_the_reference(build, monkeypatch):
    x_all = torch.randn(WINDOW, generator=torch.Generator().manual_seed(1))
    normals = []
    for start, size in _tail_cases():
        key = ops.make_key(SEED, WINDOW_START + start)
        w = WORDS[start:start + size]
        u = ops.uniform(key, 0, [size], [1], 0.0, 1.0, torch.float32)
        assert torch.equal(u, ((w >> 8).double() * 2.0**-24).float()), (start, size)
        bern = ops.bernoulli(key, 0, [size], [1], P_BERN, torch.float32)
        assert torch.equal(bern, (w < stream.threshold32(P_BERN)).float()), (start, size)
        x = x_all[:size].clone()
        drop, mask = ops.dropout(key, 0, x, [1], P_DROP)
        keep = w < stream.threshold32(1 - P_DROP)
        assert torch.equal(mask, keep), (start, size)
        assert torch.equal(drop, x * keep.float().div_(1 - P_DROP)), (start, size)
        z = ops.normal(key, 0, [size], [1], 0.0, 1.0, torch.float32)
        want = [ref.normal_std(SEED, (WINDOW_START + start + i) % 2**64) for i in range(size)]
        assert (z.double() - torch.tensor(want, dtype=torch.float64)).abs().max() <= 2e-4
        normals.append(z)
    # normals are not pinned by the reference bitwise, but by the one implementation:
    # the same bits as the least vectorized build
    monkeypatch.setenv(ISA_ENV, SUPPORTED[-1])
    for (start, size), z in zip(_tail_cases(), normals):
        assert torch.equal(z, normal_f32(SEED, WINDOW_START + start, [size], [1], 0.0, 1.0)), (start, size)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_build_gives_the_same_bits(monkeypatch, threads):
    # large odd-sized streams from an odd offset (every thread's range has a head and a
    # tail), and normals of a strided layout (the per-element path)
    n, base = (1 << 18) + 37, 2**64 - 4099
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    # dropped elements are x * 0 then scaled, as in the scalar path: -0 stays -0, inf and
    # NaN become NaN (a masked-out zero would differ)
    special = x.clone()
    special[::5], special[1::5], special[2::5] = float("inf"), float("nan"), -0.0
    key = ops.make_key(SEED, base)

    def outputs() -> list[torch.Tensor]:
        drop, mask = ops.dropout(key, 3, x, [1], P_DROP)
        drop_special, _ = ops.dropout(key, 3, special, [1], P_DROP)
        return [
            ops.uniform(key, 3, [n], [1], -2.0, 3.0, torch.float32),
            ops.uniform(key, 3, [n], [1], 0.0, 1.0, torch.float32),
            ops.bernoulli(key, 3, [n], [1], P_BERN, torch.float32),
            drop, mask, drop_special.view(torch.int32),
            ops.normal(key, 3, [n], [1], 0.5, 2.0, torch.float32),
            normal_f32(SEED, base, [301, 257], [300, 1], 0.0, 1.0),
        ]

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {}
        for name in SUPPORTED:
            monkeypatch.setenv(ISA_ENV, name)
            results[name] = outputs()
    finally:
        torch.set_num_threads(previous)
    first, *rest = SUPPORTED
    for name in rest:
        for i, (a, b) in enumerate(zip(results[first], results[name])):
            assert torch.equal(a, b), (first, name, i)
    drop_special = results[first][5].view(torch.float32)
    keep = results[first][4]
    assert drop_special[~keep & special.isinf()].isnan().all()
    assert (drop_special[~keep & (special == 0)].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).all()


def test_pthread_fallback_gives_the_same_bits(tmp_path, monkeypatch):
    # builds without OpenMP (compilers that lack it) split the work over pthreads: the
    # same values, whatever the split
    import ctypes

    so = tmp_path / "philox-pthreads.so"
    subprocess.run([_compiler(), *COMMON_FLAGS, *ISA_FLAGS[SUPPORTED[0]], str(SOURCE), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    n, base = (1 << 18) + 37, 2**64 - 4099
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv(ISA_ENV, SUPPORTED[0])  # the OpenMP build of the same instruction set
    want_u = ops.uniform(ops.make_key(SEED, base), 0, [n], [1], 0.0, 1.0, torch.float32)
    want_d, want_m = ops.dropout(ops.make_key(SEED, base), 0, x, [1], P_DROP)
    want_z = normal_f32(SEED, base, [n], [1], 0.0, 1.0)
    u, d, z = torch.empty(n), torch.empty(n), torch.empty(n)
    m = torch.empty(n, dtype=torch.bool)
    f32, u64, i64 = ctypes.c_float, ctypes.c_uint64, ctypes.c_int64
    lib.cr_fast_f32.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 3, i64, u64, u64, f32, f32, f32, u64, f32, ctypes.c_int]
    lib.cr_normal_f32.argtypes = [ctypes.c_void_p, i64, u64, u64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  f32, f32, ctypes.c_int]
    assert lib.cr_fast_f32(0, u.data_ptr(), None, None, n, SEED, base, 0.0, 1.0, 1.0, 0, 0.0, 2) == 0
    assert lib.cr_fast_f32(2, d.data_ptr(), m.data_ptr(), x.data_ptr(), n, SEED, base, 0.0, 1.0, 1.0,
                           stream.threshold32(1 - P_DROP), stream.dropout_scale(P_DROP, torch.float32), 2) == 0
    size, stride = (ctypes.c_int64 * 1)(n), (ctypes.c_int64 * 1)(1)
    assert lib.cr_normal_f32(z.data_ptr(), n, SEED, base, 1, size, stride, 0.0, 1.0, 2) == 0
    assert torch.equal(u, want_u) and torch.equal(d, want_d) and torch.equal(m, want_m) and torch.equal(z, want_z)


# --- aarch64 NEON, cross-compiled and run under qemu-user -----------------------------

# Prints, per "seed base n" argument triple, the float32 bits of uniform, the dropout
# keep mask and normals of the contiguous stream, one line each; first the known answers
# of the scalar Philox.
NEON_DRIVER = r"""
#include "philox.c"
#include <stdio.h>
#include <stdlib.h>

static void print_bits(const float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) { uint32_t b; __builtin_memcpy(&b, &v[i], 4); printf("%08x ", b); }
    printf("\n");
}

int main(int argc, char **argv) {
    printf("%s\n", cr_isa());
    static const uint32_t kat[3][6] = {
        {0, 0, 0, 0, 0, 0},
        {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
        {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u},
    };
    for (int k = 0; k < 3; k++) {
        uint32_t c[4] = {kat[k][0], kat[k][1], kat[k][2], kat[k][3]};
        philox4x32_10(c, kat[k][4], kat[k][5]);
        printf("%08x %08x %08x %08x\n", c[0], c[1], c[2], c[3]);
    }
    for (int a = 1; a + 2 < argc; a += 3) {
        uint64_t seed = strtoull(argv[a], NULL, 0), base = strtoull(argv[a + 1], NULL, 0);
        int64_t n = strtoll(argv[a + 2], NULL, 0), one = 1;
        float *out = malloc(n * sizeof(float)), *x = malloc(n * sizeof(float));
        uint8_t *mask = malloc(n);
        for (int64_t i = 0; i < n; i++) x[i] = 1.0f;
        cr_fast_f32(0, out, NULL, NULL, n, seed, base, 0.0f, 1.0f, 1.0f, 0, 0.0f, 2);
        print_bits(out, n);
        cr_fast_f32(2, out, mask, x, n, seed, base, 0.0f, 1.0f, 1.0f, THRESHOLD, 1.0f, 2);
        for (int64_t i = 0; i < n; i++) printf("%d", mask[i]);
        printf("\n");
        cr_normal_f32(out, n, seed, base, 1, &n, &one, 0.0f, 1.0f, 2);
        print_bits(out, n);
        free(out); free(x); free(mask);
    }
    return 0;
}
"""


def _float_bits(t: torch.Tensor) -> list[str]:
    return [f"{struct.unpack('<I', struct.pack('<f', v))[0]:08x}" for v in t.tolist()]


@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu qemu-user)",
)
def test_neon_build_under_qemu(tmp_path):
    threshold = stream.threshold32(1 - P_DROP)
    (tmp_path / "driver.c").write_text(NEON_DRIVER)
    flags = [f for f in COMMON_FLAGS if f not in ("-shared", "-fPIC")] + ISA_FLAGS["neon"]
    exe = tmp_path / "driver"
    subprocess.run(
        ["aarch64-linux-gnu-gcc", *flags, "-static", f"-DTHRESHOLD={threshold}u", f"-I{SOURCE.parent}",
         str(tmp_path / "driver.c"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    # (start in the window, size): batches with heads and tails, and a multi-thread split
    cases = [(0, 1031), (3, 257), (301, 5), (2, 1397)]
    args = [str(a) for start, size in cases for a in (SEED, (WINDOW_START + start) % 2**64, size)]
    lines = subprocess.run(["qemu-aarch64", str(exe), *args], check=True, capture_output=True, text=True,
                           timeout=120).stdout.splitlines()
    assert lines[0] == "neon"
    assert [tuple(int(v, 16) for v in line.split()) for line in lines[1:4]] == [k[2] for k in ref.KAT]
    for k, (start, size) in enumerate(cases):
        uniform, mask, normal = lines[4 + 3 * k: 7 + 3 * k]
        w = WORDS[start:start + size]
        assert uniform.split() == _float_bits(((w >> 8).double() * 2.0**-24).float())
        assert mask == "".join(str(int(v)) for v in (w < threshold).tolist())
        # normals: the same bits as this machine's builds
        want = normal_f32(SEED, WINDOW_START + start, [size], [1], 0.0, 1.0)
        assert normal.split() == _float_bits(want)
