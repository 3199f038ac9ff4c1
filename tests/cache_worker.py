"""One process of ``tests/test_caches.py``: fake rank ``argv[1]`` of 4 compiles a random
program with ``backend="compile_rng"`` (Inductor's cache folder from the environment) -
on a sharded DTensor (``argv[2] == "dtensor"``) or on plain tensors - and prints, as
JSON, the FX-graph and AOTAutograd cache counters, whether the values equal the
canonical stream (at torch's tracker offsets for the DTensor), the values and the state.
``run_dtensor`` also serves the test on real gloo ranks."""

import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from dtensor_reference import fake_rank, local_zeros, tracker_start  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

import compile_rng  # noqa: E402
from compile_rng import ops  # noqa: E402

SEED, WORLD, SHAPE = 21, 4, (12, 6)  # even shards: every rank runs the same graph


def program(x):
    return x.uniform_(-1.0, 1.0) * 2, torch.rand(5)


def plain_program(x):
    return torch.rand_like(x) * 2, torch.rand(5)


def report(values: torch.Tensor, ok: bool) -> dict:
    return {
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "aot_bypass": counters["aot_autograd"]["autograd_cache_bypass"],
        "values_ok": ok,
        "state": list(compile_rng.get_state()),
        "values": values.flatten().tolist(),
    }


def run_plain() -> dict:
    compile_rng.manual_seed(SEED)
    a, b = torch.compile(plain_program, backend="compile_rng")(torch.zeros(SHAPE))
    want = ops.uniform(ops.make_key(SEED, 0), 0, list(SHAPE), [SHAPE[1], 1], 0.0, 1.0, torch.float32) * 2
    want_b = ops.uniform(ops.make_key(SEED, 72), 0, [5], [1], 0.0, 1.0, torch.float32)
    return report(a, torch.equal(a, want) and torch.equal(b, want_b))


def run_dtensor(mesh: DeviceMesh) -> dict:
    """The program on a ``Shard(0)`` DTensor of ``mesh``, checked against this rank's shard."""
    compile_rng.manual_seed(SEED)
    x = local_zeros(SHAPE, mesh, [Shard(0)])
    shard, plain = torch.compile(program, backend="compile_rng")(x)
    ref = local_zeros(SHAPE, mesh, [Shard(0)])
    start = tracker_start(ref, list(mesh.get_coordinate()))
    local_shape = list(ref.to_local().shape)
    want = ops.uniform(ops.make_key(SEED, start), 0, local_shape, [SHAPE[1], 1], -1.0, 1.0, torch.float32) * 2
    want_plain = ops.uniform(ops.make_key(SEED, 72), 0, [5], [1], 0.0, 1.0, torch.float32)
    return report(shard.to_local(), torch.equal(shard.to_local(), want) and torch.equal(plain, want_plain))


def run_vocab_parallel(mesh: DeviceMesh, before_compile: Callable[[], None] = lambda: None) -> dict:
    """A vocab-sharded embedding (``RowwiseParallel``: each rank masks the token ids
    outside its rows, at an offset tracing reads from this rank's coordinate) and
    dropout on the sequence-sharded output, compiled after ``before_compile()`` returns;
    checked against the same module run eagerly on this rank (real ranks: the
    collectives sum the ranks' rows)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    embed = parallelize_module(
        torch.nn.Embedding(32, 8), mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
    )
    tokens = torch.arange(24).reshape(2, 12) * 5 % 32

    def program(tokens):
        return F.dropout(embed(tokens), 0.5)

    compile_rng.manual_seed(SEED)
    want = program(tokens).to_local()
    before_compile()
    compile_rng.manual_seed(SEED)
    got = torch.compile(program, backend="compile_rng")(tokens).to_local()
    return report(got, torch.equal(got, want))


def run_llama() -> dict:
    """A training step of Hugging Face ``transformers``' Llama (SDPA attention dropout):
    the loss and every gradient, as one tensor (``values_ok``: the dropout is live)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.5,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.arange(32).reshape(2, 16) * 7 % 128
    compile_rng.manual_seed(SEED)
    step = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend="compile_rng")
    loss = step(ids)
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        model.eval()
        no_dropout = model(input_ids=ids, labels=ids).loss
    return report(torch.cat([loss.detach().reshape(1), *grads]), not torch.equal(loss, no_dropout))


def main(rank: int, kind: str) -> None:
    if kind == "plain":
        result = run_plain()
    elif kind == "llama":
        result = run_llama()
    else:
        with fake_rank(rank, WORLD):
            result = run_dtensor(DeviceMesh("cpu", list(range(WORLD))))
    print(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
