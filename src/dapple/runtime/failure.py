"""How a rank's failure reads: one line naming step, rank and peer, then the schedule grid.

A rank that fails inside an action of its lowered program raises :class:`RankFailure` whose
first line names the step, the rank (stage and replica), what it was doing or waiting for and
the peer it lost; below it, :func:`dapple.schedule.validate.format_grid` draws the step x
device grid of the lowered schedule with the failing action marked ``>>like this<<``.
"""

from __future__ import annotations

import re

from dapple.core.plan import Plan
from dapple.errors import DappleError, ValidationError
from dapple.schedule.ir import Schedule
from dapple.schedule.validate import format_grid

__all__ = ["GRID_MAX_DEVICES", "RankFailure", "describe_rank", "failure_grid", "short_error"]

GRID_MAX_DEVICES = 8
"""Larger schedules show only the failing rank's column and its peer's in a failure grid."""


class RankFailure(DappleError):
    """A rank could not finish a step (lost peer, timeout, error in a layer)."""


def describe_rank(plan: Plan, rank: int) -> str:
    """``rank R (stage s replica j)``; ``rank R`` beyond the plan; empty for ``rank < 0``."""
    if rank < 0:
        return ""
    try:
        s, j = plan.stage_of_device(rank)
    except ValidationError:
        return f"rank {rank}"
    return f"rank {rank} (stage {s} replica {j})"


def short_error(e: BaseException) -> str:
    """First line of an exception without gloo/NCCL source-location noise."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically")[0]
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def failure_grid(schedule: Schedule, rank: int, position: int, peer: int = -1) -> str:
    """The step x device grid of ``schedule`` with action ``position`` of ``rank`` marked.

    Args:
        schedule: the lowered schedule (device -> actions).
        rank: the failing rank (its column).
        position: the failing action's index in the rank's program.
        peer: the rank it waited for (-1: none); with more than :data:`GRID_MAX_DEVICES`
            devices only the columns of ``rank`` and ``peer`` are drawn.
    """
    shown = schedule
    if len(schedule) > GRID_MAX_DEVICES:
        shown = {d: schedule[d] for d in (rank, peer) if d in schedule}
    return format_grid(shown, [(rank, position)])
