"""The line ``dapple plan`` prints on a mixed cluster: each stage's shares by device kind."""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan

__all__ = ["shares_line"]


def shares_line(plan: Plan, cluster: Cluster) -> str | None:
    """``shares by device speed: stage 0: 6 on 8 H100 (speed 1), 2 on 8 A100-40GB (speed
    0.315)`` for the stages that take unequal shares of a micro-batch; None where none does.
    A kind whose replicas take different shares lists them (``6/7``)."""
    b = plan.micro_batch_size
    parts = []
    for i, st in enumerate(plan.stages):
        if st.shares is None:
            continue
        kinds: dict[str, tuple[float, list[int]]] = {}
        for d, n in zip(st.replica_devices, st.slice_sizes(b), strict=True):
            k = cluster.kind_of(d)
            name, speed = ("device", 1.0) if k is None else (k.name, k.speed)
            kinds.setdefault(name, (speed, []))[1].append(n)
        each = ", ".join(
            f"{'/'.join(map(str, sorted(set(ns), reverse=True)))} on {len(ns)} {name} "
            f"(speed {speed:.3g})"
            for name, (speed, ns) in kinds.items()
        )
        parts.append(f"stage {i}: {each}")
    return "shares by device speed: " + "; ".join(parts) if parts else None
