"""torch.compile integration: the backend (capture -> ``passes`` -> inner compiler ->
run), its runtime, the plans of cached graphs, ``compile_rng.compile``, and plain TP
shards inside Dynamo graphs."""
