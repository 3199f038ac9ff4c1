"""The sharding-invariance example on 4 real gloo ranks: TP=2, FSDP=2, FSDP=2 x TP=2
and two pipeline stages, every parameter compared bitwise with the single-device init."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import llama_init  # noqa: E402

CONFIGS = ("tp", "fsdp", "fsdp_tp", "pp")


@pytest.mark.slow
def test_invariance_table():
    table = llama_init.run(llama_init.parse_args(["--dim", "32", "--hidden", "96", "--vocab", "64"]))["table"]
    for config in CONFIGS:
        assert table[("invariant + key=fqn", config)], config  # identical everywhere, PP included
    for config in ("tp", "fsdp", "fsdp_tp"):
        assert table[("invariant", config)], config
    assert not table[("invariant", "pp")]  # program order cannot know the other stage's counters
    assert not table[("tracker", "tp")] and not table[("tracker", "fsdp_tp")]  # eager DTensor semantics
