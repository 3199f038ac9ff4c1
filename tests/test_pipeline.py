"""Pipeline parallelism keeps the single process's masks and loss curve
(examples/pipeline_parity.py, ``compile_rng.step(names=...)``).

* the rows of a microbatch are ``torch.tensor_split``'s (the schedules' split);
* names, not order: a stage's masks do not change when another stage adds a random op,
  and they do change when its own ops change (the comparison can fail);
* eager activation checkpointing recomputes the forward's masks; what cannot be named
  is refused with an error naming the op;
* on real gloo ranks, a GPT's block's dropped elements under 1F1B with 4 microbatches
  are bitwise the single process's, forward and backward; torch's own generator
  (no ``names=``) is not;
* (slow) every step's float64 loss of GPT and transformers Llama under GPipe, 1F1B,
  interleaved 1F1B and interleaved zero bubble, PP=2 eager, with full or selective AC
  (``checkpoint_wrapper``), with compiled blocks (in place after AC, torchtitan's recipe,
  or replaced by ``torch.compile(block)``) or a compiled stage,
  PP=2xDP=2 (FSDP2) and PP=2xTP=2, eager or with AC and compiled blocks, is within 1e-9
  relative of the single process's, for 2, 4 and 8 microbatches (CI runs the cells of
  :data:`CI_JOBS`, ``make test-all`` the whole matrix); stages seeded ``seed + pp_rank``
  are refused.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import compile_rng
from compile_rng.eager.activation_names import microbatch_rows, microbatch_rows_of
from compile_rng.launch import spawn
from compile_rng.semantics.rows import Rows, current_rows

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import pipeline_parity as pp  # noqa: E402

STEPS = 3
TOLERANCE = 1e-9


def _batch():
    return pp.global_batches(pp.CONFIG, 1)[0]


def _forward_backward(model, tokens, targets, names=True, microbatches=1):
    """One step's loss and the model's gradients (float64)."""
    torch.manual_seed(pp.SEED)
    step = compile_rng.step(tokens.shape[0], names=model) if names else compile_rng.step(tokens.shape[0])
    with step as s:
        for rows, labels in zip(tokens.tensor_split(microbatches), targets.tensor_split(microbatches)):
            with s.microbatch(rows.shape[0]):
                logits = model(rows)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) / microbatches
                loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("count", [1, 5, 8, 13])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8])
def test_microbatch_rows_are_tensor_split_rows(count, microbatches):
    rows = torch.arange(100, 100 + count)
    pieces = rows.tensor_split(microbatches)
    for i, piece in enumerate(pieces):
        got = microbatch_rows(Rows(100, count, 200), microbatches, i)
        assert (got.count, got.total) == (piece.numel(), 200)
        if piece.numel():
            assert got.start == piece[0].item()


class _Stage:
    """A stand-in ``PipelineStage``: its per-microbatch methods return what ran and the
    rows current in it."""

    def __init__(self):
        self.submod = torch.nn.Linear(2, 2)

    def forward_one_chunk(self, chunk, *args):
        return "the class's", current_rows()

    def backward_one_chunk(self, chunk, *args):
        return "the class's", current_rows()


def test_a_step_gives_a_stage_back_the_methods_it_had():
    """The step wraps a stage's methods on the instance; after it the instance has what it
    had before: its own attribute (a user's patch, an outer block's wrapper), or none."""
    stage = _Stage()
    own = stage.forward_one_chunk = lambda chunk, *args: ("the instance's", current_rows())
    rows = Rows(0, 4, 4)
    with microbatch_rows_of([stage], rows, 2):
        outer = stage.forward_one_chunk
        assert outer(1) == ("the instance's", microbatch_rows(rows, 2, 1))  # the instance's, wrapped
        with microbatch_rows_of([stage], rows, 2):  # an inner block over the same stage wraps the wrapper
            assert stage.forward_one_chunk is not outer and stage.forward_one_chunk(1)[0] == "the instance's"
        assert stage.forward_one_chunk is outer and stage.backward_one_chunk(0)[0] == "the class's"
    assert stage.forward_one_chunk is own
    assert "backward_one_chunk" not in vars(stage)


def _dropped_of_last_block(model, tokens, targets, names=True):
    captured = []
    pp.capture_dropped(model, "3", captured)
    _forward_backward(model, tokens, targets, names=names)
    return {kind: mask for kind, _, mask in captured}


def test_a_stage_keeps_its_masks_when_another_stage_adds_a_random_op():
    tokens, targets = _batch()

    def with_one_more_random_op():
        model = pp.whole_model("gpt")
        first = model.blocks["0"].mlp
        original = first.forward
        first.forward = lambda x: F.dropout(original(x), 0.2, True)  # in block 0, another stage's
        return model

    before = _dropped_of_last_block(pp.whole_model("gpt"), tokens, targets)
    after = _dropped_of_last_block(with_one_more_random_op(), tokens, targets)
    assert set(before) == {"attn forward", "attn backward", "mlp forward", "mlp backward"}
    for kind in before:
        assert torch.equal(before[kind], after[kind]), kind
        assert 0 < before[kind].float().mean() < 0.3  # dropout p=0.1 ran
    # In the step's sequence (no names) block 3 draws after block 0: its masks move.
    sequence_before = _dropped_of_last_block(pp.whole_model("gpt"), tokens, targets, names=False)
    sequence_after = _dropped_of_last_block(with_one_more_random_op(), tokens, targets, names=False)
    assert not torch.equal(sequence_before["mlp forward"], sequence_after["mlp forward"])


def test_names_follow_the_module_not_the_call_order():
    """Running two blocks in the other order changes their inputs, not their masks (a
    dropout's mask does not depend on the values it drops)."""
    tokens, targets = _batch()

    def masks(order):
        model = pp.whole_model("gpt")
        model.blocks = torch.nn.ModuleDict({k: model.blocks[k] for k in order})
        captured = {"1": [], "2": []}
        for block, into in captured.items():
            pp.capture_dropped(model, block, into)
        _forward_backward(model, tokens, targets)
        return {block: {kind: m for kind, _, m in into} for block, into in captured.items()}

    ordered, swapped = masks("0123"), masks("0213")
    for block in ("1", "2"):
        assert len(ordered[block]) == 4
        for kind, mask in ordered[block].items():
            assert torch.equal(mask, swapped[block][kind]), (block, kind)
    assert not torch.equal(ordered["1"]["mlp forward"], ordered["2"]["mlp forward"])


def test_eager_activation_checkpointing_recomputes_the_forward_masks():
    tokens, targets = _batch()
    plain_loss, plain_grads = _forward_backward(pp.whole_model("gpt"), tokens, targets)
    model = pp.whole_model("gpt")
    for block in model.blocks.values():
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    loss, grads = _forward_backward(model, tokens, targets)
    assert torch.equal(loss, plain_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=0, atol=1e-14)


def test_microbatching_one_process_keeps_the_curve():
    reference = pp.train_single("gpt", 2)
    for microbatches in (2, 4, 8):
        curve = pp.train_single("gpt", 2, microbatches)
        assert pp.max_relative_difference(curve, reference) < TOLERANCE, microbatches


def test_what_cannot_be_named_is_refused():
    from torch import fx

    model = pp.whole_model("gpt")
    tokens, _ = _batch()
    with pytest.raises(NotImplementedError, match="pipeline\\(\\) split"):
        with compile_rng.step(8, names=fx.symbolic_trace(torch.nn.Linear(2, 2))):
            pass
    with pytest.raises(RuntimeError, match="outside the forward of any module"):
        with compile_rng.step(8, names=model):
            torch.nn.functional.dropout(torch.ones(8, 3, dtype=torch.float64), 0.5, True)
    with pytest.raises(ValueError, match="microbatches="):
        with compile_rng.step(8, names=model, microbatches=0):
            pass

    class Stage:  # what a PipelineStage offers the step
        def __init__(self, submod):
            self.submod = submod

        def forward_one_chunk(self, chunk, *args):
            return self.submod(*args)

        def backward_one_chunk(self, chunk, *args):
            pass

    class Drawing(torch.nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, True)

    stage = Stage(Drawing())
    with pytest.raises(ValueError, match="n_microbatches"):
        with compile_rng.step(8, names=[stage]):
            pass
    with pytest.raises(NotImplementedError, match="stage module's own forward"):
        with compile_rng.step(8, names=[stage], microbatches=2):
            stage.forward_one_chunk(0, torch.ones(4, 3))
    with pytest.raises(ValueError, match="microbatch 2"):
        with compile_rng.step(8, names=[stage], microbatches=2):
            stage.forward_one_chunk(2, torch.ones(4, 3))
    assert "forward_one_chunk" not in vars(stage)  # the step put the methods back

    shared = pp.whole_model("gpt")
    mlp = shared.blocks["0"].mlp
    twice = lambda x: mlp.__class__.__call__(mlp, mlp.__class__.__call__(mlp, x) * 0 + x)  # noqa: E731
    shared.blocks["0"].forward = lambda x: checkpoint(twice, x, use_reentrant=False)
    with pytest.raises(NotImplementedError, match="ran more than once in a forward"):
        _forward_backward(shared, *_batch())


# --- real ranks --------------------------------------------------------------------------


def _capture_last_block(schedule: str, parallelism: str) -> list:
    """What the last block's attention and MLP dropouts drop on this rank, forward and
    backward (``pp.capture_dropped``; empty on a rank without the block), in one step of
    the GPT under ``schedule`` and ``parallelism`` with 4 microbatches, from the single
    process's seed, over this rank's data-parallel share of the batch (all of it without
    data parallelism)."""
    pipe = pp.Pipeline("gpt", schedule, parallelism, microbatches=4)
    captured = []
    for module in pipe.modules:
        pp.capture_dropped(module, "3", captured)
    torch.manual_seed(pp.SEED)
    tokens, targets = _batch()
    pipe.step(tokens.chunk(pipe.dp)[pipe.dp_coord], targets.chunk(pipe.dp)[pipe.dp_coord])
    return captured


def _dropped_body(rank: int, world: int, out: str) -> None:
    captured = _capture_last_block("1F1B", "PP=2")
    unnamed = pp.train_pipeline("gpt", "1F1B", "PP=2", 1, 4, named=False)  # torch's own generator
    checkpointed = pp.train_pipeline("gpt", "1F1B", "PP=2+AC", 1, 4)  # blocks in checkpoint_wrapper
    if captured:
        torch.save((captured, unnamed, checkpointed), out)


def _gathered(captured) -> dict:
    kinds = {}
    for kind, _, mask in sorted(captured, key=lambda c: (c[0], c[1])):
        kinds.setdefault(kind, []).append(mask)
    return {kind: torch.cat(masks) for kind, masks in kinds.items()}


def test_dropped_elements_of_a_stage_are_the_single_process_ones_on_real_ranks():
    tokens, targets = _batch()
    single = _dropped_of_last_block(pp.whole_model("gpt"), tokens, targets)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "captured.pt")
        spawn(_dropped_body, 2, out)
        captured, unnamed, checkpointed = torch.load(out)
    piped = _gathered(captured)
    assert set(piped) == set(single) and len(captured) == 4 * 4  # 4 kinds x 4 microbatches
    for kind, mask in single.items():
        assert torch.equal(piped[kind], mask), kind
    # without names= the stages draw from torch's generator in schedule order: another curve
    reference = pp.train_single("gpt", 1)
    assert pp.max_relative_difference(unnamed, reference) > 1e-6
    # checkpoint_wrapper around every block (names without its component) keeps the curve
    assert pp.max_relative_difference(checkpointed, reference) < TOLERANCE


