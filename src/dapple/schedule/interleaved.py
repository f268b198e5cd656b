"""Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2; Megatron-LM's interleaved schedule).

Index conventions: P pipeline ranks (device groups), v model chunks per rank, S = P·v virtual
stages; virtual stage k runs on rank k mod P, so rank g holds stages g, g+P, ..., g+(v-1)P
(round-robin placement). M micro-batches, m in [0, M); M must be a multiple of P.

Each rank runs M·v forwards and M·v backwards. Its n-th forward (n in [0, M·v)) is of chunk
``(n // P) mod v`` and micro-batch ``(n // (P·v))·P + n mod P``: groups of P micro-batches go
through chunk 0, then chunk 1, ... (depth first). Its n-th backward walks the chunks in
reverse, ``v - 1 - (n // P) mod v``, over the same micro-batches. Rank g warms up with
``min((P-g-1)·2 + (v-1)·P, M·v)`` forwards, then alternates one forward and one backward, then
drains the remaining backwards. With v = 1 the warm-up is DAPPLE's policy B minus the first
steady forward (K_g = 2(P-g)-1).

Cost: the replay of this order (:func:`~dapple.schedule.replay.replayed_step_ms`). For equal
chunks and free communication it is section 2.2.2's ``(M + (P-1)/v) T`` (T a group's F + B of
its chunks for one micro-batch); the replay also takes uneven chunks, which stall each other
beyond that bubble, and the transfers: every chunk boundary is crossed once per micro-batch, so
a slow link costs in the steady state, not only in fill and drain.
"""

from __future__ import annotations

from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.replay import replayed_step_ms
from dapple.schedule.spec import ScheduleSpec

__all__ = ["SCHEDULE", "interleaved", "interleaved_warmup"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def _check(P: int, M: int, v: int) -> None:
    if P < 1 or M < 1 or v < 1:
        raise ValidationError(
            f"interleaved 1F1B needs P >= 1 ranks, M >= 1 micro-batches and v >= 1 chunks, "
            f"got P={P}, M={M}, v={v}"
        )
    if M % P:
        raise ValidationError(
            f"interleaved 1F1B needs the micro-batches M={M} to be a multiple of the pipeline "
            f"ranks P={P} (it cycles the chunks every P micro-batches)"
        )


def interleaved_warmup(P: int, M: int, v: int) -> list[int]:
    """Forwards each rank runs before its first backward: ``min(2(P-g-1) + (v-1)P, M·v)``.

    Raises:
        ValidationError: P, M or v below 1, or M not a multiple of P.
    """
    _check(P, M, v)
    return [min(2 * (P - g - 1) + (v - 1) * P, M * v) for g in range(P)]


def _chunk_mb(n: int, P: int, v: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's n-th forward or backward."""
    c = (n // P) % v
    return (v - 1 - c if backward else c), (n // (P * v)) * P + n % P


def interleaved(P: int, M: int, v: int) -> ComputeOrder:
    """The interleaved 1F1B compute order of P ranks with v chunks each (module docstring).

    Returns:
        rank -> ordered F/B actions whose ``stage`` is the virtual stage ``chunk·P + rank``.

    Raises:
        ValidationError: P, M or v below 1, or M not a multiple of P.
    """
    warm = interleaved_warmup(P, M, v)
    total = M * v
    order: ComputeOrder = {}
    for g, w in enumerate(warm):

        def act(kind: ActionKind, n: int, g: int = g) -> Action:
            c, m = _chunk_mb(n, P, v, kind is B)
            return Action(c * P + g, kind, m)

        acts = [act(F, n) for n in range(w)]
        for n in range(total - w):
            acts += [act(F, w + n), act(B, n)]
        acts += [act(B, n) for n in range(total - w, total)]
        order[g] = acts
    return order


def _check_plan(plan: Plan) -> None:
    """M a multiple of the device groups (the chunks cycle every P micro-batches).

    Raises:
        ValidationError: naming M and the device groups.
    """
    if plan.num_micro_batches % plan.num_groups:
        raise ValidationError(
            f"interleaved 1F1B needs M={plan.num_micro_batches} to be a multiple of the "
            f"{plan.num_groups} device groups of the plan"
        )


SCHEDULE = ScheduleSpec(
    name="interleaved",
    title="interleaved 1F1B (v={v})",
    label="interleaved v={v}",
    order=lambda shape: interleaved(shape.P, shape.M, shape.v),
    step_ms=replayed_step_ms,
    variants=(("A", 2), ("A", 4)),
    chunks=True,
    check=_check_plan,
    module=__name__,
)
"""Interleaved 1F1B: v chunks per device group, its order replayed for the step (no per-stage
K_i)."""
