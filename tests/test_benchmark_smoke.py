"""The benchmark scripts run end to end on small sizes (asserting nothing about speed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_bench_random_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_random.py"), "--size", "65536", "--repeat", "1",
         "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cases = {r["case"] for r in rows}
    assert {"memset fill_", "eager uniform_", "inductor torch.rand", "compile_rng torch.rand",
            "compile_rng torch.randn", "compile_rng dropout"} <= cases
    assert all(r["ns_per_elem"] > 0 for r in rows)
    assert "speedup_vs_eager" in run.stdout or "vs eager" in run.stdout


SMALL_MODEL = ["--dim", "64", "--layers", "2", "--heads", "2", "--hidden", "96", "--vocab", "256", "--repeat", "1"]


@pytest.mark.slow
def test_bench_init_smoke(tmp_path):
    out = tmp_path / "init.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_init.py"), *SMALL_MODEL, "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rows"]["compile_rng.init tracker (normal_)"]["one_graph"] is True
    cold, warm = result["compile"]["compile_rng cold"], result["compile"]["compile_rng warm"]
    assert 0 < cold["pass_s"] < cold["backend_s"] < cold["first_call_s"]
    # warm: AOTAutograd's cache returns the graph and its plan is loaded; the pass does not run
    assert warm["aot_cache_hits"] == 1 and warm["pass_s"] == 0 < warm["backend_s"] < warm["first_call_s"]
    for run_kind in ("cold", "warm"):
        assert result["compile"][f"stock {run_kind}"]["first_call_s"] > 0


@pytest.mark.slow
def test_bench_init_first_smoke(tmp_path):
    out = tmp_path / "first.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_init_first.py"), *SMALL_MODEL[:-2], "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 10 and all(r["first_s"] > 0 for r in rows.values())


@pytest.mark.slow
def test_bench_train_step_smoke(tmp_path):
    out = tmp_path / "train.json"
    args = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "4", "--warmup", "1",
            "--repeat", "1", "--threads", "1", "--json", str(out)]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train_step.py"), *args],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"1/invariant", "1/tracker", "1/stock", "1/eager", "1/eager-step"}
    assert result["aten_ops"] > 0 and "us per aten op" in run.stdout
    # stock torch saves dropout masks for backward; compile_rng regenerates them
    assert rows["1/tracker"]["saved_for_backward_bytes"] < rows["1/stock"]["saved_for_backward_bytes"]


@pytest.mark.slow
def test_bench_init_ranks_smoke(tmp_path):
    out = tmp_path / "ranks.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_init_ranks.py"), *SMALL_MODEL, "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1x0", "2x0", "2x1"}
    assert rows["2x0"]["local_params"] + rows["2x1"]["local_params"] == rows["1x0"]["local_params"]


@pytest.mark.slow
def test_bench_import_smoke():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_import.py"), "--repeat", "1"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line[:32].strip(): line[32:].split() for line in run.stdout.splitlines()[1:]}
    assert set(rows) == {"import torch", "import compile_rng", "import torch + DTensor", "import compile_rng + DTensor",
                         "python -m compile_rng --help"}
    assert rows["import torch"][1] == "1.00x"
