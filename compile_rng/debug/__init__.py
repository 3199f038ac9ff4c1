"""For people: reports of what the pass did (``report``; :mod:`compile_rng.compiled.explaining`
runs the backend to fill one), graph dumps (``dumps``) and the ahead-of-time GPU compile
check (``gpu_aot``). Below the backend, which writes the dumps."""
