"""``@compile_rng.init(streams="fqn")`` on real init patterns (tests/init_patterns.py):
deterministic, right under a pipeline split, and an error where a draw's owner
cannot be known."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from init_patterns import Model, pipeline_stage, snapshot
from torch import nn

import compile_rng
from compile_rng.eager import fqn_streams
from compile_rng.launch import spawn

SEED = 3


def fqn_init(seed=None, layout="invariant"):
    return compile_rng.init(layout=layout, streams="fqn", seed=seed)(lambda m: m.init_weights())


@pytest.fixture(scope="module")
def single_device() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = Model()
    fqn_init()(model)
    return snapshot(model)


def digest(values: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(values):
        h.update(name.encode() + values[name].numpy().tobytes())
    return h.hexdigest()


def test_derive_seed_is_the_documented_hash():
    expected = hashlib.sha256(b"compile_rng/fqn/v1" + (7).to_bytes(8, "little") + b"layers.0.wo.weight").digest()
    assert fqn_streams.derive_seed(7, "layers.0.wo.weight") == int.from_bytes(expected[:8], "little")


def test_values_are_the_named_streams(single_device):
    # Independent of the attribution machinery: tok.weight is the first draw of its own
    # stream, so it equals compile_rng's functional normal at (derived seed, 0).
    seed = fqn_streams.derive_seed(SEED, "tok.weight")
    key = compile_rng.ops.make_key(seed, 0)
    shape = list(single_device["tok.weight"].shape)
    expected = torch.ops.compile_rng.normal(key, 0, shape, [shape[1], 1], 0.0, 1.0, torch.float32)
    assert torch.equal(single_device["tok.weight"], expected)


def test_five_calls_in_one_process_are_identical(single_device):
    torch.manual_seed(SEED)
    model = Model()
    for _ in range(5):
        fqn_init()(model)
        now = snapshot(model)
        assert all(torch.equal(single_device[k], now[k]) for k in single_device)


def test_fresh_process_gives_the_same_values(single_device):
    code = (
        "import sys, torch, compile_rng; sys.path.insert(0, 'tests');"
        "from init_patterns import Model, snapshot; from test_fqn_streams import digest;"
        f"torch.manual_seed({SEED}); m = Model();"
        "compile_rng.init(layout='invariant', streams='fqn')(lambda m: m.init_weights())(m);"
        "print(digest(snapshot(m)))"
    )
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == digest(single_device)


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_stage_seeded_apart_matches_single_device(single_device, stage):
    torch.manual_seed(SEED + stage)  # the common habit: seed + pp_rank
    model = pipeline_stage(stage)
    fqn_init(seed=SEED)(model)
    values = snapshot(model)
    assert len(values) > 10
    for name, value in values.items():
        assert torch.equal(value, single_device[name]), name


def test_pipeline_stage_seed_pitfall_without_seed(single_device):
    torch.manual_seed(SEED + 1)
    model = pipeline_stage(1)
    fqn_init()(model)  # the stage's own seed derives other streams
    values = snapshot(model)
    differ = [n for n, v in values.items() if not torch.equal(v, single_device[n])]
    assert len(differ) >= 8


def test_seed_leaves_the_global_state_alone():
    compile_rng.manual_seed(11)
    compile_rng.get_state()
    fqn_init(seed=SEED)(Model())
    assert compile_rng.get_state() == (11, 0)
    init = compile_rng.init(seed=SEED, compile=False)(lambda m: nn.init.normal_(m.weight))
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    init(a)
    compile_rng.manual_seed(12)
    init(b)
    assert torch.equal(a.weight, b.weight) and compile_rng.get_state() == (12, 0)


def test_draw_attributed_by_storage_not_identity():
    # A freed buffer's address recycled by a temporary must not select the buffer's stream.
    owners = fqn_streams._StorageSet()
    recycled_once = False
    for _ in range(10):
        t = torch.empty(1000)
        address = t.untyped_storage().data_ptr()
        owners.add(t.untyped_storage(), "buf")
        assert owners.get(t.untyped_storage()) == "buf"
        assert owners.get(t[10:].untyped_storage()) == "buf"  # a view: same storage
        del t
        for _ in range(50):  # until the allocator hands the same block back
            recycled = torch.empty(1000)
            if recycled.untyped_storage().data_ptr() == address:
                recycled_once = True
                assert owners.get(recycled.untyped_storage()) is None
                break
    assert recycled_once


class _Tmp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 4))


def test_ownerless_draw_copied_into_a_parameter_raises():
    def init(m):
        tmp = torch.randn(8, 4)  # allocated from nothing: no owner when it draws
        m.w.copy_(tmp * 0.02)

    with pytest.raises(RuntimeError, match=r"aten.randn.default at .*test_fqn_streams.py.*writes them into 'w'"):
        compile_rng.init(streams="fqn")(init)(_Tmp())


def test_megatron_master_weight_raises():
    def init(m):  # Megatron's _initialize_affine_weight_cpu: draw a master weight, cat the split in
        master = torch.empty(8, 4)
        nn.init.normal_(master)
        torch.cat(torch.split(master, 4, dim=0), dim=0, out=m.w)

    with pytest.raises(RuntimeError, match="aten.normal_.default at .*writes them into 'w'"):
        compile_rng.init(streams="fqn")(init)(_Tmp())


def test_parameter_replaced_by_ownerless_draw_raises():
    def init(m):
        m.w = nn.Parameter(torch.rand(8, 4))

    with pytest.raises(RuntimeError, match="'w' was assigned them"):
        compile_rng.init(streams="fqn")(init)(_Tmp())


def test_ownerless_draw_that_stays_temporary_is_fine():
    def init(m):
        noise = torch.rand(3)  # used for something else: no named tensor receives it
        m.w.normal_(float(noise.sum()) * 0.0, 1.0)

    model = _Tmp()
    compile_rng.init(streams="fqn")(init)(model)
    key = compile_rng.ops.make_key(fqn_streams.derive_seed(0, "w"), 0)
    assert torch.equal(model.w, torch.ops.compile_rng.normal(key, 0, [8, 4], [4, 1], 0.0, 1.0, torch.float32))


def _gloo_configs(rank, world):
    from init_patterns import parallelize
    from torch.distributed.tensor import init_device_mesh

    torch.manual_seed(SEED)
    reference = Model(orthogonal=False)
    fqn_init()(reference)
    expected = snapshot(reference)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for config in ("tp", "fsdp", "fsdp_tp"):
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = parallelize(Model(orthogonal=False), config, mesh)
        model.to_empty(device="cpu")
        fqn_init()(model)
        got = snapshot(model)
        assert got.keys() == expected.keys()
        differ = [n for n in got if not torch.equal(got[n], expected[n])]
        assert not differ, (config, differ)


@pytest.mark.slow
def test_fqn_streams_on_tp_fsdp_and_fsdp_tp_gloo():

    spawn(_gloo_configs, 4)


# --- unit: which stream each draw takes (fqn_streams directly, values from the functional ops)


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.empty(6, 4))
        self.register_buffer("cache", torch.zeros(3))


def _stream(name: str, offset: int, shape: tuple, seed: int = SEED) -> torch.Tensor:
    """Standard normals of ``name``'s stream from ``offset`` (a fresh row-major layout)."""
    from compile_rng import ops
    from compile_rng.stream import contiguous_strides

    key = ops.make_key(fqn_streams.derive_seed(seed, name), offset)
    return ops.normal(key, 0, list(shape), contiguous_strides(shape), 0.0, 1.0, torch.float32)


