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

Cost (section 2.1): ``L = M max_s (F_s + I_s + W_s) + (S-1) max(0, max_s (F_s + I_s - W_s))``
plus what fill and drain pay once (:attr:`~dapple.schedule.spec.StepTerms.fixed_ms`); with
uneven stages an estimate (W passes may not fit their bubbles when W > F; the simulator is the
reference). Memory: every stage holds ``min(S, M)`` micro-batches from F to W.
"""

from __future__ import annotations

from dapple.errors import ValidationError
from dapple.schedule.fill_drain import check_counts
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.spec import ScheduleSpec, Shape, StepTerms

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


def _step_ms(t: StepTerms) -> float:
    """The ZB-H1 step (module docstring), over the slowest replica's F, I and W of each stage."""
    per: list[float] = []
    bubble = 0.0
    for st in t.stages:
        f, i, w = st.forward_ms, st.input_grad_ms, st.weight_grad_ms
        per.append(f + i + w)
        bubble = max(bubble, f + i - w)
    return t.M * max(per) + (len(t.stages) - 1) * bubble + t.fixed_ms


SCHEDULE = ScheduleSpec(
    name="zbh1",
    title="ZB-H1",
    order=lambda shape: zbh1(shape.P, shape.M),
    in_flight=_in_flight,
    step_ms=_step_ms,
    split_backward=True,
    module=__name__,
)
"""ZB-H1: the backward split into I and W (runtime), its own step rule, K_i = min(S, M)."""
