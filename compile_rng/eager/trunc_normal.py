"""``nn.init.trunc_normal_`` on the stream, redrawing only the rejected elements.

torch 2.13's ``trunc_normal_`` (when more than 30% of the mass lies in ``[a, b]``)
fills the tensor with ``normal_(mean, std)``, then, while any element is outside
``[a, b]``, draws a whole new tensor and takes its values at those elements. On
compile_rng's stream every draw uses the same counter layout: element ``i`` of draw
``k`` has counter ``base_0 + k * advance + c_i`` (``advance``: what one draw of the
tensor consumes). So an element's final value is its first in-range draw, and the
loop runs as many draws as the worst element needs (all ranks agree, as torch's
``mask.any()`` on a DTensor makes them). :func:`trunc_normal_` computes exactly that:
draw 0 with the stream's normal kernel, then only the rejected elements at their
counters, advancing the state by ``advance`` per draw as the loop would. Same values,
same state; the cost is one normal draw plus a min/max scan instead of several draws,
comparisons and ``where``s over the whole tensor.

It also fixes an SPMD bug of the loop on DTensors: in torch 2.13 ``bool(mask.any())``
of a sharded mask reads the rank's local ``Partial`` value without reducing, so each
rank stops after its own shard is in range and the ranks' RNG states drift apart
(every later random op then disagrees across ranks). Here the stop test is reduced
over the mesh, so all ranks advance alike; each element's value is unchanged (it is
its first in-range draw either way).

Installed as ``torch.nn.init.trunc_normal_`` on import (:mod:`compile_rng.installation`). It takes over for DTensors on
CPU meshes and for plain tensors inside compile_rng's stream (``@compile_rng.init``,
``eager_stream``): float32 on CPU as above; other dtypes and devices run torch's loop
(whole redraws), and narrow truncation (at most 30% of the mass in ``[a, b]``) torch's
rejection sampler, both with their stop tests reduced over the mesh. Anything else
(torch's generator, a ``generator``, ranks outside the mesh) runs torch's own
implementation.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from compile_rng._torch.dynamo_internals import disable_dynamo
from compile_rng.eager import dispatch_modes, draw_counters
from compile_rng import stream
from compile_rng.stream import state
from compile_rng.stream.cpu_kernel import normal_f32_at

_TORCH_TRUNC_NORMAL = torch.nn.init.trunc_normal_


def _mass(mean: float, std: float, a: float, b: float) -> float:
    def norm_cdf(x: float) -> float:  # as torch computes it
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    return norm_cdf((b - mean) / std) - norm_cdf((a - mean) / std)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # Not importing DTensor here keeps `import compile_rng` light; no DTensor exists
    # before torch.distributed.tensor is imported.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def _on_the_stream(tensor: torch.Tensor) -> bool:
    if _is_dtensor(tensor):
        from compile_rng.eager import tracker

        return state.serves(tensor.device_mesh) and tracker.installed()
    return dispatch_modes.in_stream()


def _on_stream_applies(tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator) -> bool:
    """Whether compile_rng runs torch's algorithm itself (on the stream, stop tests reduced)."""
    return (
        _on_the_stream(tensor)
        and generator is None
        and not tensor.is_meta
        and a - 2 * std <= mean <= b + 2 * std  # else torch warns; let it
        and (not _is_dtensor(tensor) or tensor.device_mesh.get_coordinate() is not None)
    )


def _any(mask: torch.Tensor, tensor: torch.Tensor) -> bool:
    """``mask.any()`` over the whole (DTensor-global) tensor."""
    local = mask.to_local() if _is_dtensor(mask) else mask
    return _any_on_mesh(bool(local.any()), tensor)


