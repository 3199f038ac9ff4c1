"""The one home of private torch and Triton APIs, one module per subsystem:
``core_internals`` (the dispatcher, tracing, pytree, symbolic shapes, autograd),
``dynamo_internals`` (Dynamo and AOTAutograd), ``inductor_internals``,
``dtensor_internals``, ``distributed_internals`` (meshes, process groups, checkpoint
names; and the one private stdlib function compile_rng calls) and ``triton_internals``.
Nothing else in compile_rng touches a private API, and nothing here imports the rest of
compile_rng (``tests/test_torch_internals.py`` and ``tests/test_import_structure.py``
check it).

Each item says why compile_rng needs it; all were checked on torch 2.13.0 and 2.15.0
(2.14 has the same modules), and by the test suite on 2.11.0 and 2.12.1. Where an older
release differs, the difference is handled here, once: 2.11's DTensor has no accelerator
branch (``dtensor_internals.dtensor_dispatch_has_rng_op``) and its ``trunc_normal_`` is
not the redraw loop (``core_internals.trunc_normal_redraws``). Private here means a module, attribute or method whose
name starts with ``_`` (``torch._dynamo``, ``DTensor._op_dispatcher``), and Dynamo's
undocumented fields (``dynamo_internals.UNDOCUMENTED_FIELDS``).

The changes compile_rng *makes* to torch live in :mod:`compile_rng.installation`, which
reads them through these homes, with two kinds of exception, listed here for
``tests/test_torch_internals.py``:

* :data:`TEMPORARY_PATCHES`, which live in the homes beside what they patch, each named
  in its home's docstring: two cache patches that last only for the backend's own
  compile (``autograd_cache_keys``, ``rank_free_mesh_cache_keys``), ``torch.compile``'s
  default backend for a block (``compiles_with``: ``compile_rng.library_compiles``), a DTensor dispatch
  patch that lasts for a block (``dtensor_operands_kept``), which traced code below the
  installer uses, one on pipeline stages that lasts for a step
  (``pipeline_chunks_wrapped``), and the helper functions a lowering adds to the source of
  the one Triton kernel being generated (``triton_helper``);
* :data:`INSTALLER_ONLY`: the accessors that set or hand out torch's mutable state
  (DTensor's tracker slot, handler table and dispatcher, and the dispatcher's per-thread
  reading of the table; Inductor's op handlers, to which the installer adds one op), which
  only the installer calls.
"""

#: ``(home, function)`` of each function of a home that changes torch for one call or the
#: length of a ``with`` block (the backend's own compile, under Dynamo's compile lock, or
#: a DTensor dispatch, or a step's pipeline stages). Every other change to torch is made by compile_rng.installation.
TEMPORARY_PATCHES: tuple[tuple[str, str], ...] = (
    ("dynamo_internals", "autograd_cache_keys"),
    ("dynamo_internals", "compiles_with"),
    ("inductor_internals", "rank_free_mesh_cache_keys"),
    ("dtensor_internals", "dtensor_operands_kept"),
    ("distributed_internals", "pipeline_chunks_wrapped"),
    ("inductor_internals", "triton_helper"),
)

#: Accessors of the homes that set or hand out torch's mutable state: only
#: compile_rng.installation calls them (DTensor's tracker slot, its per-op handler table,
#: its op dispatcher, and the dispatcher's per-thread reading of that table; an op added
#: to and removed from Inductor's op handlers).
INSTALLER_ONLY: tuple[str, ...] = (
    "set_rng_tracker", "dtensor_op_handlers", "dtensor_op_dispatcher", "set_op_handlers_per_thread",
    "add_triton_op", "remove_triton_op",
)

#: ``(module path, class, private name, reason with the torch versions checked)`` of each
#: private torch method or field a compile_rng class outside the homes overrides or sets.
#: None: DTensor's tracker protocol is implemented in ``dtensor_internals``
#: (``dtensor_rng_tracker_base``).
PRIVATE_OVERRIDES: tuple[tuple[str, str, str, str], ...] = ()
