"""Pipeline latency L (paper section 5.1, equations 1-3) over per-stage arrays.

The one kernel of the cost model: :func:`dapple.cost.terms.pipeline_terms` assembles the
arrays (for a :class:`~dapple.core.plan.Plan` and for the planner's
:class:`~dapple.planner.scorer.Scorer` alike) and :meth:`PipelineTerms.latency
<dapple.cost.terms.PipelineTerms.latency>` calls :func:`latency`. Pure, no torch.

Notation: S stages *including* the communication stages between computation stages (index
s in [0, S)), M micro-batches, F_s/B_s forward/backward time of stage s for one micro-batch,
AR_s the AllReduce AR(P_s, g_s) of stage s's gradients (0 for comm stages), K_s the
micro-batches stage s may keep in flight, Q the pivot stage (equation 3).

How :func:`latency` computes L from its arguments (``period``, ``paced``, ``K``).

Equation 3 picks the pivot scanning s = S-1 .. 0: s replaces Q when its bubble-free steady
phase ``T_st^s = (M-1) period_s`` exceeds ``T_st^Q`` plus the F + B of the stages strictly
between. A stage paced by a cycle of its in-flight limit (``paced``) replaces Q as soon
as ``T_st^s`` exceeds ``T_st^Q``: its cycle
already runs through the stages after it, and it admits micro-batches no faster than
``period_s`` into every one of them, Q included (``benchmarks/moe.md``: a 15-stage plan
whose second stage's cycle paced the step at 51.4 ms per micro-batch against the last
stage's 49.3).

Equation 1: ``T_w = sum_{s<=Q} F_s`` and ``T_s = (M-1) period_Q``.

Ending phase: at the end of T_s the pivot has run its last forward; the last micro-batch
still goes forward through stages Q+1..S-1 and back (the "tail"), then stage s finishes its
last backward and all-reduces. Stage s <= Q ends at ``tail_F + tail_B + sum_{a=s}^{Q} B_a +
AR_s``, stage s > Q at ``tail_F + sum_{a=s}^{S-1} B_a + AR_s``. For Q = S-1 (no tail) this
is exactly equation 1 with stage Q in its first branch (so that L >= M (F_Q + B_Q)); for
Q < S-1 equation 1 as printed omits the tail and would under-estimate L.

The tail overlaps the pivot's own work (:func:`pivot_waits`): with K_Q micro-batches in
flight the pivot runs K_Q - 1 backwards after its last forward before the last micro-batch's
gradient is due, and the tail of the first micro-batch overlaps its K_Q - 1 forwards after
the first. Where the pivot keeps its own pace (``period_Q = F_Q + B_Q``) the stages up to Q
are charged the waits those leave instead of the tail. The pivot then sends its last
k - 1 = min(K_Q, M) - 1 gradients upstream B_Q apart, and a stage s < Q behind a slower
backward ``b = max_{s <= a < Q} B_a > B_Q`` (computation stages) queues them: through a
chain of stages, n equal jobs leave after ``sum B_a + (n - 1) max B_a``, so stage s
ends at ``sum_{a=s}^{Q} B_a + AR_s + max(last wait, first wait + (k-1)(b - B_Q))`` past
the reference point.

Equation 2: ``L = T_w + T_s + T_e``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CYCLE_REACH",
    "TIE",
    "Latency",
    "backward_phases",
    "cycle_paced",
    "latency",
    "longest_laps",
    "pivot_waits",
    "steady_periods",
    "turn_waits",
]


class Latency(NamedTuple):
    """L = T_w + T_s + T_e (equation 2) and the pivot Q."""

    L_ms: float
    T_w_ms: float
    """Warm-up phase: the first micro-batch's forwards up to the pivot."""
    T_s_ms: float
    """Steady phase: ``(M - 1) period_Q``."""
    T_e_ms: float
    """Ending phase: the last micro-batch's tail, backwards and AllReduces."""
    Q: int
    """Pivot stage index among all S stages (comm stages counted)."""


