"""The one home of private torch and Triton APIs: every private read (``torch_internals``,
``triton_internals``) and every change importing compile_rng makes to torch
(``installation``, ``import_hooks``). Nothing else in compile_rng touches them
(``tests/test_torch_internals.py`` checks it)."""
