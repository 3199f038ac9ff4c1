import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors (read when
# compile_rng.stream.triton_kernels is imported, so set before any test imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_state():
    import compile_rng

    compile_rng.manual_seed(0)
    compile_rng.run_seed(None)  # no test inherits another's declared run seed
    yield


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh Inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``, this test's
    ``tmp_path``), with dynamo's compiled code reset before and after the test, so that a
    compile reads and writes that folder only."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()
