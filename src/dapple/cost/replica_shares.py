"""A stage whose replicas run at different speeds: each replica's time on its share of a
micro-batch, the stage's time as its slowest replica's, and the shares that balance them.

Pure, no torch. Replica ``j`` of a stage computes its share ``n_j`` of every micro-batch
(:attr:`~dapple.core.plan.StagePlan.shares`) in ``t(n_j) / speed_j`` ms, where ``t(n)`` is
the stage's F + B on ``n`` samples on a device of speed 1 (nondecreasing in ``n``); the stage
keeps the pipeline waiting for the slowest, so its F_s + B_s is ``max_j t(n_j) / speed_j``
(issue #43: mixed devices). The planner calls these once device kinds have speeds.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dapple.core._json import require

__all__ = ["at_speeds", "balanced_shares", "balanced_shares_of", "slowest_replica_ms"]

_R = TypeVar("_R", bound=Any)

TimeOfSamples = Callable[[int], float]
"""``n -> ms`` of the stage's F + B on ``n`` samples at speed 1, nondecreasing in ``n``."""


def _check_speeds(speeds: Sequence[float]) -> None:
    require(
        len(speeds) >= 1 and all(0 < s < float("inf") for s in speeds),
        f"replica speeds must be finite and > 0, got {list(speeds)}",
    )


def slowest_replica_ms(shares: Sequence[int], speeds: Sequence[float], ms: TimeOfSamples) -> float:
    """``max_j ms(shares[j]) / speeds[j]``: the stage's time per micro-batch.

    Raises:
        ValidationError: a speed that is not finite and > 0, or a count unlike the shares'.
    """
    _check_speeds(speeds)
    require(
        len(shares) == len(speeds),
        f"{len(shares)} shares {list(shares)} for {len(speeds)} replica speeds {list(speeds)}",
    )
    return max(ms(n) / s for n, s in zip(shares, speeds, strict=True))


def balanced_shares(b: int, speeds: Sequence[float], ms: TimeOfSamples) -> tuple[int, ...]:
    """Whole-sample shares of ``b`` (each >= 1) minimising :func:`slowest_replica_ms`.

    One sample each, then every further sample to the replica that would finish it soonest
    (ties to the lower index). For nondecreasing ``ms`` this is optimal: were the greedy's
    slowest time above the optimum T, every replica would hold the most samples it can finish
    within T, so they would already hold ``b``.

    Raises:
        ValidationError: a speed that is not finite and > 0, or ``b`` below the replica count.
    """
    _check_speeds(speeds)
    return balanced_shares_of(b, [_at_speed(ms, v) for v in speeds])


def _at_speed(ms: TimeOfSamples, v: float) -> TimeOfSamples:
    return lambda n: ms(n) / v


def balanced_shares_of(b: int, times: Sequence[TimeOfSamples]) -> tuple[int, ...]:
    """Whole-sample shares of ``b`` (each >= 1) minimising ``max_j times[j](n_j)``: replica j
    computes n samples in ``times[j](n)`` ms, nondecreasing in n (e.g. its own kind's
    profile, :mod:`dapple.core.kind_profiles`). The greedy of :func:`balanced_shares`, optimal
    for the same reason; times equal to 12 significant digits tie (to the lower index).

    Raises:
        ValidationError: no replicas, or ``b`` below their count.
    """
    r = len(times)
    require(r >= 1 and b >= r, f"balanced_shares: {b} samples cannot give each of {r} replicas one")
    out = [1] * r
    heap = [(_tie(times[j](2)), j) for j in range(r)]
    heapq.heapify(heap)
    for _ in range(b - r):
        _, j = heapq.heappop(heap)
        out[j] += 1
        heapq.heappush(heap, (_tie(times[j](out[j] + 1)), j))
    return tuple(out)


def _tie(ms: float) -> float:
    """``ms`` to 12 significant digits: one time summed in two orders (the planner's prefix
    sums, the cost model's per-layer sums) differs in its last bits, and would break a tie
    between replicas one way in the search and the other in the cost model."""
    return float(f"{ms:.12g}")


_TIMES = ("forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms")
"""The compute times of a :class:`~dapple.cost.terms.ReplicaTerms` a device's speed divides."""


def at_speeds(replicas: Sequence[_R], speeds: Sequence[float]) -> tuple[_R, ...]:
    """Each replica's terms (:class:`~dapple.cost.terms.ReplicaTerms`) with its F, B, I and W
    divided by its device's speed (host CPU extras and transfers are not compute: unchanged).

    Raises:
        ValidationError: a speed that is not finite and > 0, or a count unlike the replicas'.
    """
    _check_speeds(speeds)
    require(len(replicas) == len(speeds), f"{len(speeds)} speeds for {len(replicas)} replicas")
    return tuple(
        x if v == 1.0 else dataclasses.replace(x, **{k: getattr(x, k) / v for k in _TIMES})
        for x, v in zip(replicas, speeds, strict=True)
    )
