"""``@compile_rng.init`` and the eager stream when compiling or the fast path cannot
apply: every compile failure falls back to the eager stream with the same values, and
tensor subclasses take the generic path."""

import pytest
import torch
from dtensor_reference import fake_rank
from torch import nn

import compile_rng


def test_recompile_limit_falls_back_to_the_eager_stream():
    compiled = compile_rng.init(compile="auto")(lambda w: nn.init.uniform_(w, -1.0, 1.0))
    eager = compile_rng.init(compile=False)(lambda w: nn.init.uniform_(w, -1.0, 1.0))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(UserWarning, match="does not compile as one graph"):
        for shape in [(4, 4), (5, 3), (2, 7)]:  # a helper called on tensors of many layouts
            compile_rng.manual_seed(1)
            got = compiled(torch.empty(shape))
            state = compile_rng.get_state()
            compile_rng.manual_seed(1)
            assert torch.equal(got, eager(torch.empty(shape))) and state == compile_rng.get_state()
    assert not compiled.compiled()


def test_fast_in_place_path_skips_tensor_subclasses():
    from torch.testing._internal.two_tensor import TwoTensor

    key = compile_rng.ops.make_key(0, 0)
    plain = torch.empty(4, 4)
    assert compile_rng.ops.uniform_into(plain, key, 0, [4, 4], [4, 1], 0.0, 1.0, torch.float32)
    wrapped = TwoTensor(torch.empty(4, 4), torch.empty(4, 4))
    assert not compile_rng.ops.uniform_into(wrapped, key, 0, [4, 4], [4, 1], 0.0, 1.0, torch.float32)
    assert not compile_rng.ops.normal_into(wrapped, key, 0, [4, 4], [4, 1], 0.0, 1.0, torch.float32)


def test_local_tensor_mode_gets_a_clear_error_not_a_crash():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    with fake_rank(0, 2), LocalTensorMode(2):
        mesh = init_device_mesh("cpu", (2,))
        t = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
        with pytest.raises(NotImplementedError, match="LocalTensorMode"):
            t.uniform_()


def test_auto_compile_decides_per_model():
    """A model whose init Dynamo cannot capture whole runs eagerly from then on; a model
    the same function is called on afterwards still runs as one graph, with the same values."""

    def init_weights(model):
        for p in model.parameters():
            if model.truncated:  # a graph break, as torch 2.12+'s trunc_normal_ (its loop reads .item())
                torch._dynamo.graph_break()
                nn.init.trunc_normal_(p, std=0.02)
            else:
                nn.init.normal_(p)

    auto = compile_rng.init(compile="auto", inner="aot_eager")(init_weights)
    eager = compile_rng.init(compile=False)(init_weights)
    broken, fine, reference = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    broken.truncated, fine.truncated, reference.truncated = True, False, False
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="does not compile as one graph"):
        auto(broken)
    compile_rng.manual_seed(3)
    auto(fine)
    compile_rng.manual_seed(3)
    eager(reference)
    assert not auto.compiled(broken) and auto.compiled(fine)
    assert torch.equal(fine.weight, reference.weight) and torch.equal(fine.bias, reference.bias)
