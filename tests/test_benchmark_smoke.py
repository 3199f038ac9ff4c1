"""The benchmark scripts run end to end on small sizes (asserting nothing about speed).

The scripts whose smoke runs cold-compile for minutes on a 2-core machine (the init
benchmarks, the training step, the compiled pipeline) are marked ``beyond_ci``: ``make
test-all`` runs them, as before any figure from them is quoted; CI runs the others."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _table(stdout: str) -> list[dict]:
    """The rows of bench_random's printed table (fixed-width columns; see its print_table)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kernel ")) + 2  # header, dashes
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        isa, threads = line[:18].split()
        ran_isa, ns, x_memset, *ratios, first = line[48:].split()
        rows.append({"isa": isa, "threads": int(threads), "case": line[18:48].strip(), "ran_isa": ran_isa,
                     "ns_per_elem": ns, "x_memset": x_memset, "ratios": ratios, "first_call_s": first})
    return rows


def test_bench_random_smoke(tmp_path):
    import torch

    from compile_rng.stream import cpu_kernel

    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_random.py"), "--size", "4096", "--repeat", "1",
         "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["case"]: r for r in result["rows"]}
    assert len(rows) == len(result["rows"])  # one row per case (one ISA, one thread count)
    groups: dict[str, list] = {}
    for r in rows.values():
        groups.setdefault(r["group"], []).append(r["case"])
    baseline = {"uniform": "eager uniform_", "normal": "eager normal_", "dropout": "eager dropout",
                "dropout channels_last": "eager dropout, ch-last"}
    stock = {"uniform": "inductor torch.rand", "normal": "inductor torch.randn", "dropout": "inductor dropout",
             "dropout channels_last": "inductor dropout, ch-last"}
    assert groups.pop("floor") == ["memset fill_"]
    # every group holds its eager baseline, Inductor's stock op and compile_rng's op
    assert set(groups) == set(baseline)
    for group, members in groups.items():
        assert baseline[group] in members and stock[group] in members, group
        assert any(case.startswith("compile_rng ") for case in members), group
    assert {"compile_rng torch.rand", "compile_rng torch.randn", "compile_rng dropout"} <= set(rows)

    # the ISA lines name the kernel build this process picks and torch's own capabilities
    kernel_isa = cpu_kernel.isa()
    assert run.stdout.startswith("CPU: ") and f"compile_rng CPU kernel: {kernel_isa} (" in run.stdout.splitlines()[0]
    eager_isa = torch.backends.cpu.get_cpu_capability().lower()
    assert result["torch_isas"]["eager"] == eager_isa
    assert f"eager ATen kernels {eager_isa}, Inductor C++ {result['torch_isas']['inductor']}" in run.stdout

    # each ratio is the quotient of the two times it compares (ns/elem share the size)
    ns = {case: r["ns_per_elem"] for case, r in rows.items()}
    for case, r in rows.items():
        assert r["threads"] == 1 and r["isa"] == kernel_isa and ns[case] > 0
        assert r["x_memset"] == pytest.approx(ns[case] / ns["memset fill_"], rel=1e-9)
        if r["group"] == "floor":
            assert r["ran_isa"] == "-" and "speedup_vs_eager" not in r
            continue
        assert r["speedup_vs_eager"] == pytest.approx(ns[baseline[r["group"]]] / ns[case], rel=1e-9)
        assert r["speedup_vs_inductor"] == pytest.approx(ns[stock[r["group"]]] / ns[case], rel=1e-9)
        expected_isa = {"compile_rng": kernel_isa, "inductor": result["torch_isas"]["inductor"]}.get(
            case.split()[0], eager_isa)
        assert r["ran_isa"] == expected_isa, case
    assert rows["eager uniform_"]["speedup_vs_eager"] == 1.0

    # the printed table is the JSON's rows, in order, with the same rounded figures
    table = _table(run.stdout)
    assert [t["case"] for t in table] == [r["case"] for r in result["rows"]]
    for t in table:
        r = rows[t["case"]]
        assert (t["isa"], t["threads"], t["ran_isa"]) == (r["isa"], r["threads"], r["ran_isa"])
        assert (t["ns_per_elem"], t["x_memset"]) == (f"{r['ns_per_elem']:.2f}", f"{r['x_memset']:.1f}")
        assert t["first_call_s"] == f"{r['first_call_s']:.2f}"
        expected = [f"{r[k]:.2f}x" for k in ("speedup_vs_eager", "speedup_vs_inductor") if k in r]
        assert t["ratios"] == expected, t["case"]


