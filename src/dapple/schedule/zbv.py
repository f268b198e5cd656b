"""ZB-V, the memory-efficient zero-bubble schedule with two chunks per rank in a V (Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024, section 6; torch.distributed.pipelining's
``ScheduleZBVZeroBubble``).

Index conventions: P pipeline ranks (device groups), S = 2P virtual stages (chunks) in pipeline
order, M micro-batches, m in [0, M). Rank g holds chunk 0 = stage g and chunk 1 = stage
2P-1-g (:func:`v_group`): the forward runs down the ranks through the first chunks and back up
through the second, so rank 0 holds the first and the last stage and rank P-1 hands its chunk 0
output to its own chunk 1 (a message to itself: no link, :func:`dapple.cost.comm.transfer_ms`
is 0). The backward is split into ``I`` and ``W`` as in ZB-H1 (:mod:`dapple.schedule.zerobubble`).

The order of rank g (section 6, figure "ZB-V"), built for n = max(M, 2P-1) micro-batches so that
the V fills, then left without the actions of micro-batches >= M (dropping a micro-batch drops
nothing another one waits for):

1. warm-up: 2(P-g)-1 forwards of chunk 0; g times ``F`` chunk 1, ``F`` chunk 0; P-g times
   ``F I W`` of chunk 1;
2. steady: ``F I W`` of chunk 0 (its F while micro-batches are left), then ``F I W`` of chunk 1,
   until every forward ran;
3. cool-down: g times ``I`` chunk 0, ``I`` chunk 1 (their ``W`` deferred); P-g times ``I`` chunk 0
   and the oldest deferred ``W`` of chunk 0; then the deferred ``W`` of chunk 1, then of chunk 0.

This is ``ScheduleZBVZeroBubble``'s order action for action
(``tests/test_v_orders_match_torch.py``).

Memory (section 6): a rank holds at most 2P chunk-micro-batches from F to W, half a stage each:
the activations of 1F1B's stage 0, on every rank alike. Cost: the replay of this order
(:func:`~dapple.schedule.replay.replayed_step_ms`); section 6 gives ZB-V's near-zero bubble for
equal chunks with F = I = W and free communication (``6M + P - 1`` units, which the replay
reproduces), and the replay takes uneven chunks and the transfers as they fall.

Limits: exactly two chunks per device group (S = 2P), at least two device groups of at least
two layers each (no divisibility: a group of an odd count is cut ceil/floor, :func:`v_shape`),
and no per-micro-batch ZeRO-3 re-gather (the split backward's W needs what its I gathered).
"""

from __future__ import annotations

import dataclasses

from dapple.core.plan import Plan, StagePlan
from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.replay import replayed_step_ms
from dapple.schedule.spec import ScheduleSpec

__all__ = ["SCHEDULE", "v_group", "v_shape", "zbv"]

F, BI, BW = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
CHUNKS = 2
"""Chunks per rank: the two arms of the V."""


def v_group(k: int, P: int, v: int) -> int:
    """The rank of virtual stage k in the V: k down the first arm, 2P-1-k up the second."""
    return k if k < P else 2 * P - 1 - k


def _check(P: int, M: int, v: int) -> None:
    if P < 2 or M < 1 or v != CHUNKS:
        raise ValidationError(
            f"ZB-V needs P >= 2 device groups, M >= 1 micro-batches and exactly {CHUNKS} chunks "
            f"per group (chunk count = {CHUNKS} x ranks), got P={P}, M={M}, v={v}"
        )


class _Rank:
    """The actions of one rank in order, with its per-chunk counts (module docstring)."""

    def __init__(self, g: int, P: int, n: int) -> None:
        self.stage = (g, 2 * P - 1 - g)
        self.n = n
        self.acts: list[Action] = []
        self.count = {(kind, c): 0 for kind in (F, BI, BW) for c in (0, 1)}

    def run(self, c: int, *kinds: ActionKind) -> None:
        for kind in kinds:
            m = self.count[(kind, c)]
            self.acts.append(Action(self.stage[c], kind, m))
            self.count[(kind, c)] = m + 1

    def left(self, kind: ActionKind, c: int) -> int:
        """How many of chunk c's ``kind`` actions are still to come."""
        return self.n - self.count[(kind, c)]


