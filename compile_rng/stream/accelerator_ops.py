"""The functional ops on accelerators: ``torch.ops.compile_rng.*`` kernels for CUDA and
XPU tensors, computed by the Triton kernels of :mod:`compile_rng.stream.triton_kernels`.

Same arguments, checks and values as the CPU kernels in :mod:`compile_rng.ops` (the
canonical stream): a key on the device, counters ``base + offset + sum(idx *
strides)``. Registering needs no triton; the first call imports it and says how to
install it if it is missing. :data:`KERNELS` maps each op to its kernel, which also runs
on CPU tensors under ``TRITON_INTERPRET=1`` (how the test suite checks it bitwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from compile_rng import stream
from compile_rng._torch.core_internals import OpOverload, TorchDispatchMode
from compile_rng.stream import checks

if TYPE_CHECKING:
    from compile_rng.stream.triton_kernels import Launch

DEVICE_TYPES = ("cuda", "xpu")


def _kernels() -> ModuleType:
    try:
        from compile_rng.stream import triton_kernels
    except ImportError as e:
        raise RuntimeError(
            "compile_rng: random ops on accelerator tensors run Triton kernels, and triton is not "
            "importable here; install it (pip install 'compile_rng[gpu]'; torch's CUDA wheels "
            f"bring a matching triton): {e}"
        ) from e
    return triton_kernels


def _out(key: torch.Tensor, size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(list(size), dtype=dtype, device=key.device)


def _draw(name: str, key, offset, size, strides, dtype, **params) -> torch.Tensor:
    """A new ``size``-shaped ``dtype`` tensor of op ``name``'s values."""
    checks.check_layout(name, size, strides)
    tk = _kernels()
    out = _out(key, size, dtype)
    tk.launch(getattr(tk, name.upper()), out, key, offset, strides, **params)
    return out


def uniform(key, offset, size, strides, low, high, dtype):
    checks.check_float("uniform", dtype)
    return _draw("uniform", key, offset, size, strides, dtype, a=low, b=high)


def normal(key, offset, size, strides, mean, std, dtype):
    checks.check_float("normal", dtype)
    return _draw("normal", key, offset, size, strides, dtype, a=mean, b=std)


def exponential(key, offset, size, strides, lambd, dtype):
    checks.check_float("exponential", dtype)
    return _draw("exponential", key, offset, size, strides, dtype, a=-1.0 / lambd)


def bernoulli(key, offset, size, strides, p, dtype):
    return _draw("bernoulli", key, offset, size, strides, dtype, i_a=stream.threshold32(p))


def bernoulli_tensor(key, offset, p, strides, dtype):
    return _draw("bernoulli_tensor", key, offset, p.shape, strides, dtype, source=p.contiguous())


def dropout(key, offset, x, strides, p):
    checks.check_float("dropout", x.dtype)
    checks.check_layout("dropout", x.shape, strides)
    tk = _kernels()
    out, mask = _out(key, x.shape, x.dtype), _out(key, x.shape, torch.bool)
    tk.launch(
        tk.DROPOUT, out, key, offset, strides, mask=mask, source=x.contiguous(),
        a=stream.dropout_scale(p, x.dtype), i_a=stream.threshold32(1.0 - p),
    )
    return out, mask


def randint(key, offset, size, strides, low, high, dtype):
    checks.check_randint_range(low, high)
    return _draw(
        "randint", key, offset, size, strides, dtype, i_a=low, i_b=high - low,
        big=stream.needs_high_word(low, high), mod=high - low < 2**63,
    )


def random_bits(key, offset, size, strides):
    return _draw("random_bits", key, offset, size, strides, torch.int64)


#: op name (``torch.ops.compile_rng.<name>``) -> its accelerator kernel
KERNELS: dict[str, Callable] = {
    fn.__name__: fn for fn in (uniform, normal, exponential, bernoulli, bernoulli_tensor, dropout, randint, random_bits)
}


