"""The rng key as a compiled graph's extra input: the device of the graph's stream, and
the copy of Dynamo's graph with the key placeholder appended (a batched graph's key
table before it: :mod:`compile_rng.passes.batch_rows`)."""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from compile_rng._torch import core_internals, dynamo_internals
from compile_rng.stream import state


def graph_device(gm: fx.GraphModule, example_inputs: list) -> torch.device:
    """The device of the graph's stream: the first accelerator among its inputs and
    values (a CUDA model's graph), else the CPU. The pass refuses a random op elsewhere."""
    values = [*example_inputs, *(n.meta.get("example_value") for n in gm.graph.nodes)]
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type in state.ACCELERATORS:
            return torch.device(value.device.type, value.device.index or 0)
    return torch.device("cpu")


def key_table_rows(gm: fx.GraphModule) -> int:
    """Rows of a batched graph's key table: one per random op after AOTAutograd, which
    is at most one per call in Dynamo's graph and the graphs it holds (checkpointed
    regions); the pass checks it."""
    return max(1, sum(
        1 for module in gm.modules() if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes if node.op in ("call_function", "call_method", "call_module")
    ))


def with_key_input(
    gm: fx.GraphModule, example_inputs: list, batched: bool, device: torch.device, table_rows: int = 0
) -> tuple[fx.GraphModule, list]:
    """A copy of ``gm`` with the key placeholder appended on ``device``, and its example
    inputs (a batched graph's key also holds its rows: ``[seed, base, row_start, rows_total]``,
    and its key table of ``table_rows`` rows comes before it).

    Dynamo keeps using ``gm`` after the backend returns, so it is not modified.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, env)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    shapes = [(table_rows, 2), (4,)] if batched else [(2,)]
    names = ["compile_rng_key_table", "compile_rng_key"][-len(shapes):]
    added = []
    fake_mode = core_internals.detect_fake_mode(example_inputs)
    anchor = placeholders[-1] if placeholders else None
    for name, shape in zip(names, shapes):
        with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(None):
            node = anchor = graph.placeholder(name)
        # AOTAutograd maps Dynamo inputs to user sources; these have none (like the
        # intermediate inputs DDPOptimizer creates).
        dynamo_internals.mark_sourceless_input(node)
        with fake_mode or contextlib.nullcontext():  # fake: no real allocation on the device
            example = torch.zeros(shape, dtype=torch.int64, device=device)
        node.meta["example_value"] = node.meta["val"] = example
        added.append(example)
    graph.output(output)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    dynamo_internals.copy_dynamo_input_sources(gm, new_gm, env)
    return new_gm, [*example_inputs, *added]