def _rank_order(g: int, P: int, n: int) -> list[Action]:
    """Rank g's order for n micro-batches (the three phases of the module docstring)."""
    r = _Rank(g, P, n)
    for _ in range(2 * (P - g) - 1):
        r.run(0, F)
    for _ in range(g):
        r.run(1, F)
        r.run(0, F)
    for _ in range(P - g):
        r.run(1, F, BI, BW)
    while r.left(F, 0) or r.left(F, 1):
        if r.left(F, 0):
            r.run(0, F)
        r.run(0, BI, BW)
        r.run(1, F, BI, BW)
    for _ in range(g):
        r.run(0, BI)
        r.run(1, BI)
    for _ in range(P - g):
        r.run(0, BI, BW)
    for c in (1, 0):
        while r.left(BW, c):
            r.run(c, BW)
    return r.acts


def zbv(P: int, M: int, v: int = CHUNKS) -> ComputeOrder:
    """The ZB-V compute order of P ranks (module docstring).

    Returns:
        rank -> ordered F/I/W actions whose ``stage`` is the virtual stage (g or 2P-1-g).

    Raises:
        ValidationError: P below 2, M below 1, or v other than 2.
    """
    _check(P, M, v)
    n = max(M, 2 * P - 1)
    return {
        g: [a for a in _rank_order(g, P, n) if a.micro_batch is not None and a.micro_batch < M]
        for g in range(P)
    }


def v_shape(plan: Plan, v: int = CHUNKS, *, title: str = "ZB-V", name: str = "zbv") -> Plan:
    """``plan`` run as a V schedule (ZB-V by default): device group g of ``plan`` (its stage g,
    ``n_g`` layers) keeps its ``n_g`` layers as two chunks, stages g and 2P-1-g of the V.

    The chain is cut in pipeline order: stages 0..P-1 take the first ``ceil(n_g / 2)`` layers
    of groups 0..P-1, stages P..2P-1 the remaining ``floor(n_g / 2)`` of groups P-1..0, so every
    group keeps its share of the model and its replication. What the V needs of the layer
    counts is that: every group at least two layers (N >= 2P in all); odd counts, per group or
    in all, are cut unevenly.

    Args:
        plan: a plan with one stage per device group (``virtual_stages == 1``).
        v: chunks per group; 2 (1 is taken to mean the default, 2).
        title: the schedule's name in the refusals (``DualPipeV`` for
            :mod:`dapple.schedule.dualpipev`, which cuts the same V).
        name: the schedule the plan is put under.

    Raises:
        ValidationError: ``plan`` is already chunked, fewer than two device groups, v other
            than 1 or 2, or a group of fewer than two layers (naming it).
    """
    if v not in (1, CHUNKS):
        raise ValidationError(
            f"{title} holds exactly {CHUNKS} chunks per device group (chunk count = {CHUNKS} x "
            f"ranks), got v={v}"
        )
    if plan.virtual_stages != 1:
        raise ValidationError(f"{title}: the plan already has virtual_stages={plan.virtual_stages}")
    P = plan.num_stages
    if P < 2:
        raise ValidationError(
            f"{title} needs at least 2 device groups (a V over ranks), got {P} (replication "
            f"{plan.replication})"
        )
    counts = [st.layers[1] - st.layers[0] for st in plan.stages]
    for g, (st, n) in enumerate(zip(plan.stages, counts, strict=True)):
        if n < CHUNKS:
            raise ValidationError(
                f"{title} cuts each device group into {CHUNKS} chunks (a V over {P} groups: "
                f"{CHUNKS * P} chunks of at least one layer), but stage {g} (devices "
                f"{list(st.devices)}) has {n} layer(s) {list(st.layers)}"
            )
    arms = [[(g, (n + 1) // 2) for g, n in enumerate(counts)]]
    arms.append([(g, counts[g] // 2) for g in reversed(range(P))])
    stages: list[StagePlan] = []
    start = 0
    for g, n in arms[0] + arms[1]:
        stages.append(dataclasses.replace(plan.stages[g], layers=(start, start + n)))
        start += n
    return dataclasses.replace(plan, stages=tuple(stages), schedule=name, virtual_stages=CHUNKS)


def _check_plan(plan: Plan) -> None:
    """Two chunks per device group, at least two groups (section 6: a V over ranks).

    Raises:
        ValidationError: naming v and the device groups.
    """
    _check(plan.num_groups, plan.num_micro_batches, plan.virtual_stages)


SCHEDULE = ScheduleSpec(
    name="zbv",
    title="ZB-V",
    order=lambda shape: zbv(shape.P, shape.M, shape.v),
    step_ms=replayed_step_ms,
    variants=(("A", CHUNKS),),
    split_backward=True,
    chunks=True,
    chunk_count=CHUNKS,
    placement=v_group,
    cut=v_shape,
    check=_check_plan,
    module=__name__,
)
"""ZB-V: two chunks per device group in a V, the split backward, its own step rule."""
