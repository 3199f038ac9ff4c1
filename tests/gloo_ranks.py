"""Run a test body on real gloo ranks: compile_rng's own launcher (the demo, examples
and benchmarks use it too)."""

from compile_rng.launch import spawn

__all__ = ["spawn"]
