"""The same seed gives the same values across processes, thread counts and warm or
cold compile caches."""

import os
import subprocess
import sys
import textwrap

import pytest


PROGRAM = textwrap.dedent(
    """
    import hashlib, sys, torch, compile_rng
    import torch.nn.functional as F
    torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(123)
    x = torch.ones(300, 70)
    fn = torch.compile(lambda t: (torch.rand_like(t), torch.randn(257), F.dropout(t, 0.3), torch.randint(0, 9, (64,))),
                       backend="compile_rng")
    outs = [*fn(x), *fn(x)]
    h = hashlib.sha256()
    for o in outs:
        h.update(o.numpy().tobytes())
    print(h.hexdigest(), compile_rng.get_state())
    """
)


# `make test-all`: in CI, tests/test_caches.py checks warm caches' values in a second
# process, and the real-rank tests (1 OpenMP thread per rank) check compiled masks bitwise
# against one process on all of the machine's threads.
@pytest.mark.slow
@pytest.mark.beyond_ci
def test_same_seed_same_values_across_processes_threads_and_caches(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = []
    for threads in ("1", "2", "2"):  # cold cache, then a different thread count, then a warm cache
        out = subprocess.run([sys.executable, str(script), threads], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.strip())
    assert runs[0] == runs[1] == runs[2]
