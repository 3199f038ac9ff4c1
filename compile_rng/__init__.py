"""compile_rng: functional, SPMD-correct Philox random numbers for torch.compile.

Public API (importing compile_rng runs :func:`install`; :func:`uninstall` undoes it):

* :func:`manual_seed`, :func:`get_state`, :func:`set_state` - the per-device Philox
  state ``(seed, offset)``; ``torch.manual_seed(s)`` also restarts it at ``(s, 0)``;
  :func:`state_dict`, :func:`load_state_dict` and :class:`StreamState` (a
  ``torch.distributed.checkpoint`` ``Stateful``) save and resume it with a checkpoint.
  Importing compile_rng installs it as DTensor's RNG tracker: DTensor random ops on
  CPU, CUDA and XPU meshes follow the SPMD contract in eager and compiled code alike.
* :func:`compile` - ``torch.compile`` with compile_rng's backend, graph breaks
  included (the eager code between graphs stays on the stream); :func:`backend` -
  ``torch.compile(fn, backend=compile_rng.backend(...))``, also registered as
  ``backend="compile_rng"`` (its graphs only).
* :func:`step` - a training step for ``backend(layout="invariant", batched=True)``:
  activations draw at their rows of the step's global batch, so data parallelism and
  microbatching leave the values unchanged (:mod:`compile_rng.eager.batches`);
  ``step(..., names=model_or_pipeline_stages)``: every eager random op draws from the
  stream named by its module in the model, so pipeline stages draw the single
  process's masks (:mod:`compile_rng.semantics.named_draws`); :func:`run_seed` declares
  the seed of named streams once, for ranks seeded apart (``seed + pp_rank``).
* :class:`TrainerMixin` - ``class Trainer(compile_rng.TrainerMixin, transformers.Trainer)``:
  every optimizer step of the Hugging Face Trainer in a :func:`step`, its gradient
  accumulation as the step's microbatches, at the rows accelerate's loader dealt;
  :func:`accelerate_batches` - the same for a plain ``accelerate`` loop;
  :class:`LightningCallback` - the same for PyTorch Lightning (``callbacks=[...]``).
* :func:`init` - ``@compile_rng.init`` / ``@compile_rng.init(layout="invariant")`` on a
  weight-initialization function (``streams="fqn"``: one stream per parameter name);
  :func:`layout` - the counter layout of eager DTensor ops (:func:`mode`: its deprecated
  spelling, as ``mode=`` is of ``layout=`` and ``key=`` of ``streams=``).
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

# The public API, imported on first use: `import compile_rng` costs about a third of
# `import torch` on top of it (no Dynamo, Inductor or depyf until they are needed).
_PUBLIC = {
    "StreamState": ".stream.checkpointing",
    "LightningCallback": ".integrations.lightning_callback",
    "TrainerMixin": ".integrations.hf_trainer",
    "accelerate_batches": ".integrations.accelerate_loop",
    "backend": ".compiled.backend",
    "compile": ".compiled.compiling",
    "dump": ".debug.dumps",
    "explain": ".compiled.explaining",
    "get_state": ".stream.state",
    "init": ".compiled.init_decorator",
    "install": ".installation",
    "load_state_dict": ".stream.checkpointing",
    "manual_seed": ".installation",
    "layout": ".eager.layout_blocks",
    "library_compiles": ".integrations.library_compiles",
    "mode": ".eager.layout_blocks",
    "ops": None,
    "run_seed": ".stream.state",
    "set_state": ".stream.state",
    "state_dict": ".stream.checkpointing",
    "step": ".eager.batches",
    "stream": None,
    "uninstall": ".installation",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _PUBLIC[name]
    value = importlib.import_module(where or "." + name, __name__)
    if where is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def _run_as_cli() -> bool:
    # `python -m compile_rng` imports this package before __main__ parses the command
    # line (sys.argv[0] is "-m" meanwhile, as the docs of -m say); __main__ installs
    # after parsing, so `--help` answers without importing torch.
    return sys.argv[:1] == ["-m"] and sys.orig_argv[sys.orig_argv.index("-m") + 1 :][:1] == [__name__]


if not _run_as_cli():
    from compile_rng.installation import install as _install

    _install()  # importing compile_rng opts torch's seeding and DTensor's meshes into its stream
