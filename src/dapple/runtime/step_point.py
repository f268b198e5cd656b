"""The step point of a rank's lowered program: where its compute ends and its ``AR``, step point
(``AGREE`` or ``POST``, :func:`dapple.schedule.ir.step_point_kind`) and ``OPT`` begin, and which
step point it holds (:class:`dapple.runtime.interpreter.ProgramInterpreter` runs it)."""

from __future__ import annotations

from collections.abc import Sequence

from dapple.errors import ValidationError
from dapple.schedule.ir import STEP_POINTS, Action, ActionKind, Schedule, step_point_kind
from dapple.schedule.validate import format_grid

__all__ = ["point_of", "step_point"]

K = ActionKind

_UPDATES = (K.ALLREDUCE, K.AGREE, K.POST, K.STEP)
"""The actions at the program's end: after the compute, around the step point."""


def step_point(schedule: Schedule, rank: int) -> int:
    """The position of ``rank``'s first ``AR``/``AGREE``/``POST``/``OPT`` (its program's length
    without one).

    Raises:
        ValidationError: an action other than those follows it; the message holds the schedule
            grid with those actions marked.
    """
    program = schedule.get(rank, [])
    n = next((i for i, a in enumerate(program) if a.kind in _UPDATES), len(program))
    late = [(rank, i) for i in range(n, len(program)) if program[i].kind not in _UPDATES]
    if late:
        raise ValidationError(
            f"rank {rank}: program has actions after its first AR/OPT (the step's AR, step point "
            "and OPT must come after every other action)\n" + format_grid(schedule, late)
        )
    return n


def point_of(tail: Sequence[Action], on_nonfinite: str, rank: int) -> ActionKind:
    """The step point a program's ``tail`` (its actions from :func:`step_point` on) holds, or
    the one of ``on_nonfinite`` where it holds none (a rank beyond the plan).

    Raises:
        ValidationError: the program's step point is not the one of ``on_nonfinite``.
    """
    want = step_point_kind(on_nonfinite)
    held = next((a.kind for a in tail if a.kind in STEP_POINTS), want)
    if held is not want:
        raise ValidationError(
            f"rank {rank}: the program's step point is {held.value} but on_nonfinite "
            f"{on_nonfinite!r} runs {want.value} (lower the plan with on_nonfinite="
            f"{on_nonfinite!r})"
        )
    return held
