"""The compilers that run after the pass: Inductor (with the pass as its joint pass, and
the plan of an AOTAutograd cache hit restored from :mod:`compile_rng.compiled.plan_store`)
or AOTAutograd with eager kernels (``inner="aot_eager"``, for debugging)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from torch import fx

from compile_rng._torch import distributed_internals, dynamo_internals, inductor_internals
from compile_rng.compiled import plan_store
from compile_rng.compiled.joint_pass import JointPass
from compile_rng.compiled.symbols import input_symbols
from compile_rng.passes.functionalize_rng import functionalize_rng
from compile_rng.passes.plan import RngPlan
from compile_rng.semantics.random_ops import DECOMPOSED_IN_GRAPHS, INPLACE, RULES, is_random

INNERS = ("inductor", "aot_eager")


class Decompositions(dict):
    """Inductor's decompositions minus the random ops the pass rewrites. Inductor's cache
    key pickles the table; some entries are C++ builtins, so it pickles as the function
    that builds it (its result is decided by compile_rng's sources and torch's, both in
    the key already)."""

    def __reduce__(self) -> tuple:
        return (decompositions, ())


def decompositions() -> Decompositions:
    # The rewrite handles these itself; Inductor's decompositions would change their values.
    handled = (set(RULES) - DECOMPOSED_IN_GRAPHS) | set(INPLACE) | {torch.ops.aten.native_dropout_backward.default}
    return Decompositions(
        {op: fn for op, fn in inductor_internals.inductor_decompositions().items() if op not in handled}
    )


def inductor_compile(
    gm: fx.GraphModule, inputs: list, plan: RngPlan, inductor_patches: dict, placeholders: Sequence[fx.Node],
    plan_from_cache: bool,
) -> Callable:
    """Inductor with the pass as its joint pass, and with AOTAutograd's cache where
    ``plan_from_cache``: a hit there returns the graph untraced (the pass does not run),
    and ``plan`` is then loaded as the compile that ran the pass filed it
    (:mod:`compile_rng.compiled.plan_store`); a hit with no plan filed compiles again without
    that cache and files the plan. Either way ``plan`` describes the compiled graph."""
    patches = {**inductor_patches, "joint_custom_pre_pass": JointPass(plan, inductor_patches.get("joint_custom_pre_pass"))}
    table = decompositions()

    def compile_without_autograd_cache() -> Callable:
        with dynamo_internals.autograd_cache_off(), inductor_internals.rank_free_mesh_cache_keys():
            return inductor_internals.inductor_compile(gm, inputs, patches, table)

    if not plan_from_cache:
        return compile_without_autograd_cache()
    distributed_internals.register_device_mesh_ops()  # a DTensor graph's cached code calls them
    context = plan_store.process_context(gm)
    with dynamo_internals.autograd_cache_keys(context) as keys, inductor_internals.rank_free_mesh_cache_keys():
        compiled = inductor_internals.inductor_compile(gm, inputs, patches, table)
    key = keys[0] if keys else None
    positions = input_symbols(placeholders)
    if plan.loaded_from_cache:  # an AOTAutograd hit: the graph came back untraced
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


def compile_inner(
    inner: str, gm: fx.GraphModule, inputs: list, plan: RngPlan, inductor_patches: dict,
    placeholders: Sequence[fx.Node], plan_from_cache: bool,
) -> Callable:
    if inner == "inductor":
        return inductor_compile(gm, inputs, plan, inductor_patches, placeholders, plan_from_cache)

    from functorch.compile import make_boxed_func

    rewrite = functools.partial(rewrite_module, plan=plan)

    def fw(g, _inputs):
        rewrite(g)
        return make_boxed_func(g.forward)

    def partition(joint, joint_inputs, **kw):
        rewrite(joint)
        return dynamo_internals.default_partition(joint, joint_inputs, **kw)

    # The random ops Inductor decomposes (rrelu's noise into uniform) are decomposed here
    # too, so the pass sees the same random ops whichever compiler follows it.
    random_decompositions = {op: fn for op, fn in decompositions().items() if is_random(op)}
    with dynamo_internals.autograd_cache_off():
        return dynamo_internals.aot_autograd(
            fw_compiler=fw, bw_compiler=fw, partition_fn=partition, decompositions=random_decompositions
        )(gm, inputs)


def rewrite_module(gm: fx.GraphModule, plan: RngPlan) -> None:
    functionalize_rng(gm.graph, plan)
    gm.recompile()
