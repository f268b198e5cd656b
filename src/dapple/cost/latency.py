"""Pipeline latency L (paper section 5.1, equations 1-3) over per-stage arrays.

The one kernel of the cost model: :func:`dapple.cost.terms.pipeline_terms` assembles the
arrays (for a :class:`~dapple.core.plan.Plan` and for the planner's
:class:`~dapple.planner.evaluate.Scorer` alike) and :meth:`PipelineTerms.latency
<dapple.cost.terms.PipelineTerms.latency>` calls :func:`latency`. Pure, no torch.

Notation: S stages *including* the communication stages between computation stages (index
s in [0, S)), M micro-batches, F_s/B_s forward/backward time of stage s for one micro-batch,
AR_s the AllReduce AR(P_s, g_s) of stage s's gradients (0 for comm stages), K_s the
micro-batches stage s may keep in flight, Q the pivot stage (equation 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Latency", "latency", "steady_periods"]


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


def steady_periods(F: Sequence[float], B: Sequence[float], K: Sequence[int | None]) -> list[float]:
    """Per-micro-batch steady period of each stage: ``max(F_s + B_s, RT_s / K_s)``.

    The paper's equation 1 uses ``F_s + B_s``, which assumes K_s is large enough. A stage
    that may keep only K_s micro-batches in flight cannot start a new forward more often
    than every ``RT_s / K_s`` (Little's law), where ``RT_s = sum_{a=s}^{S-1} (F_a + B_a)`` is
    the round trip of one micro-batch from stage s's forward to its backward.

    Args:
        F: F_s per stage.
        B: B_s per stage.
        K: K_s per stage; None (or 0) leaves the stage unbounded (comm stages, and every
            stage of the GPipe schedule, whose forwards all run before its backwards).
    """
    S = len(F)
    period = [F[s] + B[s] for s in range(S)]
    rt = 0.0
    for s in range(S - 1, -1, -1):
        rt += F[s] + B[s]
        k = K[s]
        if k:
            period[s] = max(period[s], rt / k)
    return period


def latency(
    F: Sequence[float],
    B: Sequence[float],
    AR: Sequence[float],
    M: int,
    period: Sequence[float],
) -> Latency:
    """Equations 1-3 over S stages (comm stages included).

    Args:
        F: F_s per stage.
        B: B_s per stage.
        AR: AR(P_s, g_s) per stage (0 for comm stages), plus anything else a stage does
            once after its last backward.
        M: micro-batches.
        period: steady period of each stage, ``F_s + B_s`` in the paper
            (:func:`steady_periods` bounds it by the in-flight limit K_s).

    Equation 3 picks the pivot scanning s = S-1 .. 0: s replaces Q when its bubble-free steady
    phase ``T_st^s = (M-1) period_s`` exceeds ``T_st^Q`` plus the F + B of the stages strictly
    between.

    Equation 1: ``T_w = sum_{s<=Q} F_s`` and ``T_s = (M-1) period_Q``.

    Ending phase: at the end of T_s the pivot has run its last forward; the last micro-batch
    still goes forward through stages Q+1..S-1 and back (the "tail"), then stage s finishes its
    last backward and all-reduces. Stage s <= Q ends at ``tail_F + tail_B + sum_{a=s}^{Q} B_a +
    AR_s``, stage s > Q at ``tail_F + sum_{a=s}^{S-1} B_a + AR_s``. For Q = S-1 (no tail) this
    is exactly equation 1 with stage Q in its first branch (so that L >= M (F_Q + B_Q)); for
    Q < S-1 equation 1 as printed omits the tail and would under-estimate L.

    Equation 2: ``L = T_w + T_s + T_e``.
    """
    S = len(F)
    # equation 3: the pivot Q
    Q = S - 1
    between = 0.0  # sum of F + B over stages s+1 .. Q-1
    for s in range(S - 2, -1, -1):
        if (M - 1) * period[s] > (M - 1) * period[Q] + between:
            Q = s
            between = 0.0
        else:
            between += F[s] + B[s]
    # equation 1: warm-up and steady phases
    T_w = sum(F[: Q + 1])
    T_s = (M - 1) * period[Q]
    # ending phase: the tail's forwards, then every stage's last backward and AR
    tail_f = sum(F[Q + 1 :])
    end = 0.0
    acc = 0.0
    for s in range(S - 1, Q, -1):
        acc += B[s]
        end = max(end, acc + AR[s])
    for s in range(Q, -1, -1):
        acc += B[s]
        end = max(end, acc + AR[s])
    T_e = tail_f + end
    # equation 2
    return Latency(T_w + T_s + T_e, T_w, T_s, T_e, Q)
