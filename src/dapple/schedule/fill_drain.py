"""GPipe (Huang et al., NeurIPS 2019; paper section 4.1): every stage runs all M forwards, then
all M backwards, in micro-batch order.

Index conventions: S stages (one per rank), M micro-batches, stage i in [0, S), micro-batch m in
[0, M). Every stage holds all M micro-batches' activations before its first backward (K_i = M);
the cost model's L takes the steady phase as unbounded by them.
"""

from __future__ import annotations

from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.spec import ScheduleSpec, Shape

__all__ = ["SCHEDULE", "check_counts", "gpipe"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def check_counts(S: int, M: int) -> None:
    """Refuse S < 1 stages or M < 1 micro-batches.

    Raises:
        ValidationError: naming S and M.
    """
    if S < 1 or M < 1:
        raise ValidationError(
            f"schedules need S >= 1 stages and M >= 1 micro-batches, got S={S}, M={M}"
        )


def gpipe(S: int, M: int) -> ComputeOrder:
    """GPipe: every stage runs all M forwards, then all M backwards (in micro-batch order)."""
    check_counts(S, M)
    return {
        i: [Action(i, F, m) for m in range(M)] + [Action(i, B, m) for m in range(M)]
        for i in range(S)
    }


def _in_flight(shape: Shape) -> list[int]:
    """K_i = M on every stage: every forward runs before the first backward."""
    check_counts(shape.P, shape.M)
    return [shape.M] * shape.P


SCHEDULE = ScheduleSpec(
    name="gpipe",
    title="GPipe",
    order=lambda shape: gpipe(shape.P, shape.M),
    in_flight=_in_flight,
    baseline=True,
    module=__name__,
)
"""GPipe: all forwards first; costed by L with K_i = M (section 5.1)."""
