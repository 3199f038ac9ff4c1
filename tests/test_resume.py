"""Resuming on the same random stream: ``compile_rng.state_dict`` / ``load_state_dict``,
the DCP ``Stateful`` ``compile_rng.StreamState``, the checkpoint folders of the Hugging
Face Trainer (``TrainerMixin``) and accelerate (``accelerate_batches``), and
``torch.random.fork_rng``.

The slow tests: 10 steps on 2 gloo ranks checkpointed with ``torch.distributed.checkpoint``
and resumed in new processes for 10 more, compared (dropout masks and losses) bitwise with
an uninterrupted 20-step run; and ``examples/resume_parity.py``: transformers' BERT
classifier stopped after step 4 and resumed in a fresh process (group) by the Trainer,
accelerate and a plain DDP loop, on one process, on 2 ranks and 2 ranks resumed as 1,
every later step's float64 loss compared with the uninterrupted run's. Each has a control
that resumes without compile_rng's stream and must differ (the tests can fail), and the
stock loops' own exact resume is checked beside them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4

import compile_rng
from compile_rng.integrations.accelerate_rows import skipped_batches
from compile_rng.launch import spawn
from compile_rng.stream import STREAM_VERSION, checkpointing, state


def test_state_dict_round_trip_and_errors():
    compile_rng.manual_seed(2**64 - 3)
    compile_rng.set_state(2**64 - 3, 2**63 + 8)
    saved = compile_rng.state_dict()
    assert saved == {"version": 1, "stream": 1, "streams": {"cpu": {"seed": 2**64 - 3, "offset": 2**63 + 8}}}
    torch.rand(3)
    compile_rng.manual_seed(0)
    compile_rng.load_state_dict(saved)
    assert compile_rng.get_state() == (2**64 - 3, 2**63 + 8)
    with pytest.raises(ValueError, match="version"):
        compile_rng.load_state_dict({"version": 9, "streams": {}})
    with pytest.raises(ValueError, match=r"streams for \['cuda'\]"):
        compile_rng.load_state_dict({"version": 1, "streams": {"cuda": {"seed": 1, "offset": 0}}})
    with pytest.raises(ValueError, match="canonical stream version 2"):
        compile_rng.load_state_dict({**saved, "stream": STREAM_VERSION + 1})
    assert compile_rng.get_state() == (2**64 - 3, 2**63 + 8)  # a refused state changes nothing


def test_a_load_restores_the_run_position_and_counts_as_a_seeding():
    compile_rng.run_seed(11)
    state.advance_run(8)
    saved = compile_rng.state_dict()
    assert saved["run"] == {"seed": 11, "offset": 8}
    compile_rng.run_seed(None)
    seedings = state.seedings()
    compile_rng.load_state_dict(saved)
    assert state.run_position() == (11, 8)
    # the checks that ranks agree (once per seeding) run again after a load
    assert state.seedings() == seedings + 1
    compile_rng.load_state_dict({k: v for k, v in saved.items() if k != "run"})
    assert state.run_position() is None  # the checkpoint declared no run seed


@pytest.mark.parametrize("declared", [True, False], ids=["run seed", "the stream"])
def test_named_steps_resume_from_the_saved_state(declared):
    """Steps with ``names=`` draw from the declared run seed's position (or the stream's):
    what a state holds, so 2 steps, a save, a process's other state, a load and 2 more
    steps draw the 4 uninterrupted steps' masks."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    x = torch.ones(4, 4)

    def steps(n: int) -> list[torch.Tensor]:
        outs = []
        for _ in range(n):
            with compile_rng.step(4, names=model):
                outs.append(model(x).detach())
        return outs

    def start() -> None:
        compile_rng.manual_seed(3)
        compile_rng.run_seed(11 if declared else None)

    start()
    whole = steps(4)
    start()
    first = steps(2)
    saved = compile_rng.state_dict()
    compile_rng.manual_seed(99)  # another process's state
    compile_rng.run_seed(5 if declared else None)
    compile_rng.load_state_dict(saved)
    rest = steps(2)
    assert all(torch.equal(a, b) for a, b in zip(whole, first + rest))
    start()  # the control: resumed without the state, step 3 draws step 1's masks
    assert not torch.equal(steps(1)[0], whole[2])


