import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fresh_state():
    import compile_rng

    compile_rng.manual_seed(0)
    yield
