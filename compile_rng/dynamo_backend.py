"""The ``torch.compile`` backend: capture -> functionalize random ops -> inner compiler -> run.

The backend appends one input, the rng ``key`` (``[seed, base]`` int64), to the Dynamo
graph; AOTAutograd carries it into the joint graph, where
:func:`compile_rng.passes.functionalize_rng.functionalize_rng` rewrites every random op
to read it. At run time a thin wrapper reserves the graph's total advance from the
state *before* calling the compiled graph (so a call that raises still consumed its
counters: the state is always "advanced by the whole graph") and passes the key.

Caches: the pass's :meth:`JointPass.uuid` (compile_rng's sources, the layout) is in
Inductor's and AOTAutograd's cache keys. Inductor's FX-graph key holds a DeviceMesh
input by its ranks and layout (the coordinate is read at run time; a value tracing
baked in is in the graph's code): one artifact serves every rank. AOTAutograd's key
hashes the graph before tracing, so a DTensor graph's key gets this process's rank and
groups mixed in (:func:`compile_rng.plan_store.process_context`). A compile that runs
the pass files its plan under its AOTAutograd key (:mod:`compile_rng.plan_store`); an
AOTAutograd hit, which skips the pass, loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import fx

from compile_rng.passes.functionalize_rng import BATCH_SYMBOLS, ROWS_TOTAL, RngPlan, functionalize_rng

from . import dispatch_modes, local_shards, local_values, plan_store, state, torch_internals, tracker, verify
from .dumps import dumping, write_plan
from .ops import make_key
from .random_ops import INPLACE, RULES, is_random
from .rows import Rows, current_rows

INNERS = ("inductor", "aot_eager")


@functools.cache
def source_hash() -> str:
    """A hash of compile_rng's sources (the pass, the rules, the lowerings, the kernels):
    everything that decides a compiled graph's code besides what Inductor hashes itself."""
    import compile_rng
    import compile_rng.passes

    digest = hashlib.sha256(torch.__version__.encode())
    for folder in (Path(compile_rng.__file__).parent, Path(compile_rng.passes.__file__).parent):
        for path in sorted([*folder.glob("*.py"), *folder.glob("csrc/*.c")]):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


class JointPass(torch_internals.CustomGraphPass):
    """compile_rng's rewrite as Inductor's ``joint_custom_pre_pass`` (then the user's own
    pass, if any). Its :meth:`uuid` is what Inductor's FX-graph and AOTAutograd's caches
    key the pass on: compile_rng's sources and the layout - no rank, coordinate or device
    (the rewritten graph computes the coordinate at run time), so one Inductor artifact
    serves every rank (a DTensor graph's AOTAutograd key gets the rank besides: see the
    module's docstring). A user pass without a uuid makes it ``None``: the caches are then
    bypassed."""

    def __init__(self, plan: RngPlan, user_pass: Callable | None = None):
        self.plan, self.user_pass = plan, user_pass

    def __call__(self, graph: fx.Graph) -> None:
        # Inductor lowers the graph after this pass; the lowerings are imported here, not
        # per compile: an AOTAutograd cache hit neither runs the pass nor needs them (1 s)
        from . import lowering  # noqa: F401

        functionalize_rng(graph, self.plan)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Any:
        user = None
        if self.user_pass is not None:
            user = self.user_pass.uuid() if isinstance(self.user_pass, torch_internals.CustomGraphPass) else None
            if user is None:
                return None
        return (source_hash(), self.plan.mode, self.plan.batched, self.plan.collect_unsupported, user)


@dataclass(frozen=True)
class BackendConfig:
    mode: str = "tracker"
    inner: str = "inductor"
    collect_unsupported: bool = False  # explain(): list unsupported ops instead of raising
    verify: Any = False  # True or a DeviceMesh / ProcessGroup: check that ranks agree before every call (verify.py)
    batched: bool = False  # dim 0 of every random op is the step's batch (batches.py)


