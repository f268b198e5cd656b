"""Shared compute in the cost model: how much a server's concurrency stretches F_s and B_s.

An extension beyond the paper's equations 1-2 (dedicated devices), used only when
``Cluster.compute_cores_per_server`` is set; see :func:`shared_compute_scale`. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dapple.core.cluster import Cluster
from dapple.core.plan import split_sizes

__all__ = ["shared_compute_scale", "slice_work"]


def slice_work(
    devices: Sequence[int],
    b: int,
    fb_ms: Callable[[int], tuple[float, float]],
    recompute: bool,
    shares: Sequence[int] | None = None,
) -> list[tuple[int, float]]:
    """``(device, w_d)`` of every replica of a stage: w_d = F + B of its own slice.

    Args:
        devices: the stage's replicas, in slice order (:func:`dapple.core.plan.split_sizes`).
        b: samples of one micro-batch before the split.
        fb_ms: forward and backward ms of the stage's layers on n samples, without
            re-computation.
        recompute: the backward repeats the forward.
        shares: the replicas' slices (:attr:`~dapple.core.plan.StagePlan.shares`); None: even.
    """
    out = []
    for d, n in zip(devices, split_sizes(b, len(devices), shares), strict=True):
        f, bw = fb_ms(n)
        out.append((d, f + bw + (f if recompute else 0.0)))
    return out


def shared_compute_scale(
    span_ms: float,
    steady_ms: float,
    M: int,
    devices: Sequence[Sequence[tuple[int, float]] | None],
    cluster: Cluster,
) -> list[tuple[float, float]]:
    """Stretch factors ``(alpha_s, beta_s)`` of each stage's F_s, B_s when a server's devices
    share compute: alpha_s outside the steady phase (warm-up, ending), beta_s in it.

    Extension beyond the paper's equations 1-2 (which assume dedicated devices). The simulator
    models processor sharing: k devices of a server computing at once on c =
    ``cluster.compute_cores_per_server`` compute units each progress at ``min(1, c / k)``
    (:meth:`Cluster.compute_rate`, which also covers a background load E). Analytically we
    use a server's *mean* concurrency per phase. Device d of stage s computes ``w_d = F_d +
    B_d`` per micro-batch over its own slice (plus its host CPU, :mod:`dapple.cost.host`).
    In the steady phase, ``T_s = (M - 1) period_Q`` unstretched (equation 1), every stage
    runs M - 1 micro-batches, so server sigma's concurrency is ``U_s = sum_{d on sigma} (M -
    1) w_d / T_s`` and ``beta_sigma = 1 / rate(U_s)``; the rest of its work, ``sum_d w_d``,
    falls into the rest of the compute span, ``T_c - T_s``, giving ``U_r`` and
    ``alpha_sigma``. A stage's replicas are paced by the slowest, so a stage takes the max
    over the servers of its devices. Exact for data parallelism (every device busy the whole
    span: alpha = G / c) and for a saturated steady phase (every device busy: beta = G / c);
    within a phase it averages idle cores over the phase. The concurrency is capped at the
    server's computing devices (a short phase would otherwise count more than it has).

    Args:
        span_ms: T_c, :func:`dapple.cost.latency.latency` of the unstretched F_s,
            B_s with every AR term replaced by the stage's per-step host CPU (0 for dedicated
            devices).
        steady_ms: T_s of the same unstretched latency, ``(M - 1) period_Q``.
        M: micro-batches.
        devices: per computation stage ``(device id, w_d)`` of every replica, w_d unstretched
            per micro-batch (:func:`slice_work` plus host CPU); None for comm stages.
        cluster: supplies ``compute_cores_per_server`` (None: all factors 1).

    Returns:
        ``(alpha_s, beta_s)`` per stage (``(1.0, 1.0)`` for comm stages).
    """
    S = len(devices)
    if cluster.compute_cores_per_server is None or span_ms <= 0:
        return [(1.0, 1.0)] * S
    rest_ms = max(span_ms - steady_ms, 1e-12)
    per_mb: dict[int, float] = {}  # server -> sum of w_d
    busy: dict[int, set[int]] = {}  # server -> its devices that compute
    for devs in devices:
        for d, w in devs or ():
            srv = cluster.server_of(d)
            per_mb[srv] = per_mb.get(srv, 0.0) + w
            busy.setdefault(srv, set()).add(d)

    def stretch(srv: int, concurrency: float) -> float:
        # no more devices compute at once than the server has: a phase shorter than its work
        # would otherwise count an impossible concurrency
        return 1.0 / cluster.compute_rate(min(concurrency, len(busy[srv])))

    alpha = {srv: stretch(srv, w / rest_ms) for srv, w in per_mb.items()}
    beta = (
        {srv: stretch(srv, (M - 1) * w / steady_ms) for srv, w in per_mb.items()}
        if steady_ms > 0
        else alpha
    )
    out = []
    for devs in devices:
        if not devs:
            out.append((1.0, 1.0))
            continue
        srvs = [cluster.server_of(d) for d, _ in devs]
        out.append((max(alpha[x] for x in srvs), max(beta[x] for x in srvs)))
    return out
