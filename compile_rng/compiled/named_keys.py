"""A batched graph's key table: every random op's key, per call.

Random op ``j`` of a batched graph draws with ``key[:2] ^ table[j]``
(:mod:`compile_rng.passes.batch_rows`). In the step's sequence the table is zeros: every op
draws from the graph's key, at its offset in the graph. In a step with ``names=``
(:mod:`compile_rng.semantics.named_draws`) each op draws from the stream of its name
instead - the module it sits in, found from the frame Dynamo compiled, that module's call
and the op's ordinal in it - at the step's base plus its rows, exactly as the op would
draw eagerly: row ``j`` holds that stream's seed and the step's base less the op's offset
in the graph (the graph adds the offset back), and the graph's key is ``[0, 0, rows]``.
One compiled graph serves both rules, every rank and every microbatch: the table is an
input, never a constant of the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from compile_rng._torch import dynamo_internals
from compile_rng.compiled.symbols import SizeFn
from compile_rng.passes.plan import ROWS_TOTAL, RngPlan
from compile_rng.semantics.named_draws import Namer, check_step_draw
from compile_rng.semantics.rows import Rows
from compile_rng.stream import UINT64, as_int64

#: the files between Dynamo's call of a compiled graph and this module
_RUNTIME_FILES = tuple(str(Path(__file__).with_name(name)) for name in ("backend.py", "runtime.py", "named_keys.py"))


class KeyTable:
    """The key table of one batched graph (``plan.key_table_rows`` rows)."""

    def __init__(self, plan: RngPlan, placeholders: Sequence[fx.Node], device: torch.device):
        self.plan, self.device = plan, device
        self.offsets = [SizeFn(op.offset, placeholders) for op in plan.ops]
        self.advance = SizeFn(plan.total_advance, placeholders)
        self._zeros: torch.Tensor | None = None

    def sequence(self) -> torch.Tensor:
        """The table of a call in the step's sequence: zeros (made once)."""
        if self._zeros is None:
            self._zeros = torch.zeros(self.plan.key_table_rows, 2, dtype=torch.int64, device=self.device)
        return self._zeros

    def named(self, namer: Namer, args: Sequence[Any], rows: Rows) -> torch.Tensor:
        """The table of a call in a step with names: each op's named stream, at the step's base."""
        batch = {ROWS_TOTAL: rows.total}
        check_step_draw(f"the compiled graph {self.plan.name}", self.advance(args, batch))
        frame = dynamo_internals.compiled_frame(_RUNTIME_FILES)
        positions = namer.graph_positions(
            self.plan.name, frame, [op.module for op in self.plan.ops], self.plan.module_calls, self.device
        )
        table = [[0, 0] for _ in range(self.plan.key_table_rows)]
        for j, ((seed, base), offset) in enumerate(zip(positions, self.offsets)):
            table[j] = [as_int64(seed), as_int64((base - offset(args, batch)) % UINT64)]
        return torch.tensor(table, dtype=torch.int64, device=self.device)
