"""Resuming on the same random stream: ``compile_rng.state_dict`` / ``load_state_dict``,
the DCP ``Stateful`` ``compile_rng.StreamState``, and ``torch.random.fork_rng``.

The slow test trains 10 steps on 2 gloo ranks, checkpoints model, optimizer and stream
with ``torch.distributed.checkpoint``, resumes in new processes for 10 more, and
compares dropout masks and losses bitwise with an uninterrupted 20-step run (and with a
resume that skips the stream, which must differ: the test can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4

import compile_rng
from compile_rng.launch import spawn


def test_state_dict_round_trip_and_errors():
    compile_rng.manual_seed(2**64 - 3)
    compile_rng.set_state(2**64 - 3, 2**63 + 8)
    saved = compile_rng.state_dict()
    assert saved == {"version": 1, "streams": {"cpu": {"seed": 2**64 - 3, "offset": 2**63 + 8}}}
    torch.rand(3)
    compile_rng.manual_seed(0)
    compile_rng.load_state_dict(saved)
    assert compile_rng.get_state() == (2**64 - 3, 2**63 + 8)
    with pytest.raises(ValueError, match="version"):
        compile_rng.load_state_dict({"version": 9, "streams": {}})
    with pytest.raises(ValueError, match=r"streams for \['cuda'\]"):
        compile_rng.load_state_dict({"version": 1, "streams": {"cuda": {"seed": 1, "offset": 0}}})


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