def register() -> None:
    """Register :data:`KERNELS` as the ops' CUDA and XPU kernels (imports no triton);
    :mod:`compile_rng.ops` calls it once the ops are defined."""
    for name, fn in KERNELS.items():
        torch.library.register_kernel(f"compile_rng::{name}", DEVICE_TYPES, fn)


def _kernel(func: OpOverload) -> Callable | None:
    namespace, _, name = func.name().partition("::")
    return KERNELS.get(name) if namespace == "compile_rng" else None


# --- the compiled variants ----------------------------------------------------------------

#: The output dtypes an op can be asked for: continuous distributions take the float
#: dtypes; bernoulli and integers any dtype compile_rng's ops accept (bool included).
_ANY_DTYPE = (*stream.FLOAT_DTYPES, *stream.INT_DTYPES, torch.bool)
#: ``randint`` spans that take each of its paths: modulo of one word; the ``c2 = 1`` high
#: word; a span of exactly 2**63 (high word, no modulo).
_RANDINT_SPANS = ((0, 10), (0, 2**40), (-(2**62), 2**62))
#: A plain stream (the block path) and a strided window (the per-element path).
_LAYOUTS = (([2, 8], [20, 1]), ([2, 8], [20, 2]))


@functools.cache
def specializations() -> dict[str, Launch]:
    """One launch of every compiled variant of the Triton stream kernel that these ops can
    launch, by :func:`~compile_rng.stream.triton_kernels.variant_name`: every op at every
    dtype it takes, both layouts and every path, recorded from the ops' own argument
    handling on small CPU tensors, nothing launched. A variant's identity is its
    constexprs and tensor dtypes (see :mod:`compile_rng.stream.triton_kernels`);
    ``tests/test_triton_aot.py`` checks that real launches find theirs here."""
    tk = _kernels()
    key = torch.zeros(2, dtype=torch.int64)
    floats, everything = stream.FLOAT_DTYPES, _ANY_DTYPE
    with tk.recording() as seen:
        for size, strides in _LAYOUTS:
            for dtype in floats:
                uniform(key, 0, size, strides, -1.0, 1.0, dtype)
                normal(key, 0, size, strides, 0.0, 1.0, dtype)
                exponential(key, 0, size, strides, 1.0, dtype)
                dropout(key, 0, torch.zeros(size, dtype=dtype), strides, 0.25)
            for dtype in everything:
                bernoulli(key, 0, size, strides, 0.5, dtype)
                for p_dtype in floats:
                    bernoulli_tensor(key, 0, torch.zeros(size, dtype=p_dtype), strides, dtype)
                for low, high in _RANDINT_SPANS:
                    randint(key, 0, size, strides, low, high, dtype)
            random_bits(key, 0, size, strides)
    return {tk.variant_name(step): step for step in seen}

class _OnTriton(TorchDispatchMode):
    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kernel = _kernel(func)
        if kernel is None:
            return func(*args, **kwargs)
        move = lambda v, d: v.to(d) if isinstance(v, torch.Tensor) else v  # noqa: E731
        out = kernel(*(move(a, self.device) for a in args), **kwargs)
        return tuple(move(o, "cpu") for o in out) if isinstance(out, tuple) else move(out, "cpu")


def on_triton(fn: Callable) -> Callable:
    """``fn`` (CPU tensors in and out) with its functional ops computed by the Triton
    kernels: in Triton's interpreter on the CPU when ``TRITON_INTERPRET=1`` was set
    before the kernels were imported, else on the current CUDA device."""
    device = "cpu" if _kernels().INTERPRETED else "cuda"

    def run(*args, **kwargs):
        with _OnTriton(device):
            return fn(*args, **kwargs)

    return run


stream.register_implementation(
    # The Triton kernels: the block path (inner counter stride 1, several programs per
    # row), the per-element path (a transposed window), a scalar.
    stream.Implementation(
        "triton", (((3, 5), (7, 1)), ((5, 3), (1, 5)), ((4, 1027), (1027, 1)), ((), ())), on_triton, "triton"
    )
)
