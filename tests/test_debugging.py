"""depyf dumps, the annotated before/after graphs, explain(), and the command line."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4, fake_rank, local_zeros, tracker_start
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import compile_rng
from compile_rng.launch import spawn

SEED = 8


def program(x, y):
    return F.dropout(x + 1, 0.3), torch.rand_like(y), torch.randn(3)


def _comment_numbers(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"base offset = (\d+)\s+advance = (\d+)", text)]


def test_dump_has_depyf_files_and_annotated_graphs(tmp_path):
    torch._dynamo.reset()
    with fake_rank(0, 4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
        x = local_zeros((8, 6), mesh, [Shard(0), Shard(1)])
        y = local_zeros((5, 3), mesh, [Replicate(), Shard(0)])
        be = compile_rng.backend(inner="aot_eager")
        compile_rng.manual_seed(SEED)
        with compile_rng.dump(tmp_path) as folder:
            torch.compile(program, backend=be)(x, y)
        used = compile_rng.get_state()[1]
    names = [p.name for p in folder.iterdir()]
    assert folder == tmp_path / "rank0"  # a multi-rank process group: one folder per rank
    assert any(n.startswith("full_code_for_program") for n in names)  # depyf's own dump
    assert any(n.startswith("__compiled_fn_") for n in names)
    after = (folder / "program.0_0.compile_rng_after.py").read_text()
    before = (folder / "program.0_0.compile_rng_before.py").read_text()
    # DTensor ops arrive already replaced by the tracker, on a pending key; plain ones as aten
    assert "compile_rng.pending_key" in before and "aten.randn" in before
    assert "pending_key" not in after and "torch.ops.aten.randn" not in after
    assert "torch.ops.compile_rng.dropout.default" in after and "torch.ops.compile_rng.normal.default" in after
    assert "placements (Shard(dim=0), Shard(dim=1))" in after and "global shape (8, 6)" in after
    assert "start (rank's first counter) = 24*u" in after  # symbolic in the runtime coordinate
    # the numbers in the comments are the ones the run used
    (plan,) = be.plans
    assert _comment_numbers(after) == [(int(op.offset), int(op.advance)) for op in plan.ops]
    # dropout on x (8, 6), rand_like on y (5, 3), randn(3): ceil4(numel(global)) each
    assert sum(b for _, b in _comment_numbers(after)) == used == ceil4(8 * 6) + ceil4(5 * 3) + ceil4(3)


def test_explain_per_rank_offsets_match_the_compiled_run():
    torch._dynamo.reset()
    with fake_rank(0, 4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
        x = local_zeros((8, 6), mesh, [Shard(0), Shard(1)])
        y = local_zeros((5, 3), mesh, [Replicate(), Shard(0)])
        compile_rng.manual_seed(SEED)
        report = compile_rng.explain(program, x, y)
        assert compile_rng.get_state() == (SEED, 0)  # explain leaves the state alone
        for op, dt in zip(report.ops[:2], (x, y)):
            for coord, start in op.start_by_coordinate.items():
                assert start == tracker_start(dt, list(coord)), (op.op, coord)
        assert [r.op for r in report.ops] == ["aten.native_dropout.default", "aten.rand_like.default", "aten.randn.default"]
        assert report.ops[0].placements == (Shard(0), Shard(1)) and report.ops[0].local_shape == (4, 3)
        assert int(report.total_advance) == ceil4(x.numel()) + ceil4(y.numel()) + ceil4(3)
        text = str(report)
        # the dropout's shard at mesh coordinate (1, 1), as torch's tracker places it
        assert "start by mesh coordinate" in text and f"(1, 1): {tracker_start(x, [1, 1])}" in text


def test_explain_lists_unsupported_ops_with_a_reason():
    torch._dynamo.reset()
    report = compile_rng.explain(lambda x: (torch.randn(3, dtype=torch.complex64), torch.rand_like(x)), torch.ones(3))
    op = "aten.randn.default"
    assert [u.op for u in report.unsupported] == [op]
    assert "complex" in report.unsupported[0].reason
    assert f"UNSUPPORTED {op}" in str(report)
    assert len(report.ops) == 1


def _dump_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    compile_rng.manual_seed(SEED)
    with compile_rng.dump(out):
        torch.compile(lambda t: F.dropout(t + 1, 0.5), backend=compile_rng.backend(inner="aot_eager"))(x)


@pytest.mark.slow
def test_dump_on_real_ranks_writes_one_folder_per_rank(tmp_path):
    spawn(_dump_worker, 2, str(tmp_path))
    for rank in (0, 1):
        after = list((tmp_path / f"rank{rank}").glob("*.compile_rng_after.py"))
        assert len(after) == 1 and "compile_rng.dropout" in after[0].read_text()


@pytest.mark.parametrize("command", [["explain", "compile_rng.demo:explain_target"]])
def test_command_line_explain(command):
    out = subprocess.run(
        [sys.executable, "-m", "compile_rng", *command], capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).parent,
    )
    assert out.returncode == 0, out.stderr
    assert "native_dropout.default" in out.stdout and "start by mesh coordinate: (0,): 0, (1,): 128" in out.stdout
    assert "[compile_rng] tracing and compiling" in out.stderr  # progress for a person at a terminal


def test_explain_reports_plain_offsets_the_mode_and_module_sources():
    torch._dynamo.reset()

    def step(x):
        a = torch.rand(100)
        b = torch.randn(300)
        return F.dropout(x, 0.5).sum() + a.sum() + b.sum()

    report = compile_rng.explain(step, torch.ones(2, 8), layout="invariant")
    # Plain tensors take ceil4(numel) counters each, in program order.
    assert [int(r.offset) for r in report.ops] == [0, 100, 400]
    assert [int(r.advance) for r in report.ops] == [100, 300, 16]
    assert {r.layout for r in report.ops} == {"invariant"}
    rows = str(report).splitlines()[2:5]
    assert [row.split()[-3] for row in rows] == ["0", "100", "400"]  # the offset column
    # nn.Dropout inside nn.Sequential, explained as the function itself: no user frame
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    assert [r.source for r in compile_rng.explain(model, torch.ones(2, 8)).ops] == ["1 (Dropout)"]


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_command_line_help_imports_no_torch():
    out = _cli("-X", "importtime", "-m", "compile_rng", "--help")
    assert out.returncode == 0 and "TARGET is path/to/file.py:NAME" in out.stdout
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "compile_rng" in imported and not any(m == "torch" or m.startswith("torch.") for m in imported)


@pytest.mark.parametrize(
    "target, message",
    [
        ("missing.py:f", "no file 'missing.py'"),
        ("no_such_module_xyz:f", "no module 'no_such_module_xyz'"),
        ("target.py:nope", "has no 'nope'; its functions: needs_args"),
        ("target.py:needs_args", "needs arguments (x, y)"),
        ("target.py:VALUE", "is not callable"),
        ("no-colon", "TARGET must look like"),
    ],
)
def test_command_line_bad_targets_get_one_line_errors(tmp_path, target, message):
    (tmp_path / "target.py").write_text("VALUE = 3\n\n\ndef needs_args(x, y):\n    return x\n")
    out = _cli("-m", "compile_rng", "explain", target, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("compile_rng: ") and message in out.stderr
