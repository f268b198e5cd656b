"""The line ``dapple plan`` prints on a mixed cluster: each stage's shares by device kind."""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan

__all__ = ["shares_line"]


def shares_line(plan: Plan, cluster: Cluster) -> str | None:
    """``shares by device speed: stage 0: 6 on 8 H100 (speed 1), 2 on 8 A100-40GB (speed
    0.315)`` for the stages that take unequal shares of a micro-batch; None where none does.
    A kind whose replicas take different shares lists them (``6/7``); a kind with its own
    profile reads ``(own profile)`` (:mod:`dapple.core.kind_profiles`)."""
    b = plan.micro_batch_size
    parts = []
    for i, st in enumerate(plan.stages):
        if st.shares is None:
            continue
        kinds: dict[str, tuple[str, list[int]]] = {}
        for d, n in zip(st.replica_devices, st.slice_sizes(b), strict=True):
            k = cluster.kind_of(d)
            name, pace = ("device", "speed 1") if k is None else (k.name, _pace(k.speed, k.profile))
            kinds.setdefault(name, (pace, []))[1].append(n)
        each = ", ".join(
            f"{'/'.join(map(str, sorted(set(ns), reverse=True)))} on {len(ns)} {name} ({pace})"
            for name, (pace, ns) in kinds.items()
        )
        parts.append(f"stage {i}: {each}")
    return "shares by device speed: " + "; ".join(parts) if parts else None


def _pace(speed: float, profile: object) -> str:
    return "own profile" if profile is not None else f"speed {speed:.3g}"
