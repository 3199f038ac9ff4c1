"""The rng key as a compiled graph's extra input: the device of the graph's stream, and
the copy of Dynamo's graph with the key placeholder appended."""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from compile_rng._torch import torch_internals
from compile_rng.stream import state


def graph_device(gm: fx.GraphModule, example_inputs: list) -> torch.device:
    """The device of the graph's stream: the first accelerator among its inputs and
    values (a CUDA model's graph), else the CPU. The pass refuses a random op elsewhere."""
    values = [*example_inputs, *(n.meta.get("example_value") for n in gm.graph.nodes)]
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type in state.ACCELERATORS:
            return torch.device(value.device.type, value.device.index or 0)
    return torch.device("cpu")


def with_key_input(
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
