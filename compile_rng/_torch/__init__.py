"""The one home of private torch and Triton APIs: every private read (``torch_internals``,
``triton_internals``), and the few changes to torch that last for one call or block.
The changes importing compile_rng makes are :mod:`compile_rng.installation`'s, through
these readers. Nothing else in compile_rng touches them (``tests/test_torch_internals.py``
checks it); nothing here imports the rest of compile_rng."""
