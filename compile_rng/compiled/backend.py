"""The ``torch.compile`` backend: capture -> functionalize random ops -> inner compiler -> run.

The backend appends one input, the rng ``key`` (``[seed, base]`` int64), to the Dynamo
graph (:mod:`compile_rng.compiled.key_input`); AOTAutograd carries it into the joint
graph, where :func:`compile_rng.passes.functionalize_rng.functionalize_rng` rewrites every
random op to read it (:mod:`compile_rng.compiled.joint_pass`, run by
:mod:`compile_rng.compiled.inner_compilers`). Each call then runs through
:class:`compile_rng.compiled.runtime.CompiledGraph`, which reserves the graph's advance
and passes the key. A compile that runs the pass files its plan under its AOTAutograd
key (:mod:`compile_rng.compiled.plan_store`); an AOTAutograd hit, which skips the pass,
loads it.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from compile_rng._torch import dynamo_internals, inductor_internals
from compile_rng.compiled import local_shards
from compile_rng.compiled.inner_compilers import INNERS, compile_inner
from compile_rng.compiled.key_input import graph_device, key_table_rows, with_key_input
from compile_rng.compiled.runtime import CompiledGraph
from compile_rng.debug.dumps import dumping, write_plan
from compile_rng.eager import batch_dims, dispatch_modes, tracker
from compile_rng.passes.graph_nodes import module_calls, torch_modules
from compile_rng.passes.plan import RngPlan
from compile_rng.semantics import layouts, verify
from compile_rng.semantics.rows import current_row_stride, step_batch_dim


@dataclass(frozen=True)
class BackendConfig:
    layout: str = "tracker"
    inner: str = "inductor"
    collect_unsupported: bool = False  # explain(): list unsupported ops instead of raising
    verify: Any = False  # True or a DeviceMesh / ProcessGroup: check that ranks agree before every call (verify.py)
    batched: bool = False  # dim 0 of every random op is the step's batch (batches.py)


def graph_name(gm: fx.GraphModule) -> str:
    """``<function>.<compile id>`` of the graph Dynamo hands over (for file names)."""
    func = dynamo_internals.traced_code_name() or "graph"
    compile_id = dynamo_internals.graph_compile_id(gm).replace("/", "_")
    return f"{func.strip('<>')}.{compile_id}"


def warn_if_split(gm: fx.GraphModule) -> None:
    split = dynamo_internals.graph_break(gm)
    if split is None or dispatch_modes.in_compiled_call():
        return
    # Reported at the user's line that broke the graph, once per compiled graph.
    where = split.frame
    warnings.warn_explicit(
        f"compile_rng: Dynamo split the function here ({split.reason}). "
        "Under torch.compile(backend='compile_rng') a plain-tensor random op in the eager "
        "code between graphs draws from torch's generator, not from compile_rng's stream; "
        "compile with compile_rng.compile(fn) to keep it on the stream.",
        UserWarning,
        where.filename if where else "<compile_rng>",
        where.lineno if where else 0,
    )


#: torch's recurrent ops: Dynamo keeps them as one call with ``torch._dynamo.config.allow_rnn``
_RECURRENT = {getattr(torch, name): name for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}


def refuse_recurrent_dropout(gm: fx.GraphModule) -> None:
    """A recurrent op of several layers with dropout in training: torch's decomposition of
    it, which AOTAutograd traces, applies no dropout between layers (its test ``num_layers
    < i - 1`` never holds; torch 2.11-2.15), so the graph would draw no mask where eager code
    draws one per layer. Refused; without ``allow_rnn`` Dynamo runs the module eagerly."""
    for node in gm.graph.nodes:
        name = _RECURRENT.get(node.target) if node.op == "call_function" else None
        if name is None:
            continue
        args = node.args
        first = 3 if isinstance(args[3], bool) else 4  # has_biases: after (input, hx, params) or (data, batch_sizes, hx, params)
        layers, p, train = args[first + 1 : first + 4]
        if train and layers > 1 and p > 0:
            raise NotImplementedError(
                f"compile_rng: torch.{name} with {layers} layers and dropout={p} in training, compiled: torch's "
                "decomposition of it applies no dropout between layers (torch/_decomp/decompositions.py, "
                "_rnn_helper), so the compiled graph would draw no masks where eager code draws them. Leave "
                "torch._dynamo.config.allow_rnn off (Dynamo then runs the module eagerly, on the stream), or set "
                "the module's dropout to 0 and drop between single-layer modules"
            )


#: Plans a backend keeps: a process that recompiles for ever (new shapes, new models)
#: must not grow for ever; ``explain`` and the tests read the recent ones.
PLANS_KEPT = 1024


class Backend:
    """A ``torch.compile`` backend; ``plans`` keeps what the pass did, one per graph
    (the last :data:`PLANS_KEPT` graphs)."""

    def __init__(self, config: BackendConfig):
        self.config = config
        self.plans: collections.deque[RngPlan] = collections.deque(maxlen=PLANS_KEPT)

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None, options: dict | None = None
    ) -> Callable:
        """Compile ``gm``; ``mode`` and ``options`` are ``torch.compile``'s, for Inductor."""
        inductor_patches = inductor_internals.inductor_options(mode, options)
        if inductor_patches and self.config.inner != "inductor":
            raise ValueError(
                f"compile_rng backend: torch.compile(mode={mode!r}, options=...) configures Inductor, "
                f"but this backend's inner compiler is {self.config.inner!r}"
            )
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        warn_if_split(gm)
        refuse_recurrent_dropout(gm)
        plan = RngPlan(
            name=graph_name(gm), layout=self.config.layout, collect_unsupported=self.config.collect_unsupported,
            batched=self.config.batched, row_stride=current_row_stride() if self.config.batched else 1,
            batch_dim=step_batch_dim() if self.config.batched else 0,
        )
        device = graph_device(gm, list(example_inputs))
        if self.config.batched:
            plan.key_table_rows, plan.module_calls = key_table_rows(gm), module_calls(gm)
        layouts = {key: batch_dims.declared_layout(m) for key, m in torch_modules(gm, dynamo_internals.compiling_scopes()).items()}
        plan.module_layouts = {key: layout for key, layout in layouts.items() if layout is not None}
        keyed_gm, inputs = with_key_input(gm, list(example_inputs), self.config.batched, device, plan.key_table_rows)
        output_layouts = local_shards.rewrite(keyed_gm)  # random ops on a TP rank's plain local tensors
        check = verify.enabled(self.config.verify)
        # verify needs the ops' meshes, explain and dumps the pass's own record: the
        # pass runs for them (a filed plan has neither meshes nor this compile's dump)
        plan_from_cache = not (check or self.config.collect_unsupported or dumping())
        start = time.perf_counter()
        with tracker.tracing_for_backend(self.config.layout), dispatch_modes.graph_call():
            compiled = compile_inner(
                self.config.inner, keyed_gm, inputs, plan, inductor_patches, placeholders, plan_from_cache
            )
        plan.compile_seconds = time.perf_counter() - start
        self.plans.append(plan)
        write_plan(plan)
        graph = CompiledGraph(compiled, plan, placeholders, device, check, self.config.verify, output_layouts)

        def run(*args: Any) -> Any:  # a function, as Dynamo's and depyf's bookkeeping expect
            return graph(*args)

        return run

    def __repr__(self) -> str:
        batched = ", batched=True" if self.config.batched else ""
        return f"compile_rng.backend(layout={self.config.layout!r}, inner={self.config.inner!r}{batched})"


