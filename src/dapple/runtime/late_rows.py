"""The step's collective without the non-finite guard (``on_nonfinite="off"``): every rank's row
of measurements is gathered asynchronously and read one step later.

With the guard (:meth:`dapple.runtime.guard.NonFiniteGuard.agree_finite`) every rank waits at
the end of a step for every other rank's verdict before its optimizer step. In a V schedule
(ZB-V) the ranks end a step in a staircase - rank g about g chunk passes after rank 0 - and
rank 0 needs its updated first chunk first in the next step, so it waits out the staircase every
step. Without the guard no rank waits: each posts its row (:meth:`LateRows.post`) and updates at
once, and the rows are read when the next step posts its own (:meth:`LateRows.take`), long after
the slowest rank joined, or after the run's last step.
"""

from __future__ import annotations

from typing import Any

import torch

from dapple.runtime import comm
from dapple.runtime.metrics import read_rows

__all__ = ["LateRows"]


class LateRows:
    """One rank's side of the step's collective without the guard (module docstring).

    Every rank of the world creates one (ranks beyond the plan too) and calls :meth:`post` once
    per step; rows of a world of one are read without a gather.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self._work: Any = None
        self._out: torch.Tensor | None = None
        self._n = 0
        """Columns of a row (the rest of a gathered row is the ``summed`` vector)."""

    @property
    def pending(self) -> bool:
        """A posted step's rows are not read yet."""
        return self._out is not None

    def post(self, row: torch.Tensor, summed: torch.Tensor | None = None) -> None:
        """Start gathering this step's ``row`` (float64, the same length on every rank) and
        ``summed`` (a float64 vector the same length on every rank, summed over the ranks when
        read). The previous step's rows must have been taken."""
        if self.pending:
            raise RuntimeError("LateRows.post: the previous step's rows were not taken")
        self._n = row.numel()
        mine = row if summed is None else torch.cat([row, summed.to(row.device, row.dtype)])
        if self.world == 1:
            self._out, self._work = mine.clone(), None
            return
        self._out = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        self._work = comm.all_gather_single(self._out, mine, async_op=True)

    def take(self) -> tuple[list[list[float]], torch.Tensor, list[float]] | None:
        """The posted step's rows by rank (on the host, read once), the same as a float64
        tensor on the device, and ``summed`` summed over the ranks (empty without); None when
        no step is pending."""
        if self._out is None:
            return None
        if self._work is not None:
            self._work.wait()
        table = self._out.view(self.world, -1)
        self._out, self._work = None, None
        return read_rows(table, self._n)

    def drop(self) -> None:
        """Forget a pending step (a failed run: its peers may be gone)."""
        self._out, self._work = None, None