def test_checkpoint_folders_per_rank_elastic_and_refused(tmp_path):
    # the offsets only need to differ from each other and from the 0 of the reseeds below
    first, second = ceil4(5), ceil4(50)
    for rank, offset in ((0, first), (1, first)):
        compile_rng.set_state(3, offset)
        checkpointing.save_to_folder(str(tmp_path), rank, 2)
    compile_rng.manual_seed(0)
    checkpointing.load_from_folder(str(tmp_path), 1, 2, "test")  # the same ranks: its own file
    assert compile_rng.get_state() == (3, first)
    compile_rng.manual_seed(0)
    checkpointing.load_from_folder(str(tmp_path), 0, 1, "test")  # 2 ranks resumed as 1: the one stream
    assert compile_rng.get_state() == (3, first)
    compile_rng.set_state(3, second)
    checkpointing.save_to_folder(str(tmp_path), 1, 2)  # now the ranks' streams differ
    checkpointing.load_from_folder(str(tmp_path), 1, 2, "test")
    assert compile_rng.get_state() == (3, second)
    with pytest.raises(RuntimeError, match="different streams, so it cannot resume on 1 ranks"):
        checkpointing.load_from_folder(str(tmp_path), 0, 1, "test")
    with pytest.raises(checkpointing.MissingStreamState, match="holds no compile_rng state"):
        checkpointing.load_from_folder(str(tmp_path / "elsewhere"), 0, 1, "test")


def test_accelerate_batches_checkpoints_the_stream_and_refuses_a_resume_without_it(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=2))
    for _ in compile_rng.accelerate_batches(accelerator, loader):
        pass
    for _ in compile_rng.accelerate_batches(accelerator, loader):  # a second epoch registers no other
        pass
    ours = [o for o in accelerator._custom_objects if isinstance(o, compile_rng.StreamState)]
    assert len(ours) == 1
    moved = ceil4(7)  # any offset other than the 0 of the reseed below
    compile_rng.set_state(0, moved)
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "custom_checkpoint_0.pkl").exists()

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fresh = Accelerator(cpu=True)
    loader = fresh.prepare(DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=2))
    with pytest.raises(RuntimeError, match="does not match the number of registered objects"):
        fresh.load_state(str(tmp_path / "ckpt"))  # accelerate's own refusal: nothing registered
    skipping = fresh.skip_first_batches(loader, 2)
    assert skipped_batches(skipping) == 2 and skipped_batches(loader) == 0
    with pytest.raises(RuntimeError, match=r"resumes mid-epoch \(it skips 2 batches\), but accelerator.load_state restored"):
        next(iter(compile_rng.accelerate_batches(fresh, skipping)))
    compile_rng.manual_seed(0)
    fresh.register_for_checkpointing(compile_rng.StreamState())
    fresh.load_state(str(tmp_path / "ckpt"))
    assert compile_rng.get_state() == (0, moved)
    assert sum(1 for _ in compile_rng.accelerate_batches(fresh, skipping)) == 2


def test_fork_rng_forks_the_stream():
    # Offsets the test moves the stream to. Any reachable offset (a multiple of 4, §2)
    # works; what matters is that each differs from the state it would fall back to if
    # the fork (or its absence) were wrong: `moved` != the seeded 0, `moved_again` != `moved`.
    moved = ceil4(20 * 20)  # 400: where a torch.rand(20, 20) from offset 0 leaves the stream
    moved_again = 2 * moved  # 800
    compile_rng.manual_seed(5)
    with torch.random.fork_rng():
        compile_rng.set_state(5, moved)
        torch.manual_seed(9)
    assert compile_rng.get_state() == (5, 0)
    with torch.random.fork_rng(enabled=False):
        compile_rng.set_state(5, moved)
    assert compile_rng.get_state() == (5, moved)
    stock = torch.random.fork_rng
    compile_rng.uninstall()
    try:
        assert torch.random.fork_rng is not stock
        with torch.random.fork_rng():
            compile_rng.set_state(5, moved_again)
        assert compile_rng.get_state() == (5, moved_again)  # stock torch: the stream is not forked
    finally:
        compile_rng.install()


