"""Forward-only programs: evaluation through the training pipeline, without B, AR or OPT.

Evaluation runs the plan's stages, replicas and split-concat transfers exactly as training does
(:func:`dapple.schedule.lower.lower`), but every stage only runs ``F_m`` for m in [0, M), in
micro-batch order, so each device's program is ``RECV_F* F SEND_F*`` per micro-batch. No
activations are kept for a backward pass, so the micro-batch order needs no warm-up bound
(``K_i``): a stage forwards micro-batch m as soon as its inputs arrive.
"""

from __future__ import annotations

from dapple.core.plan import Plan
from dapple.schedule.ir import Action, ActionKind, ComputeOrder, Schedule
from dapple.schedule.lower import lower

__all__ = ["forward_order", "lower_forward"]

K = ActionKind
_FORWARD_KINDS = (K.RECV_F, K.FORWARD, K.SEND_F)


def forward_order(S: int, M: int) -> ComputeOrder:
    """Every stage forwards micro-batches 0..M-1 in order (S stages, M micro-batches)."""
    return {s: [Action(s, K.FORWARD, m) for m in range(M)] for s in range(S)}


def lower_forward(plan: Plan) -> Schedule:
    """Each device's forward-only program for ``plan``: ``RECV_F``, ``F`` and ``SEND_F`` actions.

    Returns:
        device id -> ordered actions (empty for a replica whose micro-batch slice is empty).
    """
    full = lower(plan, forward_order(plan.num_stages, plan.num_micro_batches))
    return {dev: [a for a in prog if a.kind in _FORWARD_KINDS] for dev, prog in full.items()}
