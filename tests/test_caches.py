"""Inductor's FX-graph cache serves compile_rng graphs.

Fresh processes share an Inductor cache folder. Plain-tensor graphs: the second process
hits the cache and gets the same values and state advance. DTensor graphs: a process
acting as rank 3 after one acting as rank 0 gets rank 3's own shard (the canonical
stream at torch's tracker offsets) and the whole graph's advance, whatever the cache
does: in torch 2.13 AOTAutograd hands Inductor the DeviceMesh as an opaque graph input,
and the cache key pickles it with its rank and a per-process hash, so that process
misses (no false hit is possible; README, "Caches").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("cache_worker.py")


def _run(rank: int, kind: str, cache_dir: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    out = subprocess.run(
        [sys.executable, str(WORKER), str(rank), kind], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_hits_the_cache_with_the_same_values(tmp_path):
    first = _run(0, "plain", tmp_path)
    second = _run(0, "plain", tmp_path)
    assert first["miss"] >= 1 and first["hit"] == 0 and first["bypass"] == 0, first
    assert second["hit"] >= 1 and second["miss"] == 0 and second["bypass"] == 0, second
    for run in (first, second):
        assert run["values_ok"] and run["state"] == [21, 72 + 8]  # ceil4(12 * 6) + ceil4(5)
    assert first["values"] == second["values"]


@pytest.mark.slow
def test_another_rank_after_a_cached_compile_gets_its_own_values(tmp_path):
    first = _run(0, "dtensor", tmp_path)
    second = _run(3, "dtensor", tmp_path)
    for run in (first, second):
        assert run["bypass"] == 0, run  # cacheable: nothing in the graph prevents it
        assert run["values_ok"]
        assert run["state"] == [21, 72 + 8]  # ceil4(12 * 6) + ceil4(5), on every rank
    assert first["values"] != second["values"]


def test_the_pass_uuid_names_sources_and_layout_not_the_rank():
    from compile_rng.dynamo_backend import JointPass, source_hash
    from compile_rng.passes.functionalize_rng import RngPlan

    tracker = JointPass(RngPlan(name="g", mode="tracker")).uuid()
    assert tracker == (source_hash(), "tracker", False, False, None)
    assert JointPass(RngPlan(name="other", mode="tracker")).uuid() == tracker  # graph names do not matter
    assert JointPass(RngPlan(name="g", mode="invariant")).uuid() != tracker
    assert JointPass(RngPlan(name="g", mode="tracker"), user_pass=lambda g: None).uuid() is None  # bypass