SMALL_MODEL = ["--dim", "64", "--layers", "2", "--heads", "2", "--hidden", "96", "--vocab", "256", "--repeat", "1"]


@pytest.mark.slow
@pytest.mark.beyond_ci
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
@pytest.mark.beyond_ci
def test_bench_init_first_smoke(tmp_path):
    out = tmp_path / "first.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_init_first.py"), *SMALL_MODEL[:-2], "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 10 and all(r["first_s"] > 0 for r in rows.values())


@pytest.mark.slow
def test_bench_random_ops_smoke(tmp_path):
    out = tmp_path / "ops.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_random_ops.py"), "--reps", "20",
                          "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"stock", "after a step", "after uninstall", "in a step"}
    assert all(results["stock"]["ops"][op] > 0 for op in results["after a step"]["ops"])
    # every column and the in-step ratio printed for each op; the background draw's stall measured outside
    lines = run.stdout.splitlines()
    assert all(any(line.lstrip().startswith(op) for line in lines) for op in results["stock"]["ops"])
    assert all(results[mode]["background randn(2**25): main thread stalled (ms)"] >= 0
               for mode in ("stock", "after a step", "after uninstall"))


@pytest.mark.slow
@pytest.mark.beyond_ci
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
    # the step's eager overhead, as a cost or as within one repetition's noise (no speed asserted)
    assert result["aten_ops"] > 0 and "eager code inside compile_rng.step, 1 thread(s): " in run.stdout
    assert set(result["random_ops"]) == {"stock", "after a step", "after uninstall", "in a step"}
    assert "random ops on cpu" in run.stdout
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_train_step import step_overhead

    assert step_overhead(rows["1/eager-step"], rows["1/eager"], result["aten_ops"]) in run.stdout
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


def _bench_pipeline(*modes: str, separate: int = 0) -> str:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--steps", "1", "--dim", "32",
         "--elements", "4096", "--separate", str(separate), "--modes", *modes],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "name a draw (cached seed)" in run.stdout
    return run.stdout


def _printed_modes(out: str, expected: list[str]) -> list[str]:
    return [line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in expected]


def test_bench_pipeline_smoke():
    expected = ["names", "tracker", "stock"]
    out = _bench_pipeline(*expected)
    assert _printed_modes(out, expected) == expected
    assert "a random op, in a named step" in out


def test_bench_pipeline_runs_modes_on_their_own_ranks():
    expected = ["tracker", "stock"]  # the baseline runs with its mode
    out = _bench_pipeline("tracker", separate=1)
    assert "each mode alone on its own ranks, 1 rounds of 1 steps" in out
    assert _printed_modes(out, expected) == expected


@pytest.mark.slow
@pytest.mark.beyond_ci
def test_bench_pipeline_compiled_smoke():
    expected = ["stock", "names+compile", "stock+compile"]  # the baseline runs with its mode
    out = _bench_pipeline("names+compile", "stock")
    assert _printed_modes(out, expected) == expected
    assert "compiled blocks, names=" in out


def test_the_step_overhead_is_a_cost_a_saving_or_within_noise():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_train_step import step_overhead

    def row(median, spread):
        return {"median_s": median, "min_s": median - spread}

    assert step_overhead(row(0.020, 0.001), row(0.010, 0.001), 1000) == "10.0 us per aten op more than eager"
    assert step_overhead(row(0.010, 0.001), row(0.020, 0.001), 1000) == "10.0 us per aten op less than eager"
    assert step_overhead(row(0.0105, 0.001), row(0.010, 0.001), 1000).startswith("within noise (+0.50 ms/step")