def steady_periods(
    F: Sequence[float], B: Sequence[float], K: Sequence[int | None], M: int
) -> list[float]:
    """Per-micro-batch steady period of each stage: ``(M - 1) period_s`` is the longest its
    M - 1 micro-batches after the first take, paced by its own F + B or by a cycle of its
    early-backward order through the stages after it.

    The paper's equation 1 uses ``F_s + B_s``, which assumes K_s is large enough. In steady
    state stage s runs ``B_m`` then ``F_{m+K_s}`` (section 4.2), and a stage t after it runs
    ``F_j`` then ``B_{j-K_t+1}``. So ``B_m`` at s, the forwards of ``m + K_s`` down to t, its
    next backward there and the backwards back up to s close a cycle of
    ``RT(s..t) = sum_{a=s}^{t} (F_a + B_a)`` (comm stages between included) that advances
    ``k = K_s - K_t + 1`` micro-batches. Only the M - K_s forwards after the warm-up wait on
    it: the cycle runs ``n = floor((M - 1 - K_s) / k) + 1`` laps (none when M <= K_s), which
    cover ``n k`` micro-batches, and the rest are paced by the stage's own F + B::

        period_s = max(F_s + B_s, RT_s / K_s,
                       max_t (n RT(s..t) + (M - 1 - n k)(F_s + B_s)) / (M - 1)).

    ``RT_s / K_s`` is the cycle through the last stage, one micro-batch's whole round trip
    from stage s's forward to its backward over K_s micro-batches (Little's law, charged to
    all M - 1). A stage t whose K_t equals K_s (a memory bound D that caps several stages
    alike) makes its cycle advance one micro-batch per ``RT(s..t)``.

    Each device sends its activations down and its gradients up through one way out, first
    come first served (the simulator's ports). At a cycle's turning points that costs time the
    sum of F + B does not show (:func:`turn_waits`): stage s runs ``F_{m+K_s}`` right after
    ``B_m``, so its activation leaves once the gradient before it has (``up_s``), and stage t
    runs its backward right after a forward, so its gradient leaves once that activation has
    (``down_t``). Every cycle and the round trip of Little's law carry them:
    ``RT(s..t) + up_s + down_t``.

    Args:
        F: F_s per stage.
        B: B_s per stage.
        K: K_s per stage; None (or 0) leaves the stage unbounded (comm stages, and every
            stage of the GPipe schedule, whose forwards all run before its backwards) and
            makes it no turning point of a cycle.
        M: micro-batches.
    """
    S = len(F)
    fb = [F[s] + B[s] for s in range(S)]
    period = list(fb)
    # rt[s] = RT_s, summed from the last stage up; RT(s..t) = rt[s] - rt[t + 1]
    rt = [0.0] * (S + 1)
    acc = 0.0
    for s in range(S - 1, -1, -1):
        acc += fb[s]
        rt[s] = acc
    up, down = turn_waits(F, B)
    turns = [s for s in range(S) if K[s]]
    for s in turns:
        k = K[s]
        assert k is not None
        period[s] = max(period[s], (rt[s] + up[s]) / k)  # t past the last stage: Little's law
    if M > 1 and len(turns) > 1:
        laps = _longest_laps(turns, K, rt, fb, M, up, down)
        for s, total in zip(turns, laps, strict=True):
            if total > (M - 1) * period[s]:
                period[s] = total / (M - 1)
    return period


