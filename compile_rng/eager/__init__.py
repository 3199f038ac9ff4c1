"""Eager execution on the stream: dispatch modes for plain tensors, compile_rng as
DTensor's RNG tracker, plain TP shards, per-name streams, ``@init``, ``trunc_normal_``
and training steps (``batches``)."""
