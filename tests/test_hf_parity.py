"""Same loss curve on model code nobody here wrote (``examples/hf_parity.py``).

Hugging Face transformers' GPT-2 and Llama, float64, AdamW, 3 steps, real gloo ranks:
every step's loss within 1e-9 relative of one process compiled the same way, for DDP,
FSDP2 (whole-model compile with its graph breaks, and per layer), 2 microbatches, eager
code (no compile) and TP=2 with the plain plan (local outputs). Before eager code drew
at its rows and plain-plan shards at their heads these differed by 1e-3 to 4e-3.
Launched with the built-in launcher, with ``torchrun``, and as two torchrun nodes.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import hf_parity  # noqa: E402

from compile_rng.launch import free_port  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 3
TOLERANCE = 1e-9
EXAMPLE = str(Path(__file__).parent.parent / "examples" / "hf_parity.py")

_references: dict = {}


def _reference(family: str, compile: str) -> list[float]:
    """One process, compiled like the configuration (computed once per module)."""
    if (family, compile) not in _references:
        _references[family, compile] = hf_parity.train(family, "single", compile, STEPS)
    return _references[family, compile]


# Left to `make test-all` (CI's budget): the whole Llama compiled over the plain TP plan,
# and GPT-2's layers compiled under FSDP2. CI checks that plan compiled per layer and
# eagerly, layers compiled under FSDP2 on the Llama, and GPT-2 compiled whole under DDP,
# FSDP2 (graph breaks at its hooks) and microbatches.
BEYOND_CI = [("llama", "TP=2", "whole"), ("gpt2", "FSDP2=2", "layers")]
CI_CONFIGS = [c for c in hf_parity.CONFIGS if c not in BEYOND_CI]


@pytest.fixture(scope="module")
def curves() -> dict:
    """CI's configurations' curves, one set of gloo ranks per world size (their imports
    and process group serve all of its configurations, as in one job)."""
    return hf_parity.run_many(CI_CONFIGS, STEPS)


def _check_curve(config: tuple[str, str, str], losses: list[float]) -> None:
    family, _, compile = config
    assert len(losses) == STEPS
    difference = hf_parity.max_relative_difference(losses, _reference(family, compile))
    print(f"hf_parity {'/'.join(config)}: {difference:.2e}")  # shown by pytest -rP (the README's table)
    assert difference < TOLERANCE


@pytest.mark.parametrize("config", CI_CONFIGS, ids="/".join)
def test_loss_curve_matches_one_process(curves, config):
    _check_curve(config, curves[config])


@pytest.fixture(scope="module")
def curves_beyond_ci() -> dict:
    """The other configurations' curves, on their own ranks (only `make test-all` asks)."""
    return hf_parity.run_many(BEYOND_CI, STEPS)


@pytest.mark.beyond_ci
@pytest.mark.parametrize("config", BEYOND_CI, ids="/".join)
def test_loss_curve_beyond_ci_matches_one_process(curves_beyond_ci, config):
    _check_curve(config, curves_beyond_ci[config])


def _table_value(output: str, config: tuple[str, str, str]) -> float:
    family, parallelism, compile = config
    match = re.search(rf"^\s+{family}\s+{re.escape(parallelism)}\s+{compile}\s+(\S+)$", output, re.M)
    assert match, output[-3000:]
    return float(match.group(1))


def _torchrun(*flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *flags, EXAMPLE, "--steps", str(STEPS), "--only", "gpt2/DDP=2/whole"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


# CI launches hf_parity through torchrun as two nodes (below: agents, rendezvous and the
# environment they set), and a --standalone node in tests/test_hf_trainer.py; this one
# runs in `make test-all`.
@pytest.mark.beyond_ci
def test_torchrun_one_node():
    proc = _torchrun("--standalone", "--nproc-per-node", "2")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert _table_value(output, ("gpt2", "DDP=2", "whole")) < TOLERANCE


def test_torchrun_two_nodes():
    """Two torchrun agents on this machine, one rank each, rendezvous over c10d on 127.0.0.1."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        _torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "hf_parity")
        for node in range(2)
    ]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-2000:] for o in outputs)
    reported = [o for o in outputs if re.search(r"^\s+gpt2\s+DDP=2", o, re.M)]
    assert len(reported) == 1  # rank 0 reports
    assert _table_value(reported[0], ("gpt2", "DDP=2", "whole")) < TOLERANCE
