"""ZB-H1, the memory-efficient handcrafted zero-bubble schedule (Qi et al., ICLR 2024, section 2.1).

Index conventions: S stages (one per rank), M micro-batches, m in [0, M). The backward is split
into ``I`` (gradient of the stage input; Qi et al.'s B) and ``W`` (gradients of the parameters).

Stage i follows 1F1B - ``min(S-i-1, M)`` warm-up forwards, then one forward and one ``I`` per
step, then the remaining ``I``s - but delays the weight gradients: after ``I_m`` it runs
``W_{m-i}`` when m >= i, and the last i ``W``s close the schedule. Every stage thus keeps at
most S micro-batches between their F and W, which is what 1F1B keeps on stage 0 (the peak
memory of 1F1B), and the delayed ``W``s fill the drain bubbles: with T_F = T_I = T_W and free
communication the step takes ``3M + S - 1`` units instead of 1F1B's ``3(M + S - 1)``, a third
of the bubble.

Cost: the replay of this order (:func:`~dapple.schedule.replay.replayed_step_ms`), which for
equal stages with T_F = T_I = T_W and free communication is section 2.1's ``3M + S - 1`` units
and otherwise takes the W passes that do not fit their bubbles, uneven stages and the transfers
as they fall. Memory: every stage holds ``min(S, M)`` micro-batches from F to W.
"""

from __future__ import annotations

from dapple.errors import ValidationError
from dapple.schedule.fill_drain import check_counts
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.replay import replayed_step_ms
from dapple.schedule.spec import ScheduleSpec, Shape

__all__ = ["SCHEDULE", "zbh1"]

F, BI, BW = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def zbh1(S: int, M: int) -> ComputeOrder:
    """The ZB-H1 compute order (module docstring).

    Returns:
        stage -> ordered F/I/W actions.

    Raises:
        ValidationError: S or M below 1.
    """
    if S < 1 or M < 1:
        raise ValidationError(
            f"ZB-H1 needs S >= 1 stages and M >= 1 micro-batches, got S={S}, M={M}"
        )
    order: ComputeOrder = {}
    for i in range(S):
        warm = min(S - i - 1, M)
        acts = [Action(i, F, m) for m in range(warm)]
        w_next = 0
        for m in range(M):
            if warm + m < M:
                acts.append(Action(i, F, warm + m))
            acts.append(Action(i, BI, m))
            if m >= i:
                acts.append(Action(i, BW, w_next))
                w_next += 1
        acts += [Action(i, BW, m) for m in range(w_next, M)]
        order[i] = acts
    return order


def _in_flight(shape: Shape) -> list[int]:
    """K_i = min(S, M) on every stage (from F to W)."""
    check_counts(shape.P, shape.M)
    return [min(shape.P, shape.M)] * shape.P


SCHEDULE = ScheduleSpec(
    name="zbh1",
    title="ZB-H1",
    order=lambda shape: zbh1(shape.P, shape.M),
    in_flight=_in_flight,
    step_ms=replayed_step_ms,
    split_backward=True,
    module=__name__,
)
"""ZB-H1: the backward split into I and W (runtime), its order replayed for the step, K_i =
min(S, M)."""