def _narrow_loop(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> torch.Tensor:
    """torch 2.13's rejection sampler for at most 30% of the mass in ``[a, b]``
    (``torch/nn/init.py``: uniform proposals, accepted by the log density), with its
    stop tests reduced over the DTensor's mesh."""
    mode = max(a, min(mean, b))
    log_peak = -0.5 * ((mode - mean) / std) ** 2

    def log_pdf(x: torch.Tensor) -> torch.Tensor:
        return x.sub_(mean).div_(std).pow_(2).mul_(-0.5).sub_(log_peak)

    candidates, accept_buf = torch.empty_like(tensor), torch.empty_like(tensor)
    tensor.uniform_(a, b)
    candidates.copy_(tensor)
    pending = accept_buf.uniform_().log_().gt(log_pdf(candidates))
    result = tensor
    while _any(pending, tensor):
        candidates.uniform_(a, b)
        result = torch.where(pending, candidates, result)
        pending = torch.where(pending, accept_buf.uniform_().log_().gt(log_pdf(candidates)), pending)
    if result is not tensor:
        tensor.copy_(result)
    return tensor


def _redraw_loop(tensor: torch.Tensor, mean: float, std: float, lo: float, hi: float, drawn: bool = False) -> torch.Tensor:
    """torch's loop, with its stop test reduced over the DTensor's mesh (any dtype);
    ``drawn``: the first ``normal_`` has run already."""
    result = tensor if drawn else tensor.normal_(mean, std)
    while True:
        mask = (result < lo) | (result > hi)
        if not _any(mask, tensor):
            return tensor
        result.copy_(torch.where(mask, torch.empty_like(result).normal_(mean, std), result))


def _never_rejects(mean: float, std: float, a: float, b: float) -> bool:
    """Whether no stream normal can fall outside ``[a, b]``: Box-Muller's first uniform
    is at least 2**-32, so ``|z| <= sqrt(64 ln 2) < 6.67``, and ``z * std + mean`` is
    rounded in float32 (monotone, ``std`` and ``mean`` passed as float32); 7 sigma
    around the float32 mean leaves margin for all of it. Then no rank needs to scan
    or ask the others."""
    mean32 = float(torch.tensor(mean, dtype=torch.float32))
    return a <= mean32 - 7 * std and mean32 + 7 * std <= b


def _any_on_mesh(flag: bool, tensor: torch.Tensor) -> bool:
    """``flag`` or-ed over the ranks of ``tensor``'s mesh (torch's loop asks a DTensor's
    ``mask.any()``, which reduces over the mesh); a plain tensor is on one rank."""
    if not _is_dtensor(tensor):
        return flag
    value = torch.tensor([int(flag)])
    mesh = tensor.device_mesh
    for dim in range(mesh.ndim):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return bool(value.item())


@disable_dynamo  # reads values and the state: always eager (Dynamo imported lazily)
def trunc_normal_(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``torch.nn.init.trunc_normal_`` with the values and state advance torch's
    implementation has on compile_rng's stream (see the module docstring)."""
    if not _on_stream_applies(tensor, mean, std, a, b, generator):
        return _TORCH_TRUNC_NORMAL(tensor, mean, std, a, b, generator)
    with torch.no_grad():
        if _mass(mean, std, a, b) <= 0.3:
            return _narrow_loop(tensor, mean, std, a, b)
        if _never_rejects(mean, std, a, b):
            return tensor.normal_(mean, std)
        lo = tensor.new_tensor(a, device="cpu").item()  # bounds in the tensor's dtype, as torch
        hi = tensor.new_tensor(b, device="cpu").item()
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            # no kernel draws other dtypes at given counters: torch's loop, kept in step across ranks
            return _redraw_loop(tensor, mean, std, lo, hi)
        with draw_counters.recorded_counters() as log:
            tensor.normal_(mean, std)
        if len(log) != 1:
            # a shard drawn piecewise (uneven _StridedShard) has no one window to redraw at
            return _redraw_loop(tensor, mean, std, lo, hi, drawn=True)
        (draw,) = log
        seed, base = (stream.as_uint64(v) for v in draw.key.tolist())
        advance = stream.as_uint64(state.get_state(draw.key.device)[1] - base)
        local = tensor.to_local() if _is_dtensor(tensor) else tensor
        flat = local.reshape(-1)  # a copy for a non-contiguous view (a chunk of a fused weight)
        low_value, high_value = torch.aminmax(flat) if flat.numel() else (lo, hi)
        if low_value >= lo and high_value <= hi:
            rejected = torch.empty(0, dtype=torch.int64)
        else:
            rejected = ((flat < lo) | (flat > hi)).nonzero().view(-1)
        counters = _layout_counters(rejected, draw)
        k = 0
        while _any_on_mesh(rejected.numel() > 0, tensor):
            k += 1
            state.advance(advance, draw.key.device)  # what the loop's whole redraw consumes
            values = normal_f32_at(seed, base + k * advance, counters, mean, std)
            flat[rejected] = values
            still = (values < lo) | (values > hi)
            rejected, counters = rejected[still], counters[still]
        if k and flat.data_ptr() != local.data_ptr():
            local.copy_(flat.view(local.shape))
    return tensor


def _layout_counters(flat_index: torch.Tensor, draw: draw_counters.Counters) -> torch.Tensor:
    """``offset + sum(idx * strides)`` of the row-major local positions ``flat_index``."""
    counters = torch.full_like(flat_index, draw.offset)
    rest = flat_index.clone()
    for size, stride in zip(reversed(draw.size), reversed(draw.strides)):
        counters += (rest % size) * stride
        rest //= size
    return counters
