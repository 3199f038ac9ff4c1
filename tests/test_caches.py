"""The compile caches serve compile_rng graphs across processes and ranks.

Fresh processes share an Inductor cache folder. The second process hits AOTAutograd's
cache (so neither AOTAutograd, the pass nor Inductor runs), loads the plan the first
filed, and gets the same values and state advance. For a DTensor graph AOTAutograd's
entry is per rank (tracing may bake the rank into the graph: the vocab-parallel test
shows it does), so a process acting as another rank traces the graph itself, and hits
the Inductor artifact rank 0 compiled (its key hashes the traced graph's code and the
mesh by its ranks and layout, not this process's rank); it still gets its own rank's
shard (the canonical stream at torch's tracker offsets) and the whole graph's advance.
A restarted job hits each rank's own AOTAutograd entry; a training step of Hugging
Face's Llama loads forward and backward and gets bitwise the same loss and gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FX_CACHE_BYPASSED_ON_212

WORKER = Path(__file__).with_name("cache_worker.py")


def _run(rank: int, kind: str, cache_dir: Path, autograd_cache: bool = True) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1" if autograd_cache else "0"}
    out = subprocess.run(
        [sys.executable, str(WORKER), str(rank), kind], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


STATE = [21, 72 + 8]  # ceil4(12 * 6) + ceil4(5), on every rank


# `make test-all`: in CI, a restarted gloo job (below) hits the caches in second
# processes, every rank getting its first job's values, and so does a transformers step.
@pytest.mark.slow
@pytest.mark.beyond_ci
def test_a_second_process_hits_the_caches_with_the_same_values(tmp_path):
    first = _run(0, "plain", tmp_path)
    second = _run(0, "plain", tmp_path)
    assert first["aot_miss"] == 1 and first["miss"] >= 1 and first["hit"] == 0, first
    assert second["aot_hit"] == 1 and second["aot_miss"] == 0 and second["miss"] == 0, second
    for run in (first, second):
        assert run["values_ok"] and run["state"] == STATE
    assert first["values"] == second["values"]


@pytest.mark.slow
def test_another_rank_hits_the_inductor_artifact_and_gets_its_own_values(tmp_path):
    """Rank 3 traces the graph itself (AOTAutograd's entry is per rank for a DTensor
    graph), gets the same graph code and hits the Inductor artifact rank 0 compiled."""
    first = _run(0, "dtensor", tmp_path)
    second = _run(3, "dtensor", tmp_path)
    assert first["aot_miss"] == 1 and first["miss"] >= 1, first
    assert second["aot_hit"] == 0 and second["aot_miss"] == 1, second
    assert second["hit"] >= 1 and second["miss"] == 0 and second["bypass"] == 0, second
    for run in (first, second):
        assert run["values_ok"] and run["state"] == STATE
    assert first["values"] != second["values"]


# `make test-all`: CI checks the FX graph cache serving another rank under the autograd
# cache (the default) just above; this is the same with the autograd cache turned off.
@pytest.mark.slow
@pytest.mark.beyond_ci
def test_without_the_autograd_cache_the_fx_graph_cache_serves_another_rank(tmp_path):
    first = _run(0, "dtensor", tmp_path, autograd_cache=False)
    second = _run(3, "dtensor", tmp_path, autograd_cache=False)
    assert first["miss"] >= 1 and first["hit"] == 0 and first["bypass"] == 0, first
    assert second["hit"] >= 1 and second["miss"] == 0 and second["bypass"] == 0, second
    for run in (first, second):
        assert run["values_ok"] and run["state"] == STATE
    assert first["values"] != second["values"]


@pytest.mark.slow
def test_a_transformers_training_step_hits_the_caches_bitwise(tmp_path):
    """Hugging Face Llama, forward + backward with attention dropout: the second process
    loads forward and backward from the caches; loss and every gradient are bitwise the
    first process's, and the state advanced by both layers' masks."""
    pytest.importorskip("transformers")
    first = _run(0, "llama", tmp_path)
    second = _run(0, "llama", tmp_path)
    assert first["aot_miss"] == 1 and second["aot_hit"] == 1 and second["miss"] == 0, (first, second)
    masks = 2 * 4 * 16 * 16  # batch x heads x seq x seq, per layer
    for run in (first, second):
        assert run["values_ok"] and run["state"] == [21, 2 * masks]
    assert first["values"] == second["values"]


def _restartable_job(rank: int, world: int, cache_dir: str, out: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from cache_worker import run_dtensor
    from torch.distributed.device_mesh import DeviceMesh

    Path(f"{out}.{rank}").write_text(json.dumps(run_dtensor(DeviceMesh("cpu", list(range(world))))))


@pytest.mark.slow
def test_a_restarted_gloo_job_hits_the_caches_on_every_rank(tmp_path):
    """Two gloo ranks compile into an empty cache folder; the job restarts (new processes)
    and every rank hits AOTAutograd's cache, with the first job's values and state."""
    from compile_rng.launch import spawn

    runs = {}
    for job in ("first", "restart"):
        spawn(_restartable_job, 2, str(tmp_path / "cache"), str(tmp_path / job))
        runs[job] = [json.loads((tmp_path / f"{job}.{r}").read_text()) for r in range(2)]
    for first, restart in zip(runs["first"], runs["restart"]):
        assert first["aot_hit"] + first["aot_miss"] == 1, first
        assert restart["aot_hit"] == 1 and restart["miss"] == 0, restart
        for run in (first, restart):
            assert run["values_ok"] and run["state"] == STATE
        assert restart["values"] == first["values"]
    assert runs["first"][0]["values"] != runs["first"][1]["values"]


def _vocab_job(rank: int, world: int, cache_dir: str, out: str, ordered: bool) -> None:
    """``ordered``: rank 1 compiles once rank 0 has filed its plan (rank 0's compiled
    graph then waits in its collectives for rank 1)."""
    import time

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from cache_worker import run_vocab_parallel
    from torch.distributed.device_mesh import DeviceMesh

    def after_rank_0() -> None:
        plans, deadline = Path(cache_dir) / "compile_rng_plans", time.monotonic() + 300
        while rank > 0 and ordered and not (plans.is_dir() and any(plans.iterdir())):
            assert time.monotonic() < deadline, "rank 0 filed no plan"
            time.sleep(0.1)

    result = run_vocab_parallel(DeviceMesh("cpu", list(range(world))), after_rank_0)
    Path(f"{out}.{rank}").write_text(json.dumps(result))


@pytest.mark.slow
def test_a_rank_never_runs_the_graph_another_rank_traced(tmp_path):
    """Tracing a vocab-sharded embedding bakes the rank's row offset into the compiled
    graph, which AOTAutograd's own key does not see: rank 1, compiling after rank 0
    filed its entries, must trace its own graph (it got rank 0's, and wrong values,
    before compile_rng mixed the rank into the key); a restarted job hits each rank's
    own entry."""
    from compile_rng.launch import spawn

    runs = {}
    for job in ("first", "restart"):
        spawn(_vocab_job, 2, str(tmp_path / "cache"), str(tmp_path / job), job == "first")
        runs[job] = [json.loads((tmp_path / f"{job}.{r}").read_text()) for r in range(2)]
    first, restart = runs["first"], runs["restart"]
    assert first[1]["aot_hit"] == 0 and first[1]["aot_miss"] == 1, first[1]
    for rank in range(2):
        assert first[rank]["values_ok"] and restart[rank]["values_ok"], rank
        assert restart[rank]["aot_hit"] == 1 and restart[rank]["values"] == first[rank]["values"], restart[rank]
    assert first[0]["values"] != first[1]["values"]


def _dropout_twice(x):
    import torch.nn.functional as F

    return F.dropout(x, 0.25) * 2


def _also_dropout_twice(x):  # another function (another graph name), the same code
    import torch.nn.functional as F

    return F.dropout(x, 0.25) * 2


@FX_CACHE_BYPASSED_ON_212
def test_the_caches_compile_again_for_other_sources_or_layout_not_for_another_graph_name(cache_dir, monkeypatch):
    """compile_rng's rewrite is in the compile caches' keys: an unchanged program is served
    from them, one compiled with another layout or by another compile_rng (its sources
    changed: an upgrade) compiles again, and the graph's name does not matter. A joint pass
    of the user's that has no key of its own leaves the caches out."""
    import torch

    import compile_rng
    from compile_rng.compiled import joint_pass
    from helpers import cache_outcome

    def run(fn=_dropout_twice, options=None, **backend):
        compiled = torch.compile(fn, backend=compile_rng.backend(**backend), options=options)
        return lambda: compiled(torch.ones(6, 5))

    assert cache_outcome(run()) == "compiled"
    assert cache_outcome(run()) == "served"
    assert cache_outcome(run(_also_dropout_twice)) == "served"
    assert cache_outcome(run(layout="invariant")) == "compiled"
    assert cache_outcome(run(options={"joint_custom_pre_pass": lambda graph: None})) == "bypassed"
    monkeypatch.setattr(joint_pass, "source_hash", lambda: "the sources of another compile_rng")
    assert cache_outcome(run()) == "compiled"
    assert cache_outcome(run()) == "served"
