"""How a rank's failure reads: one line naming step, rank and peer, then the schedule grid.

A rank that fails inside an action of its lowered program raises :class:`RankFailure` whose
first line names the step, the rank (stage and replica), what it was doing or waiting for and
the peer it lost; below it, :func:`dapple.schedule.validate.format_grid` draws the step x
device grid of the lowered schedule with the failing action marked ``>>like this<<``.

What a dying rank prints is :func:`rank_report`: the whole message when the rank failed on its
own (an error in a layer, a bad batch), only the first line when it merely lost a peer
(:func:`lost_peer`), so a killed rank costs every survivor exactly one line.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from dapple.core.plan import Plan
from dapple.errors import DappleError, ValidationError
from dapple.schedule.ir import Schedule
from dapple.schedule.validate import format_grid

__all__ = [
    "GRID_MAX_DEVICES",
    "RankFailure",
    "describe_rank",
    "failure_grid",
    "lost_peer",
    "rank_report",
    "short_error",
]

GRID_MAX_DEVICES = 8
"""Larger schedules show only the failing rank's column and its peer's in a failure grid."""


class RankFailure(DappleError):
    """A rank could not finish a step (lost peer, timeout, error in a layer).

    Attributes:
        exit_codes: raised by the local launcher: each failed worker's exit code by rank
            (negative: killed by that signal; None: hung and killed by the launcher); empty
            where the failure was seen inside a rank.
    """

    def __init__(self, message: str, exit_codes: dict[int, int | None] | None = None) -> None:
        super().__init__(message)
        self.exit_codes: dict[int, int | None] = dict(exit_codes or {})

    def lost_ranks(self) -> tuple[int, ...]:
        """The ranks whose process was killed by a signal (a lost device), not those that
        exited on an error of their own or because they lost a peer."""
        return tuple(sorted(r for r, c in self.exit_codes.items() if c is not None and c < 0))


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


_TRANSPORT = re.compile(r"gloo/transport/|Connection (?:closed|reset) by peer")
"""A gloo error raised by its transport: a peer's socket closed or reset, or a wait on it timed
out (``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5310``)."""


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` - or an exception it was raised from - is a communication failure: a
    :class:`torch.distributed.DistError` (NCCL aborts and timeouts, a lost store) or a gloo
    transport error (connection closed or reset by a peer, a timed-out wait)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, dist.DistError) or (
            isinstance(cur, RuntimeError) and _TRANSPORT.search(str(cur))
        ):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def rank_report(e: BaseException, rank: int = -1) -> str:
    """The text a rank prints when it gives up on ``e``.

    A :class:`~dapple.errors.DappleError` reads as its message, anything else as
    ``rank R: Type: message`` (no ``rank R:`` for ``rank < 0``). A rank that lost a peer
    (:func:`lost_peer`) prints only the first line, with gloo/NCCL noise trimmed
    (:func:`short_error`): the grid adds nothing when the fault is elsewhere, and with one rank
    dead every survivor says so in one line. A rank that failed on its own keeps everything.
    """
    prefix = f"rank {rank}: " if rank >= 0 else ""
    lost = lost_peer(e)
    if isinstance(e, DappleError):
        text = str(e)
    elif lost:
        text = prefix + short_error(e)
    else:
        text = f"{prefix}{type(e).__name__}: {e}"
    return text.strip().split("\n", 1)[0] if lost else text