def input_symbols(placeholders: Sequence[fx.Node]) -> dict[sympy.Symbol, plan_store.Position]:
    """Where each size symbol of a Dynamo graph is read from its call arguments:
    ``(input index, dim)``, dim None for a SymInt input (the first input that has it)."""
    found: dict[sympy.Symbol, plan_store.Position] = {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("example_value")
        dims = [(None, val)] if isinstance(val, torch.SymInt) else (
            list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        )
        for dim, v in dims:
            if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
                found.setdefault(v.node.expr, (i, dim))
    return found


class _SizeFn:
    """Evaluates a size expression of the graph (its total advance, its batch rows) for
    the actual call arguments; the batch symbols are given per call."""

    def __init__(self, expr: sympy.Expr, placeholders: Sequence[fx.Node]):
        self.expr = sympy.sympify(expr)
        self.constant = int(self.expr) if self.expr.is_Integer else None
        needed = self.expr.free_symbols - set(BATCH_SYMBOLS)
        positions = input_symbols(placeholders)
        self.bindings = [(sym, *positions[sym]) for sym in needed if sym in positions]
        needed = needed - set(positions)
        if needed:
            raise NotImplementedError(
                f"compile_rng: the random-op advance {self.expr} depends on {sorted(map(str, needed))}, "
                "which no graph input provides"
            )

    def __call__(self, args: Sequence[Any], batch: dict | None = None) -> int:
        if self.constant is not None:
            return self.constant
        env = {
            sym: int(args[i] if dim is None else args[i].shape[dim]) for sym, i, dim in self.bindings
        }
        return int(self.expr.xreplace({**env, **(batch or {})}))


class _BatchKey:
    """A batched graph's rows for a call (:mod:`compile_rng.batches`) and its key."""

    def __init__(self, plan: RngPlan, placeholders: Sequence[fx.Node], device: torch.device):
        self.name, self.device = plan.name, device
        self.draws = plan.local_rows is not None  # a graph without random ops has no batch
        self.local_rows = _SizeFn(plan.local_rows if self.draws else 0, placeholders)

    def rows(self, args: Sequence[Any]) -> Rows:
        count = self.local_rows(args)
        rows = current_rows()
        if rows is None or not self.draws:
            return Rows(0, count, count)
        if rows.count != count:
            raise ValueError(
                f"compile_rng: the batched graph {self.name} draws on activations of {count} rows, but the "
                f"enclosing compile_rng.step / microbatch holds {rows.count} rows of this rank's batch; "
                "pass the rows of the batch this call processes"
            )
        return rows

    def __call__(self, seed: int, offset: int, rows: Rows) -> torch.Tensor:
        return make_key(seed, offset, self.device, rows=(rows.start, rows.total))


class _Decompositions(dict):
    """Inductor's decompositions minus the random ops the pass rewrites. Inductor's cache
    key pickles the table; some entries are C++ builtins, so it pickles as the function
    that builds it (its result is decided by compile_rng's sources and torch's, both in
    the key already)."""

    def __reduce__(self) -> tuple:
        return (_decompositions, ())


def _decompositions() -> _Decompositions:
    # The rewrite handles these itself; Inductor's decompositions would change their values.
    handled = set(RULES) | set(INPLACE) | {torch.ops.aten.native_dropout_backward.default}
    return _Decompositions(
        {op: fn for op, fn in torch_internals.inductor_decompositions().items() if op not in handled}
    )


def _inductor_compile(
    gm: fx.GraphModule, inputs: list, plan: RngPlan, inductor_patches: dict, placeholders: Sequence[fx.Node],
    plan_from_cache: bool,
) -> Callable:
    """Inductor with the pass as its joint pass, and with AOTAutograd's cache where
    ``plan_from_cache``: a hit there returns the graph untraced (the pass does not run),
    and ``plan`` is then loaded as the compile that ran the pass filed it
    (:mod:`compile_rng.plan_store`); a hit with no plan filed compiles again without
    that cache and files the plan. Either way ``plan`` describes the compiled graph."""
    patches = {**inductor_patches, "joint_custom_pre_pass": JointPass(plan, inductor_patches.get("joint_custom_pre_pass"))}
    decompositions = _decompositions()

    def compile_without_autograd_cache() -> Callable:
        with torch_internals.autograd_cache_off(), torch_internals.rank_free_mesh_cache_keys():
            return torch_internals.inductor_compile(gm, inputs, patches, decompositions)

    if not plan_from_cache:
        return compile_without_autograd_cache()
    torch_internals.register_device_mesh_ops()  # a DTensor graph's cached code calls them
    context = plan_store.process_context(gm)
    with torch_internals.autograd_cache_keys(context) as keys, torch_internals.rank_free_mesh_cache_keys():
        compiled = torch_internals.inductor_compile(gm, inputs, patches, decompositions)
    key = keys[0] if keys else None
    positions = input_symbols(placeholders)
    if plan.cached:  # an AOTAutograd hit: the graph came back untraced
        filed = plan_store.load(key, {pos: sym for sym, pos in positions.items()}) if key else None
        if filed is not None:
            for f in dataclasses.fields(RngPlan):
                if f.name not in ("name", "pass_runs", "pass_seconds"):  # those are this compile's
                    setattr(plan, f.name, getattr(filed, f.name))
            return compiled
        # No plan filed for it (the folder was cleared): compile with the pass, and file
        # its plan under the hit's key, so the next process finds it.
        compiled = compile_without_autograd_cache()
    if key is not None:
        plan_store.save(key, plan, positions)
    return compiled


def _compile_inner(
    cfg: BackendConfig, gm: fx.GraphModule, inputs: list, plan: RngPlan, inductor_patches: dict,
    placeholders: Sequence[fx.Node], plan_from_cache: bool,
) -> Callable:
    if cfg.inner == "inductor":
        return _inductor_compile(gm, inputs, plan, inductor_patches, placeholders, plan_from_cache)

    from functorch.compile import make_boxed_func

    rewrite = functools.partial(_rewrite_module, plan=plan)

    def fw(g, _inputs):
        rewrite(g)
        return make_boxed_func(g.forward)

    def partition(joint, joint_inputs, **kw):
        rewrite(joint)
        return torch_internals.default_partition(joint, joint_inputs, **kw)

    # The random ops Inductor decomposes (rrelu's noise into uniform) are decomposed here
    # too, so the pass sees the same random ops whichever compiler follows it.
    random_decompositions = {op: fn for op, fn in _decompositions().items() if is_random(op)}
    with torch_internals.autograd_cache_off():
        return torch_internals.aot_autograd(
            fw_compiler=fw, bw_compiler=fw, partition_fn=partition, decompositions=random_decompositions
        )(gm, inputs)


def _rewrite_module(gm: fx.GraphModule, plan: RngPlan) -> None:
    functionalize_rng(gm.graph, plan)
    gm.recompile()


def _graph_device(gm: fx.GraphModule, example_inputs: list) -> torch.device:
    """The device of the graph's stream: the first accelerator among its inputs and
    values (a CUDA model's graph), else the CPU. The pass refuses a random op elsewhere."""
    values = [*example_inputs, *(n.meta.get("example_value") for n in gm.graph.nodes)]
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type in state.ACCELERATORS:
            return torch.device(value.device.type, value.device.index or 0)
    return torch.device("cpu")


def _with_key_input(
    gm: fx.GraphModule, example_inputs: list, batched: bool, device: torch.device
) -> tuple[fx.GraphModule, list]:
    """A copy of ``gm`` with the key placeholder appended on ``device``, and its example
    inputs (a batched graph's key also holds its rows: ``[seed, base, row_start, rows_total]``).

    Dynamo keeps using ``gm`` after the backend returns, so it is not modified.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, env)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
        key = graph.placeholder("compile_rng_key")
    # AOTAutograd maps Dynamo inputs to user sources; the key has none (like the
    # intermediate inputs DDPOptimizer creates).
    torch_internals.mark_sourceless_input(key)
    graph.output(output)
    fake_mode = torch_internals.detect_fake_mode(example_inputs)
    with fake_mode or contextlib.nullcontext():  # fake: no real allocation on the device
        example = torch.zeros(4 if batched else 2, dtype=torch.int64, device=device)
    key.meta["example_value"] = key.meta["val"] = example
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    torch_internals.copy_dynamo_input_sources(gm, new_gm, env)
    return new_gm, [*example_inputs, example]


def _graph_name(gm: fx.GraphModule) -> str:
    """``<function>.<compile id>`` of the graph Dynamo hands over (for file names)."""
    func = torch_internals.traced_code_name() or "graph"
    compile_id = torch_internals.graph_compile_id(gm).replace("/", "_")
    return f"{func.strip('<>')}.{compile_id}"


def _warn_if_split(gm: fx.GraphModule) -> None:
    split = torch_internals.graph_break(gm)
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


class _LocalPieces:
    """A graph's traffic in tensor-parallel ranks' local pieces with eager code
    (:mod:`compile_rng.local_values`): the pieces it returns are recorded for the eager
    code after it; a recorded piece among the inputs its plain random ops are computed
    from is refused (the graph would draw it as a replica: it was traced as a plain
    input, so the layout is unknown in it)."""

    def __init__(self, plan: RngPlan, inputs: int, outputs: list):
        self.plan, self.outputs = plan, outputs if any(v is not None for v in outputs) else None
        self.inputs = inputs

    def check(self, args: Sequence[Any]) -> None:
        draws = self.plan.draw_inputs
        if not draws or not local_values.touches(args):
            return
        # the traced graph's inputs are the Dynamo graph's unless AOTAutograd dropped or merged some
        positions = draws if self.plan.traced_inputs == self.inputs else range(len(args))
        for i in positions:
            if local_values.lookup(args[i]) is not None:
                ops = ", ".join(f"{op.original} at {op.source}" for op in self.plan.ops if op.sharding is None)
                raise NotImplementedError(
                    f"compile_rng: the compiled graph {self.plan.name} draws random numbers ({ops}) on values "
                    f"computed from its input {i}, a plain tensor that is this rank's piece of a sharded DTensor "
                    "(to_local() in code that ran before this graph: a graph break separates them). The graph "
                    "would draw it as a replica - every rank the same values for different pieces. Keep "
                    "to_local() and the random op in one graph (remove the graph break), or keep the tensor a "
                    "DTensor (use_local_output=False in the TP plan)"
                )

    def record(self, outputs: Any) -> Any:
        if self.outputs is not None and local_values.is_recording():
            for value, layout in zip(outputs, self.outputs):
                local_values.record(value, layout)
        return outputs


class Backend:
    """A ``torch.compile`` backend; ``plans`` keeps what the pass did, one per graph."""

    def __init__(self, config: BackendConfig):
        self.config = config
        self.plans: list[RngPlan] = []

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None, options: dict | None = None
    ) -> Callable:
        """Compile ``gm``; ``mode`` and ``options`` are ``torch.compile``'s, for Inductor."""
        inductor_patches = torch_internals.inductor_options(mode, options)
        if inductor_patches and self.config.inner != "inductor":
            raise ValueError(
                f"compile_rng backend: torch.compile(mode={mode!r}, options=...) configures Inductor, "
                f"but this backend's inner compiler is {self.config.inner!r}"
            )
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        _warn_if_split(gm)
        plan = RngPlan(
            name=_graph_name(gm), mode=self.config.mode, collect_unsupported=self.config.collect_unsupported,
            batched=self.config.batched,
        )
        device = _graph_device(gm, list(example_inputs))
        keyed_gm, inputs = _with_key_input(gm, list(example_inputs), self.config.batched, device)
        output_layouts = local_shards.rewrite(keyed_gm)  # random ops on a TP rank's plain local tensors
        check = verify.enabled(self.config.verify)
        # verify needs the ops' meshes, explain and dumps the pass's own record: the
        # pass runs for them (a filed plan has neither meshes nor this compile's dump)
        plan_from_cache = not (check or self.config.collect_unsupported or dumping())
        start = time.perf_counter()
        with tracker.tracing_for_backend(self.config.mode), dispatch_modes.graph_call():
            compiled = _compile_inner(
                self.config, keyed_gm, inputs, plan, inductor_patches, placeholders, plan_from_cache
            )
        plan.compile_seconds = time.perf_counter() - start
        advance = _SizeFn(plan.total_advance, placeholders)
        key_of = _BatchKey(plan, placeholders, device) if plan.batched else None
        self.plans.append(plan)
        write_plan(plan)

        graph_signature = verify.signature(plan)
        groups = []
        pieces = _LocalPieces(plan, len(placeholders), output_layouts)

        def run(*args):
            if check:
                if not groups:  # the process groups exist once the graph runs
                    meshes = list({id(op.mesh): op.mesh for op in plan.ops if op.mesh is not None}.values())
                    groups.extend(verify.groups_of(meshes, self.config.verify))
                verify.check(plan.name, *state.get_state(device), graph_signature, groups)
            if plan.batched:
                rows = key_of.rows(args)
                seed, offset = state.advance(advance(args, {ROWS_TOTAL: rows.total}), device)
                key = key_of(seed, offset, rows)
            else:
                seed, offset = state.advance(advance(args), device)
                key = make_key(seed, offset, device)
            pieces.check(args)
            with dispatch_modes.graph_call():
                return pieces.record(compiled(*args, key))

        return run

    def __repr__(self) -> str:
        batched = ", batched=True" if self.config.batched else ""
        return f"compile_rng.backend(layout={self.config.mode!r}, inner={self.config.inner!r}{batched})"


def layout_argument(where: str, layout: str, mode: str | None) -> tuple[str, str | None]:
    """``(layout, torch.compile mode)`` from a call that takes both: ``mode=`` naming a
    counter layout is the old spelling of ``layout=`` (deprecated: ``mode`` is
    ``torch.compile``'s)."""
    if mode not in dispatch_modes.MODES:
        return layout, mode
    warnings.warn(
        f"{where}(mode={mode!r}) names the counter layout; spell it layout={mode!r} "
        "(mode= is torch.compile's: 'default', 'reduce-overhead', 'max-autotune', ...)",
        DeprecationWarning,
        stacklevel=3,
    )
    if layout not in ("tracker", mode):
        raise ValueError(f"{where}: layout={layout!r} and mode={mode!r} disagree; pass layout= only")
    return mode, None


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
    object's ``plans`` lists, per compiled graph, the rewritten ops, their offsets,
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
    microbatching do not change the values (:mod:`compile_rng.batches`).
    """
    if mode is not None:
        layout, mode = layout_argument("compile_rng.backend", layout, mode)
        if mode is not None:
            raise ValueError(
                f"compile_rng.backend(mode={mode!r}): torch.compile's mode goes to torch.compile(..., mode=...)"
            )
    if batched and layout != "invariant":
        raise ValueError("compile_rng.backend: batched=True needs layout='invariant' (tracker layout follows eager DTensor)")
    if layout not in dispatch_modes.MODES:
        raise ValueError(f"compile_rng.backend: layout must be one of {dispatch_modes.MODES}, got {layout!r}")
    if inner not in INNERS:
        raise ValueError(f"compile_rng.backend: inner must be one of {INNERS}, got {inner!r}")
    return Backend(BackendConfig(layout, inner, verify=verify, batched=batched))


#: The backend registered as ``torch.compile(..., backend="compile_rng")``.
compile_rng_backend = backend()
