"""Graph passes of compile_rng (installed as ``compile_rng.passes``)."""
