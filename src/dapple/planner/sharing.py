"""Shared compute in the cost model: how much a server's concurrency stretches F_s and B_s.

An extension beyond the paper's equations 1-2 (dedicated devices), used only when
``Cluster.compute_cores_per_server`` is set; see :func:`shared_compute_scale`. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.core.cluster import Cluster

__all__ = ["shared_compute_scale"]


def shared_compute_scale(
    span_ms: float,
    M: int,
    devices: Sequence[Sequence[tuple[int, float]] | None],
    cluster: Cluster,
) -> list[float]:
    """Stretch factor alpha_s of each stage's F_s, B_s when a server's devices share compute.

    Extension beyond the paper's equations 1-2 (which assume dedicated devices). The simulator
    models processor sharing: k devices of a server computing at once on c =
    ``cluster.compute_cores_per_server`` compute units each progress at ``min(1, c / k)``.
    Analytically we use the server's *mean* concurrency over the compute span of the step:
    device d of stage s computes ``W_d = M (F_d + B_d)`` over its own slice of each
    micro-batch (plus its host CPU, :mod:`dapple.planner.host`); the span is ``T_c``, L of equations 1-3 without the AllReduce terms (during
    AR(P_s, g_s) no one computes); server sigma's mean concurrency is ``U_sigma = sum_{d on
    sigma} W_d / T_c`` and its stretch ``alpha_sigma = max(1, U_sigma / c)`` (``1 /
    cluster.compute_rate(U_sigma)``, which also covers a background load E). A stage's
    replicas are paced by the slowest, so ``alpha_s = max`` over the servers of its devices. Exact for data parallelism (all G devices busy over the whole span: alpha =
    G / c) and for strictly alternating stages (one device busy at a time: alpha = 1); in
    between it averages the bubbles' idle cores over the step, so it under-estimates the
    steady phase's stretch when warm-up/ending bubbles are long (the simulator is exact).

    Args:
        span_ms: T_c, :func:`dapple.planner.cost.latency_from_stages` of the unstretched F_s,
            B_s with every AR term replaced by the stage's per-step host CPU
            (:mod:`dapple.planner.host`; 0 for dedicated devices).
        M: micro-batches.
        devices: per computation stage ``(device id, F + B of its slice, unstretched)`` of
            every replica; None for comm stages.
        cluster: supplies ``compute_cores_per_server`` (None: all factors 1).

    Returns:
        alpha_s per stage (1.0 for comm stages).
    """
    S = len(devices)
    T_c = span_ms
    if cluster.compute_cores_per_server is None or T_c <= 0:
        return [1.0] * S
    demand: dict[int, float] = {}  # server -> sum of W_d
    for devs in devices:
        for d, fb_ms in devs or ():
            srv = cluster.server_of(d)
            demand[srv] = demand.get(srv, 0.0) + M * fb_ms
    stretch = {srv: 1.0 / cluster.compute_rate(w / T_c) for srv, w in demand.items()}
    return [
        max((stretch[cluster.server_of(d)] for d, _ in devs), default=1.0) if devs else 1.0
        for devs in devices
    ]
