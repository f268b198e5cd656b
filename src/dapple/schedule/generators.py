"""Compute orders of GPipe and DAPPLE early-backward scheduling (paper sections 4 and 6.3).

Index conventions: S stages, M micro-batches, stage i in [0, S), micro-batch m in [0, M).
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.errors import ValidationError
from dapple.schedule.interleaved import interleaved
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.zerobubble import zbh1

__all__ = ["compute_order", "dapple", "gpipe", "in_flight_counts", "warmup_counts"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def _check(S: int, M: int) -> None:
    if S < 1 or M < 1:
        raise ValidationError(
            f"schedules need S >= 1 stages and M >= 1 micro-batches, got S={S}, M={M}"
        )


def gpipe(S: int, M: int) -> ComputeOrder:
    """GPipe: every stage runs all M forwards, then all M backwards (in micro-batch order)."""
    _check(S, M)
    return {
        i: [Action(i, F, m) for m in range(M)] + [Action(i, B, m) for m in range(M)]
        for i in range(S)
    }


def warmup_counts(
    S: int, M: int, policy: str = "A", D: int | Sequence[int | None] | None = None
) -> list[int]:
    """K_i per stage: policy A ``min(S-i, D)``, policy B ``min(2(S-i)-1, D)``, never above M.

    ``D`` is how many micro-batches' activations fit on a device (one value, one per stage, or
    None for unbounded). K is additionally made non-increasing along the pipeline: a stage
    that warms up with more forwards than its predecessor would wait for a micro-batch the
    predecessor only sends after a backward it cannot get, i.e. deadlock.
    """
    _check(S, M)
    if policy not in ("A", "B"):
        raise ValidationError(f"policy must be 'A' or 'B', got {policy!r}")
    d_list: list[int | None] = list(D) if isinstance(D, Sequence) else [D] * S
    if len(d_list) != S:
        raise ValidationError(f"D must give one value per stage ({S}), got {len(d_list)}")
    ks: list[int] = []
    for i in range(S):
        k = S - i if policy == "A" else 2 * (S - i) - 1
        d = d_list[i]
        if d is not None:
            if d < 1:
                raise ValidationError(f"D for stage {i} must be >= 1, got {d}")
            k = min(k, d)
        k = min(k, M)
        if ks:
            k = min(k, ks[-1])
        ks.append(k)
    return ks


def dapple(
    S: int, M: int, policy: str = "A", D: int | Sequence[int | None] | None = None
) -> ComputeOrder:
    """DAPPLE early backward: K_i forwards, then strictly one backward and one forward, then the
    remaining backwards (section 4.2). After B_m comes F_{m+K_i}."""
    ks = warmup_counts(S, M, policy, D)
    order: ComputeOrder = {}
    for i, k in enumerate(ks):
        acts = [Action(i, F, m) for m in range(k)]
        for m in range(M):
            acts.append(Action(i, B, m))
            if m + k < M:
                acts.append(Action(i, F, m + k))
        order[i] = acts
    return order


def in_flight_counts(
    schedule: str, S: int, M: int, policy: str = "A", D: Sequence[int | None] | None = None
) -> list[int]:
    """K_i per stage, the micro-batches whose activations stage i holds at most: M for GPipe
    (every forward runs before the first backward), :func:`warmup_counts` for DAPPLE,
    ``min(S, M)`` for ZB-H1 (from F to W, :mod:`dapple.schedule.zerobubble`).

    Raises:
        ValidationError: unknown schedule name (``interleaved`` counts per rank, see
            :func:`dapple.schedule.interleaved.interleaved_warmup`), or bad policy or D
            (:func:`warmup_counts`).
    """
    if schedule == "gpipe":
        _check(S, M)
        return [M] * S
    if schedule == "dapple":
        return warmup_counts(S, M, policy, D)
    if schedule == "zbh1":
        _check(S, M)
        return [min(S, M)] * S
    raise ValidationError(
        f"no per-stage in-flight counts for schedule {schedule!r}; choose 'dapple', 'gpipe' or 'zbh1'"
    )


def compute_order(
    schedule: str,
    S: int,
    M: int,
    policy: str = "A",
    D: int | Sequence[int | None] | None = None,
    v: int = 1,
) -> ComputeOrder:
    """Dispatch on the plan's schedule name.

    Args:
        schedule: ``gpipe``, ``dapple``, ``interleaved`` or ``zbh1``.
        S: pipeline ranks (device groups); the stages are S·v.
        M: micro-batches.
        policy: DAPPLE's warm-up policy (``dapple`` only).
        D: DAPPLE's in-flight bound per stage (``dapple`` only).
        v: chunks per rank (``interleaved`` only; 1 for the others).

    Raises:
        ValidationError: unknown schedule name, or v > 1 for a schedule without chunks.
    """
    if v != 1 and schedule != "interleaved":
        raise ValidationError(
            f"v={v} chunks per rank need schedule 'interleaved', got {schedule!r}"
        )
    if schedule == "gpipe":
        return gpipe(S, M)
    if schedule == "dapple":
        return dapple(S, M, policy, D)
    if schedule == "interleaved":
        return interleaved(S, M, v)
    if schedule == "zbh1":
        return zbh1(S, M)
    raise ValidationError(
        f"unknown schedule {schedule!r}; choose 'gpipe', 'dapple', 'interleaved' or 'zbh1'"
    )
