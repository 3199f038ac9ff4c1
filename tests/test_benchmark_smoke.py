"""The benchmark script runs end to end on small sizes (asserts nothing about speed)."""

import json
import subprocess
import sys
from pathlib import Path

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
