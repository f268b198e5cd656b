"""DAPPLE early backward scheduling (paper section 4.2, policies of section 6.3): 1F1B.

Index conventions: S stages (one per rank), M micro-batches, stage i in [0, S), micro-batch m
in [0, M). Stage i warms up with K_i forwards, then alternates one backward and one forward,
then drains the remaining backwards; K_i (policy A ``min(S-i, D)``, policy B
``min(2(S-i)-1, D)``) is also how many micro-batches' activations it holds at most.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.errors import ValidationError
from dapple.schedule.fill_drain import SCHEDULE as GPIPE
from dapple.schedule.fill_drain import check_counts
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.spec import POLICIES, ScheduleSpec

__all__ = ["SCHEDULE", "dapple", "early_backward_order", "warmup_counts"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def warmup_counts(
    S: int, M: int, policy: str = "A", D: int | Sequence[int | None] | None = None
) -> list[int]:
    """K_i per stage: policy A ``min(S-i, D)``, policy B ``min(2(S-i)-1, D)``, never above M.

    ``D`` is how many micro-batches' activations fit on a device (one value, one per stage, or
    None for unbounded). K is additionally made non-increasing along the pipeline: a stage
    that warms up with more forwards than its predecessor would wait for a micro-batch the
    predecessor only sends after a backward it cannot get, i.e. deadlock.

    A stage s whose own D_s holds it below its count (``K_s = D_s < min(S-s, M)``, or policy
    B's) shares its D_s slots with the S - s stages from it to the end in proportion: a later
    stage t keeps at most ``ceil(D_s (S-t) / (S-s))``. Were every later stage to keep D_s
    until its own count fell below it, two stages u < t of equal counts would close a cycle
    of the early-backward order (u's ``B_m`` then ``F_{m+K_u}``, t's ``F_j`` then
    ``B_{j-K_t+1}``) that advances one micro-batch per round trip between them
    (:func:`dapple.cost.latency.steady_periods`): 8 equal stages (F 1, B 2) with D_0 = 4 and
    M = 32 take 453 that way and 210 with the share. Rounding up keeps each stage's own round trip over its
    K_t near the bound's; neighbours may still share a count. Unbounded plans keep S - i
    (2(S-i)-1).
    """
    check_counts(S, M)
    if policy not in POLICIES:
        raise ValidationError(f"policy must be 'A' or 'B', got {policy!r}")
    d_list: list[int | None] = list(D) if isinstance(D, Sequence) else [D] * S
    if len(d_list) != S:
        raise ValidationError(f"D must give one value per stage ({S}), got {len(d_list)}")
    ks: list[int] = []
    share: tuple[int, int] | None = None  # (D_s, S - s) of the least D_s / (S - s) that binds
    for i in range(S):
        left = S - i
        own = min(left if policy == "A" else 2 * left - 1, M)
        k = own
        d = d_list[i]
        if d is not None:
            if d < 1:
                raise ValidationError(f"D for stage {i} must be >= 1, got {d}")
            k = min(k, d)
        if ks:
            k = min(k, ks[-1])
        if share is not None:
            k = min(k, -(-share[0] * left // share[1]))  # ceil
        ks.append(k)
        if k == d and k < own and (share is None or k * share[1] < share[0] * left):
            share = (k, left)  # held below by its own D
    return ks


def dapple(
    S: int, M: int, policy: str = "A", D: int | Sequence[int | None] | None = None
) -> ComputeOrder:
    """DAPPLE early backward: K_i forwards, then strictly one backward and one forward, then the
    remaining backwards (section 4.2). After B_m comes F_{m+K_i}."""
    return early_backward_order(warmup_counts(S, M, policy, D), M)


def early_backward_order(ks: Sequence[int], M: int) -> ComputeOrder:
    """Stage i's K_i = ``ks[i]`` forwards, then B_m followed by F_{m+K_i} (section 4.2)."""
    order: ComputeOrder = {}
    for i, k in enumerate(ks):
        acts = [Action(i, F, m) for m in range(k)]
        for m in range(M):
            acts.append(Action(i, B, m))
            if m + k < M:
                acts.append(Action(i, F, m + k))
        order[i] = acts
    return order


SCHEDULE = ScheduleSpec(
    name="dapple",
    title="DAPPLE (policy {policy})",
    label="dapple/{policy}",
    order=lambda shape: dapple(shape.P, shape.M, shape.policy, shape.D),
    in_flight=lambda shape: warmup_counts(shape.P, shape.M, shape.policy, shape.D),
    bounded=True,
    policies=POLICIES,
    variants=(("A", 1), ("B", 1)),
    compare_with=GPIPE.name,
    module=__name__,
)
"""DAPPLE: K_i bounded by each stage's D, policies A and B; costed by L (section 5.1)."""
