"""compile_rng: functional, SPMD-correct Philox random numbers for torch.compile.

Public API:

* :func:`manual_seed`, :func:`get_state`, :func:`set_state` - the per-device Philox
  state ``(seed, offset)``; ``torch.manual_seed(s)`` also restarts it at ``(s, 0)``.
  Importing compile_rng installs it as DTensor's RNG tracker: DTensor random ops on
  CPU meshes follow the SPMD contract in eager and compiled code alike.
* :func:`compile` - ``torch.compile`` with compile_rng's backend, graph breaks
  included (the eager code between graphs stays on the stream); :func:`backend` -
  ``torch.compile(fn, backend=compile_rng.backend(...))``, also registered as
  ``backend="compile_rng"`` (its graphs only).
* :func:`init` - ``@compile_rng.init`` / ``@compile_rng.init(mode="invariant")`` on a
  weight-initialization function; :func:`mode` - the counter layout of eager DTensor ops.
* :func:`dump` (depyf dumps plus annotated graphs before/after the pass) and
  :func:`explain` (a report of every random op, its placements and offsets per rank).
* :mod:`compile_rng.ops` - the functional ops (``torch.ops.compile_rng.*``) and the
  canonical stream they implement (:mod:`compile_rng.stream`).
"""

import importlib.util
import sys
from pathlib import Path


def _mount_source_passes() -> None:
    # The passes live in the checkout's top-level passes/ folder, installed as
    # compile_rng.passes. When compile_rng itself is imported from a source checkout
    # (python -m from the repo root), mount that folder under the same name.
    if "compile_rng.passes" in sys.modules or importlib.util.find_spec(__name__ + ".passes"):
        return
    folder = Path(__file__).resolve().parent.parent / "passes"
    spec = importlib.util.spec_from_file_location(
        __name__ + ".passes", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_mount_source_passes()

from . import ops, stream  # noqa: E402
from .backend import backend  # noqa: E402
from .compiling import compile  # noqa: E402
from .dump import dump  # noqa: E402
from .init_decorator import init  # noqa: E402
from .report import explain  # noqa: E402
from .seeding import install_manual_seed_hook, manual_seed  # noqa: E402
from .state import get_state, set_state  # noqa: E402
from . import tracker, trunc_normal  # noqa: E402
from .tracker import mode  # noqa: E402

install_manual_seed_hook()
tracker.install()  # importing compile_rng opts DTensor random ops on CPU meshes into its stream
trunc_normal.install()  # torch.nn.init.trunc_normal_: fewer redraws, ranks kept in step

__all__ = ["backend", "compile", "dump", "explain", "get_state", "init", "manual_seed", "mode", "ops", "set_state", "stream"]
__version__ = "0.1.0"