def test_stream_state_without_a_process_group_and_per_rank_keys():
    compile_rng.manual_seed(4)
    plain = compile_rng.StreamState()
    assert plain.state_dict() == compile_rng.state_dict()
    # any reachable offset other than the 0 that manual_seed(0) below leaves would do
    saved_offset = ceil4(3 * 3)  # 12: where a torch.rand(3, 3) from offset 0 leaves the stream
    compile_rng.set_state(4, saved_offset)
    saved = plain.state_dict()
    compile_rng.manual_seed(0)
    compile_rng.StreamState(per_rank=True).load_state_dict(saved)  # no process group: this rank's own
    assert compile_rng.get_state() == (4, saved_offset)


# --- real ranks, real DCP ---------------------------------------------------------------

STEPS, DIM, BATCH = 10, 16, 8


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(DIM, 32), torch.nn.Linear(32, 1)

    def forward(self, x):
        h = F.dropout(torch.relu(self.fc1(x)) + 1.0, 0.4)  # + 1: every kept value is nonzero
        return self.fc2(h).square().mean(), h != 0


def _train(rank: int, world: int, phase: str, folder: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0 if phase != "resume-fresh-init" else 123)
    model = _Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(model, backend="compile_rng")
    data = torch.randn(2 * STEPS, world * BATCH, DIM, generator=torch.Generator().manual_seed(1))
    first, steps = 0, 2 * STEPS if phase == "whole" else STEPS
    if phase.startswith("resume"):
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        if phase != "resume-without-stream":
            state["rng"] = compile_rng.StreamState()
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = STEPS
    record = []
    for i in range(first, first + steps):
        x = data[i, rank * BATCH:(rank + 1) * BATCH]
        loss, mask = step(x)
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel by hand: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        record.append((loss.detach(), mask))
    if phase == "first-half":
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd, "rng": compile_rng.StreamState()}, checkpoint_id=folder)
    torch.save(record, f"{out}.{rank}")


@pytest.mark.slow
def test_dcp_resume_replays_masks_and_losses_bitwise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    runs = {}
    for phase in ("whole", "first-half", "resume", "resume-fresh-init", "resume-without-stream"):
        spawn(_train, 2, phase, ckpt, str(tmp_path / phase))
        runs[phase] = [torch.load(tmp_path / f"{phase}.{r}") for r in range(2)]
    for rank in range(2):
        whole = runs["whole"][rank]
        for resumed in ("resume", "resume-fresh-init"):
            replay = runs["first-half"][rank] + runs[resumed][rank]
            assert len(replay) == len(whole) == 2 * STEPS
            for (loss_a, mask_a), (loss_b, mask_b) in zip(whole, replay):
                assert torch.equal(mask_a, mask_b) and torch.equal(loss_a, loss_b)
        # the control: the same resume without the stream draws other masks
        without = runs["resume-without-stream"][rank]
        assert not torch.equal(without[0][1], whole[STEPS][1])


def _load_other_states(rank: int, world: int) -> None:
    compile_rng.set_state(1, 4 * (rank + 1))  # each rank at its own offset: a stale checkpoint on one
    with pytest.raises(RuntimeError, match=r"the ranks loaded different streams:\n  cpu offset: ranks \[0\] have 4; "
                                           r"ranks \[1\] have 8\n"):
        compile_rng.StreamState().load_state_dict(compile_rng.state_dict())


def test_ranks_that_load_different_streams_are_refused():
    spawn(_load_other_states, 2)


sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))


@pytest.mark.slow
def test_trainer_accelerate_and_a_plain_loop_resume_bitwise():
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import resume_parity

    cells, refused = resume_parity.table()
    for (loop, name, mode), difference in sorted(cells.items()):
        print(f"resume {loop:10} {name:30} {mode:15} {difference:.1e}")
    elastic = "DDP=2 resumed as one process"
    for (loop, name, mode), difference in cells.items():
        if mode == "compile_rng":
            # the same ranks: bitwise; 2 ranks as 1: the loss's float64 rounding under another
            # data-parallel size (DDP's averaged gradients), as in the uninterrupted runs
            assert difference == 0.0 if name != elastic else difference < 1e-9, (loop, name, difference)
        elif mode == "state left out":
            assert difference > 1e-4, (loop, name, difference)  # the control: it can fail
        elif name != elastic:
            assert difference == 0.0, (loop, name, difference)  # the stock loops' own exact resume
    assert "holds no compile_rng state" in refused["Trainer"]