# --- the parity table (slow) -----------------------------------------------------------


def _table_body(rank: int, world: int, jobs: list, out: str) -> None:
    results = {}
    for family, schedule, composition, microbatches, named in jobs:
        results[(family, schedule, composition, microbatches, named)] = pp.train_pipeline(
            family, schedule, composition, STEPS, microbatches, named
        )
    if rank == 0:
        torch.save(results, out)


def _run_jobs(world: int, jobs: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        spawn(_table_body, world, jobs, out)
        return torch.load(out)


@pytest.fixture(scope="module")
def references():
    return {family: pp.train_single(family, STEPS) for family in pp.FAMILIES}


# CI's cells, 4 microbatches unless given: every schedule eager; full and selective AC
# under every schedule across the two families; compiled stages under each kind of
# schedule (zero-bubble: a compiled backward in two halves), blocks compiled in place and
# replaced by torch.compile(block); each 4-rank composition in two schedules, one per
# family, eager. The 4-rank compiled stages (torchtitan's whole recipe with
# FSDP2, the plain TP plan with AC) and whole-stage compiles take minutes each on these
# 2-core machines: `make test-all` runs them with the rest of the matrix.
CI_JOBS = {
    2: [(family, schedule, "PP=2") for family in pp.FAMILIES for schedule in pp.SCHEDULES] + [
        ("gpt", "GPipe", "PP=2+AC"), ("gpt", "1F1B", "PP=2+SAC"), ("gpt", "Interleaved1F1B", "PP=2+SAC"),
        ("llama", "GPipe", "PP=2+SAC"), ("llama", "1F1B", "PP=2+AC"), ("llama", "InterleavedZeroBubble", "PP=2+AC"),
        ("gpt", "Interleaved1F1B", "PP=2+AC+compile"), ("gpt", "GPipe", "PP=2+SAC+compile(modules)"),
        ("gpt", "InterleavedZeroBubble", "PP=2+SAC+compile"), ("llama", "1F1B", "PP=2+AC+compile"),
        ("gpt", "1F1B", "PP=2", 2), ("gpt", "Interleaved1F1B", "PP=2", 8),
        ("llama", "GPipe", "PP=2", 4, False),  # torch's own generator: another curve
    ],
    4: [("gpt", "Interleaved1F1B", "PP=2xDP=2"), ("gpt", "1F1B", "PP=2xTP=2"),
        ("llama", "GPipe", "PP=2xTP=2"), ("llama", "1F1B", "PP=2xDP=2")],
}


def _job(cell: tuple) -> tuple:
    """``(family, schedule, composition, microbatches, named)`` of a cell (4 and True unless given)."""
    return (*cell, *(4, True)[len(cell) - 3:])


def _check_curves(world: int, jobs: list, references: dict) -> None:
    results = _run_jobs(world, jobs)
    for (family, schedule, composition, microbatches, named), curve in results.items():
        difference = pp.max_relative_difference(curve, references[family])
        print(f"pipeline_parity {family} {schedule} {composition} mb={microbatches} names={named}: {difference:.2e}")
        if named:
            assert difference < TOLERANCE, (family, schedule, composition, microbatches)
        else:
            assert difference > 1e-6, (family, schedule, composition)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_and_composition_keeps_the_single_process_curve(world, references):
    _check_curves(world, [_job(cell) for cell in CI_JOBS[world]], references)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("world", [2, 4])
def test_the_whole_schedule_compile_and_ac_matrix_keeps_the_curve(world, references):
    """The cells CI leaves out (``make test-all``): every family x schedule x composition."""
    done = {_job(cell)[:3] for cell in CI_JOBS[world]}
    jobs = [_job(job) for job in pp.JOBS if pp.COMPOSITIONS[job[2]].world == world and job not in done]
    _check_curves(world, jobs, references)


def _without_dropout_body(rank: int, world: int, out: str) -> None:
    import dataclasses

    pp.CONFIG = dataclasses.replace(pp.CONFIG, p=0.0)
    curves = {"zero bubble, compile_rng": pp.train_pipeline("gpt", "InterleavedZeroBubble", "PP=2xDP=2", STEPS)}
    compile_rng.uninstall()
    try:
        for schedule in ("InterleavedZeroBubble", "Interleaved1F1B"):
            curves[f"{schedule}, stock"] = pp.train_pipeline("gpt", schedule, "PP=2xDP=2", STEPS, named=False)
    finally:
        compile_rng.install()
    if rank == 0:
        torch.save(curves, out)


@pytest.mark.slow
@pytest.mark.sweep
def test_zero_bubble_with_fsdp2_is_another_curve_in_stock_torch(tmp_path, monkeypatch):
    """The cell the matrix leaves out for torch's sake (``pp.torch_limit``): with dropout
    off, stock torch's zero-bubble schedule over FSDP2 stages is another curve than one
    process (interleaved 1F1B is not), and compile_rng's named step gives exactly stock
    torch's curve there - the gap is not compile_rng's."""
    import dataclasses

    assert pp.torch_limit("InterleavedZeroBubble", "PP=2xDP=2").startswith("another curve")
    out = str(tmp_path / "curves.pt")
    spawn(_without_dropout_body, 4, out)
    curves = torch.load(out)
    monkeypatch.setattr(pp, "CONFIG", dataclasses.replace(pp.CONFIG, p=0.0))
    reference = pp.train_single("gpt", STEPS)
    assert curves["zero bubble, compile_rng"] == curves["InterleavedZeroBubble, stock"]
    assert pp.max_relative_difference(curves["InterleavedZeroBubble, stock"], reference) > 1e-6
    assert pp.max_relative_difference(curves["Interleaved1F1B, stock"], reference) < TOLERANCE


def _zero_bubble_fsdp2_masks_body(rank: int, world: int, out: str) -> None:
    torch.save(_capture_last_block("InterleavedZeroBubble", "PP=2xDP=2"), f"{out}.{rank}")


@pytest.mark.slow
@pytest.mark.sweep
def test_zero_bubble_with_fsdp2_draws_the_single_process_masks(tmp_path):
    """The same cell with dropout on (p=0.1): whatever torch's own gap does to the curve,
    every element the last block's attention and MLP dropouts drop, forward and backward,
    over both data-parallel ranks of the last stage, is the one process's."""
    tokens, targets = _batch()
    single = _dropped_of_last_block(pp.whole_model("gpt"), tokens, targets)
    out = str(tmp_path / "captured")
    spawn(_zero_bubble_fsdp2_masks_body, 4, out)
    captured = [c for rank in range(4) for c in torch.load(f"{out}.{rank}")]
    piped = _gathered(captured)
    assert set(piped) == set(single) and len(captured) == 4 * 4 * 2  # 4 kinds x 4 microbatches x 2 DP ranks
    for kind, mask in single.items():
        assert 0 < mask.float().mean() < 0.3, kind  # dropout ran: the comparison can fail
        assert torch.equal(piped[kind], mask), kind


def _seeded_per_stage_body(rank: int, world: int, out: str) -> None:
    pipe = pp.Pipeline("gpt", "GPipe", "PP=2", microbatches=2)
    torch.manual_seed(pp.SEED + rank)  # torchtitan's and Megatron's seed + pp_rank
    tokens, targets = _batch()
    with pytest.raises(RuntimeError, match="seed \\+ pp_rank.*compile_rng.run_seed"):
        pipe.step(tokens, targets)
    # the same seeding, with the run's seed declared once: the single process's curve
    losses = pp.train_pipeline("gpt", "1F1B", "PP=2", 2, 4, seed_per_stage=True)
    stream = compile_rng.get_state()
    if rank == 0:
        torch.save((losses, stream), out)


def test_stages_seeded_apart_are_refused_unless_the_run_seed_is_declared():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.pt")
        spawn(_seeded_per_stage_body, 2, out)
        losses, stream = torch.load(out)
    assert pp.max_relative_difference(losses, pp.train_single("gpt", 2)) < TOLERANCE
    assert stream == (pp.SEED, 0)  # rank 0's own stream: untouched by the named steps


def test_run_seed_is_a_position_of_its_own():
    model = pp.whole_model("gpt")
    tokens, targets = _batch()
    reference = _forward_backward(model, tokens, targets)[0]
    compile_rng.run_seed(pp.SEED)
    try:
        for stage_seed in (pp.SEED + 1, pp.SEED + 7):  # other seeds, other offsets: the same masks
            torch.manual_seed(stage_seed)
            torch.rand(5)
            compile_rng.manual_seed(stage_seed)
            before = compile_rng.get_state()
            with compile_rng.step(tokens.shape[0], names=model):
                logits = model(tokens)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            assert torch.equal(loss, reference)
            assert compile_rng.get_state() == before  # this rank's stream is not the named one
            saved = compile_rng.state_dict()
            assert saved["run"] == {"seed": pp.SEED, "offset": 2**40}  # one step on
            compile_rng.run_seed(pp.SEED)  # back to the run's start for the next seeding
        compile_rng.load_state_dict(saved)
        assert compile_rng.state_dict()["run"]["offset"] == 2**40
    finally:
        compile_rng.run_seed(None)


def _resume_body(rank: int, world: int, folder: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    optim_file = os.path.join(folder, f"optim.{rank}.pt")  # the stage's own AdamW moments

    def run(steps: range, load: bool, save: bool) -> list[float]:
        pipe = pp.Pipeline("gpt", "1F1B", "PP=2", microbatches=2)
        opt = torch.optim.AdamW(pipe.parameters(), lr=pp.CONFIG.lr)
        (modules,) = pipe.modules  # one stage per rank: its FQNs are the unsplit model's
        torch.manual_seed(pp.SEED + 1)  # overwritten by the checkpoint's stream when loading
        if not load:
            torch.manual_seed(pp.SEED)
        else:
            state = {"model": modules.state_dict(), "rng": compile_rng.StreamState()}
            dcp.load(state, checkpoint_id=folder)
            modules.load_state_dict(state["model"])
            opt.load_state_dict(torch.load(optim_file))
        losses = []
        batches = pp.global_batches(pp.CONFIG, 3)
        for i in steps:
            total = pipe.step(*batches[i])
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce(total)
            losses.append(total.item())
        if save:
            dcp.save({"model": modules.state_dict(), "rng": compile_rng.StreamState()}, checkpoint_id=folder)
            torch.save(opt.state_dict(), optim_file)
        return losses

    whole = run(range(3), load=False, save=False)
    first = run(range(1), load=False, save=True)
    resumed = run(range(1, 3), load=True, save=False)
    if rank == 0:
        torch.save((whole, first + resumed), out)


def test_a_pipeline_resumes_from_a_dcp_checkpoint_on_the_same_streams(tmp_path):
    out = str(tmp_path / "losses.pt")
    spawn(_resume_body, 2, str(tmp_path / "checkpoint"), out)
    whole, resumed = torch.load(out)
    assert whole == resumed


# --- a second forward over the same rows ------------------------------------------------


def _by_forward(captured) -> dict:
    """Forward masks by (kind, k): the k-th forward's mask over every row it saw."""
    counts, pieces = {}, {}
    for kind, start, mask in captured:
        if kind.endswith("forward"):
            k = counts[(kind, start)] = counts.get((kind, start), -1) + 1
            pieces.setdefault((kind, k), []).append((start, mask))
    return {key: torch.cat([m for _, m in sorted(v, key=lambda p: p[0])]) for key, v in pieces.items()}


def _two_forwards_single(microbatches=1):
    """One process, a named step that runs the model twice over each microbatch's rows."""
    model = pp.whole_model("gpt")
    captured = []
    pp.capture_dropped(model, "3", captured)
    tokens, targets = _batch()
    torch.manual_seed(pp.SEED)
    with compile_rng.step(tokens.shape[0], names=model) as s:
        for rows in tokens.tensor_split(microbatches):
            with s.microbatch(rows.shape[0]):
                (model(rows).sum() + model(rows).sum()).backward()
    return _by_forward(captured)


def test_a_second_forward_over_the_same_rows_draws_new_masks():
    masks = _two_forwards_single()
    assert set(masks) == {(kind, k) for kind in ("attn forward", "mlp forward") for k in (0, 1)}
    for kind in ("attn forward", "mlp forward"):
        assert not torch.equal(masks[(kind, 0)], masks[(kind, 1)]), kind  # SimCSE needs two masks
    # the first forward is the one-forward step's; microbatching names both alike per sample
    single = _dropped_of_last_block(pp.whole_model("gpt"), *_batch())
    assert torch.equal(masks[("mlp forward", 0)], single["mlp forward"])
    split = _two_forwards_single(microbatches=2)
    for key, mask in masks.items():
        assert torch.equal(split[key], mask), key


def _two_forwards_body(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    tokens, targets = _batch()
    # DP=2: this rank's half of the rows, the model twice
    model = pp.whole_model("gpt")
    data_parallel = []
    pp.capture_dropped(model, "3", data_parallel)
    mine = tokens.chunk(world)[rank]
    torch.manual_seed(pp.SEED)
    with compile_rng.step(mine.shape[0], data_parallel=dist.group.WORLD, names=model):
        (model(mine).sum() + model(mine).sum()).backward()
    # PP=2 (1F1B, 4 microbatches): the schedule twice in one step
    pipe = pp.Pipeline("gpt", "1F1B", "PP=2", microbatches=4)
    pipelined = []
    for module in pipe.modules:
        pp.capture_dropped(module, "3", pipelined)
    torch.manual_seed(pp.SEED)
    with compile_rng.step(tokens.shape[0], names=pipe.stages, microbatches=4):
        for _ in range(2):
            pipe.run_schedule(tokens, targets, [])
    torch.save((data_parallel, pipelined), f"{out}.{rank}")


def test_two_forwards_draw_the_single_process_masks_under_dp_and_pp():
    single = _two_forwards_single()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "captured")
        spawn(_two_forwards_body, 2, out)
        ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    data_parallel = _by_forward(ranks[0][0] + ranks[1][0])
    pipelined = _by_forward(ranks[0][1] + ranks[1][1])
    assert set(data_parallel) == set(pipelined) == set(single)
    for key, mask in single.items():
        assert torch.equal(data_parallel[key], mask), ("DP=2", key)
        assert torch.equal(pipelined[key], mask), ("PP=2", key)
