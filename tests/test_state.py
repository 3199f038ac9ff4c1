"""The Philox state API and the torch.manual_seed habit."""

import pytest
import torch

import compile_rng
from compile_rng.stream import state


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1])
def test_manual_seed_round_trips_uint64(seed):
    compile_rng.manual_seed(seed)
    assert compile_rng.get_state() == (seed, 0)


def test_set_state_round_trips():
    compile_rng.set_state(2**64 - 1, 2**63 + 7)
    assert compile_rng.get_state("cpu") == (2**64 - 1, 2**63 + 7)
    assert compile_rng.get_state(torch.device("cpu")) == (2**64 - 1, 2**63 + 7)


def test_torch_manual_seed_restarts_the_stream():
    compile_rng.set_state(5, 1000)
    torch.manual_seed(1234)
    assert compile_rng.get_state() == (1234, 0)
    torch.random.manual_seed(2**64 - 3)
    assert compile_rng.get_state() == (2**64 - 3, 0)
    torch.manual_seed(-1)  # torch reduces negative seeds mod 2**64
    assert compile_rng.get_state() == (2**64 - 1, 0)


def test_torch_manual_seed_still_seeds_torch():
    torch.manual_seed(77)
    a = torch.rand(3)
    torch.manual_seed(77)
    assert torch.equal(a, torch.rand(3))
    assert torch.initial_seed() == 77


def test_hook_is_installed_once():
    compile_rng.install()
    compile_rng.install()
    # (torch._dynamo may wrap torch.manual_seed again; torch.random.manual_seed is ours)
    assert getattr(torch.random.manual_seed, "_compile_rng_hook", False)
    assert not getattr(torch.random.manual_seed.__wrapped__, "_compile_rng_hook", False)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "3", True])
def test_bad_seeds_are_rejected(bad):
    with pytest.raises((TypeError, ValueError), match="seed"):
        compile_rng.manual_seed(bad)


@pytest.mark.parametrize("bad", [-1, 2**64, 2.0])
def test_bad_offsets_are_rejected(bad):
    with pytest.raises((TypeError, ValueError), match="offset"):
        compile_rng.set_state(0, bad)


def test_advance_never_wraps():
    compile_rng.set_state(3, 2**64 - 8)
    assert state.advance(4) == (3, 2**64 - 8)
    with pytest.raises(OverflowError, match="2\\*\\*64"):
        state.advance(4)
    assert compile_rng.get_state() == (3, 2**64 - 4)


def test_unknown_device_type():
    with pytest.raises(NotImplementedError, match="meta"):
        compile_rng.get_state("meta")
