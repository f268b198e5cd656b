"""DualPipeV: DeepSeek-V3's DualPipe cut in half, on ZB-V's V (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, section 3.2.1; torch.distributed.pipelining's ``ScheduleDualPipeV``).

Index conventions as in :mod:`dapple.schedule.zbv`: P ranks, S = 2P virtual stages, rank g holds
chunk 0 = stage g and chunk 1 = stage 2P-1-g (:func:`~dapple.schedule.zbv.v_group`), M >= 2P
micro-batches. Backwards are whole (``B``) where a forward overlaps them and split (``I`` then
``W``, the ``W`` queued and run where a bubble would be) at the ends, as section 3.2.1 does.

The order of rank g, in eight phases (``F0``: a forward of chunk 0, ``F1 + B0``: a forward of
chunk 1 beside a backward of chunk 0, DualPipe's overlapped pair):

1. 2(P-g-1) times ``F0``;
2. g+1 times ``F0 F1``;
3. P-g-1 times ``I1``, the oldest queued ``W``, ``F1``;
4. M-2P+g+1 times ``F0 + B1``, ``F1 + B0`` (rank P-1's first pair not overlapped);
5. P-g-1 times ``B1``, ``F1 + B0``;
6. g+1 times a backward of chunk 1 then of chunk 0, whole in the first half of the phase and
   ``I`` (its ``W`` queued) from its middle on;
7. P-g-1 times the oldest queued ``W`` and a backward of chunk 0 (as phase 6 ended);
8. the queued ``W``s.

This is ``ScheduleDualPipeV``'s order action for action, its overlapped pairs taken in their
sub-actions' order (``tests/test_v_orders_match_torch.py``).

dapple's runtime runs one action at a time: an overlapped pair runs its forward, then its
backward, and what DualPipe hides of one behind the other (above all the communication of
expert parallelism) is not hidden here. The step is therefore the replay of this order as dapple
runs it (:func:`~dapple.schedule.replay.replayed_step_ms`), not section 3.2.1's Table 2 (DualPipe's
bubble ``(PP/2 - 1)(F&B + B - 3W)``, F&B an overlapped pair's time). Memory: one chunk
micro-batch more than ZB-V at the peak (section 3.2.1: PP + 1 for DualPipe), replayed by the
cost model.

Limits: exactly two chunks per device group, P >= 2 groups of at least two layers each (any
count, odd ones cut ceil/floor as ZB-V's), M >= 2P (every rank's phase 4 runs once), no
per-micro-batch ZeRO-3 re-gather.
"""

from __future__ import annotations

from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.replay import replayed_step_ms
from dapple.schedule.spec import ScheduleSpec
from dapple.schedule.zbv import CHUNKS, v_group, v_shape

__all__ = ["SCHEDULE", "dualpipev"]

F, B, BI, BW = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


def _check(P: int, M: int, v: int) -> None:
    if P < 2 or v != CHUNKS or M < 2 * P:
        raise ValidationError(
            f"DualPipeV needs P >= 2 device groups, exactly {CHUNKS} chunks per group (chunk "
            f"count = {CHUNKS} x ranks) and M >= 2P = {2 * P} micro-batches, got P={P}, M={M}, "
            f"v={v}"
        )


class _Rank:
    """Rank g's actions in order: per chunk the next forward and backward micro-batch, and the
    queue of ``W``s its ``I``s left."""

    def __init__(self, g: int, P: int) -> None:
        self.stage = (g, 2 * P - 1 - g)
        self.acts: list[Action] = []
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.weights: list[Action] = []

    def forward(self, c: int) -> None:
        self.acts.append(Action(self.stage[c], F, self.next_f[c]))
        self.next_f[c] += 1

    def backward(self, c: int, split: bool = False) -> None:
        m = self.next_b[c]
        self.next_b[c] += 1
        self.acts.append(Action(self.stage[c], BI if split else B, m))
        if split:
            self.weights.append(Action(self.stage[c], BW, m))

    def weight(self) -> None:
        if self.weights:
            self.acts.append(self.weights.pop(0))

    def pair(self, f: int, b: int) -> None:
        """DualPipe's overlapped forward and backward, one after the other."""
        self.forward(f)
        self.backward(b)


def _rank_order(g: int, P: int, M: int) -> list[Action]:
    """Rank g's order (the eight phases of the module docstring)."""
    r = _Rank(g, P)
    for _ in range(2 * (P - g - 1)):
        r.forward(0)
    for _ in range(g + 1):
        r.forward(0)
        r.forward(1)
    for _ in range(P - g - 1):
        r.backward(1, split=True)
        r.weight()
        r.forward(1)
    for _ in range(M - 2 * P + g + 1):
        r.pair(0, 1)
        r.pair(1, 0)
    for _ in range(P - g - 1):
        r.backward(1)
        r.pair(1, 0)
    split = False
    half = (g + 1) // 2
    for i in range(g + 1):
        split = split or (i == half and g % 2 == 1)
        r.backward(1, split)
        split = split or (i == half and g % 2 == 0)
        r.backward(0, split)
    for _ in range(P - g - 1):
        r.weight()
        r.backward(0, split)
    while r.weights:
        r.weight()
    return r.acts


def dualpipev(P: int, M: int, v: int = CHUNKS) -> ComputeOrder:
    """The DualPipeV compute order of P ranks (module docstring).

    Returns:
        rank -> ordered F/B/I/W actions whose ``stage`` is the virtual stage (g or 2P-1-g).

    Raises:
        ValidationError: P below 2, v other than 2, or M below 2P.
    """
    _check(P, M, v)
    return {g: _rank_order(g, P, M) for g in range(P)}


def _v_shape(plan: Plan, v: int) -> Plan:
    """ZB-V's V (:func:`~dapple.schedule.zbv.v_shape`) under this schedule, refusing in its
    name."""
    return v_shape(plan, v, title="DualPipeV", name="dualpipev")


def _check_plan(plan: Plan) -> None:
    """Two chunks per device group, at least two groups, M >= 2P.

    Raises:
        ValidationError: naming P, M and v.
    """
    _check(plan.num_groups, plan.num_micro_batches, plan.virtual_stages)


SCHEDULE = ScheduleSpec(
    name="dualpipev",
    title="DualPipeV",
    order=lambda shape: dualpipev(shape.P, shape.M, shape.v),
    step_ms=replayed_step_ms,
    variants=(("A", CHUNKS),),
    split_backward=True,
    chunks=True,
    chunk_count=CHUNKS,
    placement=v_group,
    cut=_v_shape,
    check=_check_plan,
    module=__name__,
)
"""DualPipeV: ZB-V's V, whole backwards beside forwards and split ones at the ends."""
