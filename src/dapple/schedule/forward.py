"""Forward-only programs: evaluation through the training pipeline, without B, AR or OPT.

Evaluation runs the plan's stages, replicas and split-concat transfers exactly as training does
(:func:`dapple.schedule.lower.lower`), but every stage only runs ``F_m`` for m in [0, M), in
micro-batch order, so each device's program is ``RECV_F* F SEND_F*`` per micro-batch. No
activations are kept for a backward pass, so the micro-batch order needs no warm-up bound
(``K_i``): a stage forwards micro-batch m as soon as its inputs arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.core.plan import Plan
from dapple.schedule.ir import Action, ActionKind, ComputeOrder, Schedule
from dapple.schedule.lower import lower

__all__ = ["forward_order", "lower_forward"]

K = ActionKind
_FORWARD_KINDS = (K.RECV_F, K.FORWARD, K.SEND_F)


def forward_order(
    S: int, M: int, groups: int | None = None, placement: Sequence[Sequence[int]] | None = None
) -> ComputeOrder:
    """Every stage forwards micro-batches 0..M-1 in order (S stages, M micro-batches).

    With ``groups`` = P < S each group runs its stages one after the other, all micro-batches
    of a chunk before the next chunk: a chunk's inputs come from earlier chunks only, so nothing
    waits in a cycle. ``placement[g]`` lists group g's stages in pipeline order (default: round
    robin, g, g+P, ...; ZB-V: g and 2P-1-g)."""
    P = S if groups is None else groups
    held = placement if placement is not None else [range(g, S, P) for g in range(P)]
    return {g: [Action(s, K.FORWARD, m) for s in held[g] for m in range(M)] for g in range(P)}


def lower_forward(plan: Plan) -> Schedule:
    """Each device's forward-only program for ``plan``: ``RECV_F``, ``F`` and ``SEND_F`` actions.

    Returns:
        device id -> ordered actions (empty for a replica whose micro-batch slice is empty).
    """
    P = plan.num_groups
    placement = [plan.stages_of_group(g) for g in range(P)]
    order = forward_order(plan.num_stages, plan.num_micro_batches, P, placement)
    full = lower(plan, order)
    return {dev: [a for a in prog if a.kind in _FORWARD_KINDS] for dev, prog in full.items()}
