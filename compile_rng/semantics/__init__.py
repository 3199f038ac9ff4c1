"""Semantics: which aten ops are random and what they draw (``random_ops``), where a
DTensor shard's or a batch row's elements sit in the stream (``spmd``, ``rows``,
``shard_layouts``, ``local_values``), and the rank-divergence checks (``verify``)."""