def turn_waits(F: Sequence[float], B: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per stage, how long a cycle turning there waits for the stage's own way out
    (:func:`steady_periods`): ``up_s = max(0, B_{s-1} - F_s)``, the gradient just sent up
    through the comm stage before s outlasting the forward after it, and ``down_s = max(0,
    F_{s+1} - B_s)``, the activation just sent down through the comm stage after s outlasting
    the backward after it. Each only where the message that queues takes time on the way out
    (a comm stage of 0 moves nothing, or moves it within the device); 0 at the pipeline's ends
    and at comm stages (``F``/``B`` alternate computation and comm stages from index 0).
    """
    S = len(F)
    up = [0.0] * S
    down = [0.0] * S
    for s in range(2, S - 1, 2):  # computation stages with comm stages on both sides
        if F[s + 1] > 0:
            up[s] = max(0.0, B[s - 1] - F[s])
        if B[s - 1] > 0:
            down[s] = max(0.0, F[s + 1] - B[s])
    return up, down


def cycle_paced(
    F: Sequence[float], B: Sequence[float], K: Sequence[int | None], M: int,
    period: Sequence[float],
) -> list[bool]:  # fmt: skip
    """Per stage, whether a cycle of its in-flight limit paces it (:func:`steady_periods`):
    K_s below M (some forward waits on a backward) and ``period_s`` above ``F_s + B_s``."""
    return [
        k is not None and 0 < k < M and p > f + b
        for f, b, k, p in zip(F, B, K, period, strict=True)
    ]


CYCLE_REACH = 16
"""How many computation stages after s a cycle of :func:`steady_periods` may turn at. Under
DAPPLE's counts (:func:`dapple.schedule.early_backward.warmup_counts`) a run of equal K_t that
long comes from a share D_s / (S - s) below 1/16, and a cycle through such a run is close to
Little's law's RT_s / D_s, which every stage keeps; the reach keeps the planner's work linear
in S (``benchmarks/bounded_latency.md``)."""


TIE = 1e-12
"""How far (relative) :func:`backward_phases` must exceed equations 1-3 to replace them: the
pivot's own backward phase often equals L summed in another order, and a few ulps of it would
move every L."""


SMALL_PIPELINE = 12
"""Up to this many turning stages :func:`_longest_laps` loops in Python (numpy's per-call cost
is larger there); the same operations in the same order, so the same bits."""


def _longest_laps_small(
    turns: list[int], K: Sequence[int | None], rt: list[float], fb: list[float], M: int,
    up: Sequence[float], down: Sequence[float],
) -> list[float]:  # fmt: skip
    """:func:`_longest_laps` in plain Python."""
    n = len(turns)
    longest = [-math.inf] * n
    for i, s in enumerate(turns):
        k = K[s]
        assert k is not None
        if k > M - 1:
            continue
        for t in turns[i + 1 : i + 1 + CYCLE_REACH]:
            kt = K[t]
            assert kt is not None
            step = k - kt + 1
            if step >= 1:
                laps = (M - 1 - k) // step + 1
                cycle = (rt[s] + up[s]) - (rt[t + 1] - down[t])  # numpy's order, its bits
                total = laps * cycle + (M - 1 - laps * step) * fb[s]
                longest[i] = max(longest[i], total)
    return longest


def _longest_laps(
    turns: list[int], K: Sequence[int | None], rt: list[float], fb: list[float], M: int,
    up: Sequence[float], down: Sequence[float],
) -> list[float]:  # fmt: skip
    """Per turning stage s (``turns``, ascending), the longest ``n (RT(s..t) + up_s + down_t)
    + (M - 1 - n k) (F_s + B_s)`` over the next :data:`CYCLE_REACH` turning stages t with
    K_t <= K_s (:func:`steady_periods`); ``-inf`` where there is none or M <= K_s. ``fb``
    holds F_s + B_s, ``up``/``down`` :func:`turn_waits`."""
    if len(turns) <= SMALL_PIPELINE:
        return _longest_laps_small(turns, K, rt, fb, M, up, down)
    longest = longest_laps(
        np.array([K[s] for s in turns], dtype=np.int64),
        np.array([rt[s] + up[s] for s in turns]),
        np.array([rt[s + 1] - down[s] for s in turns]),
        np.array([fb[s] for s in turns]),
        M,
    )
    return [float(x) for x in longest]


def longest_laps(
    k: NDArray[np.int64], here: NDArray[np.float64], after: NDArray[np.float64],
    own: NDArray[np.float64], M: int,
) -> NDArray[np.float64]:  # fmt: skip
    """:func:`_longest_laps` over arrays whose first axis runs over the turning stages (further
    axes: plans side by side, as :mod:`dapple.planner.move_scores` scores them): ``k`` K_s,
    ``here`` RT_s + up_s, ``after`` the RT of what follows the stage less down_s
    (:func:`turn_waits`), ``own`` F_s + B_s."""
    n = k.shape[0]
    gated = k <= M - 1
    longest = np.full(k.shape, -np.inf)
    for d in range(1, min(CYCLE_REACH, n - 1) + 1):
        step = k[:-d] - k[d:] + 1  # s = the first n - d turns, t = s + d turns
        laps = (M - 1 - k[:-d]) // np.maximum(step, 1) + 1
        total = laps * (here[:-d] - after[d:]) + (M - 1 - laps * step) * own[:-d]
        take = gated[:-d] & (step >= 1)
        longest[:-d] = np.where(take, np.maximum(longest[:-d], total), longest[:-d])
    return longest


def latency(
    F: Sequence[float],
    B: Sequence[float],
    AR: Sequence[float],
    M: int,
    period: Sequence[float],
    paced: Sequence[bool] = (),
    K: Sequence[int | None] | None = None,
) -> Latency:
    """Equations 1-3 over S stages (comm stages included).

    Args:
        F: F_s per stage.
        B: B_s per stage.
        AR: AR(P_s, g_s) per stage (0 for comm stages), plus anything else a stage does
            once after its last backward.
        M: micro-batches.
        period: steady period of each stage, ``F_s + B_s`` in the paper
            (:func:`steady_periods` bounds it by the cycles that the in-flight limits K_s
            close).
        paced: per stage, whether such a cycle paces it (:func:`cycle_paced`); empty: none.
        K: K_s per stage (None or 0 where unbounded); with it the ending phase overlaps the
            tail with the pivot's pending backwards and L is at least :func:`backward_phases`
            (below). None or empty: neither (the paper's).

    Equations 3, 1 and 2 with the ending phase as the module docstring says.
    """
    S = len(F)
    if not K:
        K = None
    # equation 3: the pivot Q
    Q = S - 1
    between = 0.0  # sum of F + B over stages s+1 .. Q-1
    for s in range(S - 2, -1, -1):
        if (M - 1) * period[s] > (M - 1) * period[Q] + (0.0 if paced and paced[s] else between):
            Q = s
            between = 0.0
        else:
            between += F[s] + B[s]
    # equation 1: warm-up and steady phases
    T_w = sum(F[: Q + 1])
    T_s = (M - 1) * period[Q]
    # ending phase: the tail's forwards, then every stage's last backward and AR
    tail_f = sum(F[Q + 1 :])
    after = 0.0  # stages after Q, from the end of the tail's forwards
    acc = 0.0
    for s in range(S - 1, Q, -1):
        acc += B[s]
        after = max(after, acc + AR[s])
    tail = tail_f + acc  # RT(Q+1..S-1): the last micro-batch's round trip after the pivot
    k = min(K[Q] or 1, M) if K is not None else 1
    own_pace = k > 1 and period[Q] == F[Q] + B[Q]
    first, last = pivot_waits(tail, F[Q], B[Q], k) if own_pace else (0.0, tail)
    drain = (k - 1) if own_pace else 0
    # stages up to Q, from the pivot's M - 1st backward (equation 1's reference point): its
    # last gradient, or its drain queued behind a slower backward upstream
    own = 0.0
    queued = 0.0
    acc = 0.0
    widest = 0.0  # max B_a over computation stages a in [s, Q)
    for s in range(Q, -1, -1):
        acc += B[s]
        own = max(own, acc + AR[s])
        if s < Q and K is not None and K[s]:
            widest = max(widest, B[s])
        if drain and widest > B[Q]:
            queued = max(queued, acc + AR[s] + first + drain * (widest - B[Q]))
    T_e = max(tail_f + after, last + own, queued)
    # equation 2, unless a stage's backward phase ends later
    L = T_w + T_s + T_e
    bound = backward_phases(F, B, AR, K, M) if K is not None else 0.0
    if bound > L * (1.0 + TIE):
        return Latency(bound, T_w, T_s, bound - T_w - T_s, Q)
    return Latency(L, T_w, T_s, T_e, Q)


def pivot_waits(tail: float, F_Q: float, B_Q: float, k: int) -> tuple[float, float]:
    """How long the pivot's first and last backwards wait for the tail ``tail`` =
    RT(Q+1..S-1), with k = min(K_Q, M) micro-batches in flight and its own pace F_Q + B_Q, as
    delays past equation 1's reference point (the pivot's M - 1st backward at
    ``T_w + (M - 1)(F_Q + B_Q)``).

    Before its first backward the pivot waits for the tail less its k - 1 forwards after the
    first, ``w1 = max(0, tail - (k-1) F_Q)``, which delays everything after it; before its last
    backward, for the tail less the k - 1 backwards it runs after its last forward,
    ``w2 = max(0, tail - (k-1) B_Q)``. Returns ``(w1, min(tail, w1 + w2))``: the delay of the
    pivot's drain and of its last backward, never beyond the paper's whole tail.

    With natural counts and equal stages (1F1B: ``tail = (k-1)(F_Q + B_Q)``) the last wait is
    the tail; it is below it when the pivot's own backwards or forwards cover it.
    """
    first = max(0.0, tail - (k - 1) * F_Q)
    return first, min(tail, first + max(0.0, tail - (k - 1) * B_Q))


def backward_phases(
    F: Sequence[float], B: Sequence[float], AR: Sequence[float], K: Sequence[int | None], M: int
) -> float:
    """A lower bound on the step from each computation stage's own work and the relay of its
    last gradient up the pipeline.

    Stage t (K_t set; k_t = min(K_t, M)) runs k_t forwards before its first backward, and
    before that backward every stage up to t has run only forwards (the counts do not grow
    down the pipeline), so its k_t-th forward ends no sooner than k_t equal jobs through a
    chain of machines with nothing ahead of them, ``sum_{a<=t} F_a + (k_t - 1) max_{a<=t} F_a``
    (computation stages in the max; comm stages only delay). Its first backward starts after
    that and after the first backward of the stage after it, relayed through the comm stage
    between; from there it still runs M backwards and M - k_t forwards. Nor can its last
    backward end before its first input arrives plus all its work, ``sum_{a<t} F_a +
    M (F_t + B_t)``. Stage s ends no sooner than its own last backward or any later stage's
    relayed up through the stages between, then AR_s::

        first_t = max(first_{t+1} + B_{t+1}, sum_{a<=t} F_a + (k_t - 1) max_{a<=t} F_a)
        E_t     = max(first_t + M B_t + (M - k_t) F_t, sum_{a<t} F_a + M (F_t + B_t))
        G_t     = max(E_t, G_{t+1} + B_t),    step >= max_t G_t + AR_t.

    Equations 1-3 pace the steady phase by the pivot and miss a stage whose whole backward
    phase comes after a late first gradient (a stage with K_t = M runs its M backwards in a
    row once the pivot's K_Q-deep warm-up lets the first gradient through), and a stage after
    the pivot about as busy as it, which delays the pivot's backwards. Stages without K_t
    (comm stages; every stage under GPipe) only relay.
    """
    ready: list[float] = []  # when stage t's k_t-th forward ends, at the soonest
    arrive: list[float] = []  # sum_{a<t} F_a: when its first input arrives
    total = 0.0
    widest = 0.0
    for t in range(len(F)):
        arrive.append(total)
        total += F[t]
        k = K[t]
        if k:
            widest = max(widest, F[t])
        ready.append(total + (min(k, M) - 1) * widest if k else total)
    end = 0.0
    first = 0.0  # when stage t + 1's first backward ended (relayed up)
    last = 0.0  # G_{t+1}: the latest a gradient reaches stage t
    for t in range(len(F) - 1, -1, -1):
        first = max(first, ready[t])
        k = K[t]
        if k:
            k = min(k, M)
            own = max(first + M * B[t] + (M - k) * F[t], arrive[t] + M * (F[t] + B[t]))
            last = max(own, last + B[t])
            end = max(end, last + AR[t])
        else:
            last += B[t]
        first += B[t]
    return end