def backend(
    layout: str = "tracker", inner: str = "inductor", verify: Any = False, batched: bool = False,
    *, mode: str | None = None,
) -> Backend:
    """A ``torch.compile`` backend that makes every random op functional.

    ``layout="tracker"`` reproduces eager DTensor semantics (a plain tensor is a replica
    on a one-rank mesh); ``layout="invariant"`` gives every element the counter of its
    global row-major index, so the full tensor does not depend on the sharding
    (``mode=`` is the deprecated spelling). ``inner`` is the compiler that runs after the pass:
    ``"inductor"`` (fused kernels) or ``"aot_eager"`` (for debugging); ``torch.compile``'s
    own ``mode=`` and ``options=`` configure that Inductor. The returned
    object's ``plans`` lists, per compiled graph (the last 1024), the rewritten ops, their offsets,
    the total advance and the graph code after the pass. ``verify=True`` (or the
    environment variable ``COMPILE_RNG_VERIFY=1``) checks before every call that the
    ranks that run the graph (those of its DTensor ops' meshes; the default group for a
    graph with none) agree on seed, offset and graph, and raises on every one if not;
    ``verify=mesh`` (or a process group) names the ranks, as a pipeline stage must for
    a graph on plain tensors.

    ``batched=True`` (``layout="invariant"`` only) says that dim 0 of every random op's
    tensor in these graphs is the batch: the tensor holds this rank's rows of the global
    batch of a training step (:func:`compile_rng.step`), and every element draws the
    counter of its index in the global, single-device tensor - so data parallelism and
    microbatching do not change the values (:mod:`compile_rng.eager.batches`).
    """
    layout, mode = layouts.layout_or_compile_mode("compile_rng.backend", layout, mode)
    if mode is not None:
        raise ValueError(
            f"compile_rng.backend(mode={mode!r}): torch.compile's mode goes to torch.compile(..., mode=...)"
        )
    if batched and layout != "invariant":
        raise ValueError("compile_rng.backend: batched=True needs layout='invariant' (tracker layout follows eager DTensor)")
    if inner not in INNERS:
        raise ValueError(f"compile_rng.backend: inner must be one of {INNERS}, got {inner!r}")
    return Backend(BackendConfig(layout, inner, verify=verify, batched=batched))


#: The backend registered as ``torch.compile(..., backend="compile_rng")``.
compile_rng_backend = backend()