def _in_streams(module: nn.Module, body) -> None:
    from compile_rng.eager.dispatch_modes import eager_stream

    with torch.no_grad(), eager_stream(), fqn_streams.fqn_streams([module], seed=SEED):
        body()


def test_unit_chunks_of_a_fused_weight_continue_its_stream():
    m = _Fused()
    _in_streams(m, lambda: [chunk.normal_() for chunk in m.qkv.chunk(3)])
    # three 2x4 chunks: counters 0, 8, 16 of qkv's stream, in draw order
    want = torch.cat([_stream("qkv", 8 * i, (2, 4)) for i in range(3)])
    assert torch.equal(m.qkv, want)


def test_unit_temporary_allocated_from_a_parameter_takes_its_stream():
    m = _Fused()

    def body():
        tmp = m.qkv.new_empty(6, 4)
        tmp.normal_()
        m.qkv.copy_(tmp)

    _in_streams(m, body)
    assert torch.equal(m.qkv, _stream("qkv", 0, (6, 4)))


def test_unit_reassigned_buffer_is_named_by_its_new_storage():
    m = _Fused()

    def body():
        m.cache = torch.empty(5)  # a rebuilt buffer: registered under the same name
        m.cache.normal_()

    _in_streams(m, body)
    assert torch.equal(m.cache, _stream("cache", 0, (5,)))


def test_unit_ownerless_draw_takes_the_anonymous_stream_and_leaves_the_global_state():
    m = _Fused()
    compile_rng.manual_seed(11)
    drawn = []
    _in_streams(m, lambda: drawn.append(torch.randn(7)))
    assert torch.equal(drawn[0], _stream(fqn_streams.ANONYMOUS, 0, (7,)))
    assert compile_rng.get_state() == (11, 0)


def test_unit_freed_storage_is_forgotten():
    named = fqn_streams._StorageSet()
    a = torch.empty(1024)
    named.add(a.untyped_storage(), "a")
    assert named.get(a.untyped_storage()) == "a"
    del a
    b = torch.empty(1024)  # may recycle a's address; it must not inherit a's name
    assert named.get(b.untyped_storage()) is None


def test_unit_no_modules_is_an_error():
    with pytest.raises(ValueError, match="no nn.Module"):
        with fqn_streams.fqn_streams([]):
            pass
