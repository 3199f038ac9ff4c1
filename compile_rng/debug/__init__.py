"""For people: reports of what the pass did (``report``, ``explaining``), graph dumps
(``dumps``) and the ahead-of-time GPU compile check (``gpu_aot``)."""
