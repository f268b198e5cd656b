"""Shared compute in the cost model: how much a server's concurrency stretches F_s and B_s.

An extension beyond the paper's equations 1-2 (dedicated devices), used only when
``Cluster.compute_cores_per_server`` is set: :func:`shared_compute_scale` outside the steady
phase, :func:`steady_stretch` in it. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dapple.core.cluster import Cluster
from dapple.core.plan import split_sizes
from dapple.cost.latency import steady_periods

__all__ = [
    "all_at_once",
    "own_stretch",
    "shared_compute_scale",
    "shared_periods",
    "slice_work",
    "steady_stretch",
]


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
    share compute, from a server's *mean* concurrency per phase: alpha_s outside the steady
    phase (warm-up, ending), beta_s in it.

    Extension beyond the paper's equations 1-2 (which assume dedicated devices). The simulator
    models processor sharing: k devices of a server computing at once on c =
    ``cluster.compute_cores_per_server`` compute units each progress at ``min(1, c / k)``
    (:meth:`Cluster.compute_rate`, which also covers a background load E), relative to one
    device computing alone; F_s, B_s and the host CPU come in as that lone device's wall time
    (a CPU-time profile and the host terms scaled by ``Cluster.lone_wall_per_cpu``,
    :mod:`dapple.cost.cpu_clock`). Device d of stage
    s computes ``w_d = F_d + B_d`` per micro-batch over its own slice (plus its host CPU,
    :mod:`dapple.cost.host`). In the steady phase, ``T_s = (M - 1) period_Q`` unstretched
    (equation 1), every stage runs M - 1 micro-batches, so server sigma's concurrency is
    ``U_s = sum_{d on sigma} (M - 1) w_d / T_s`` and ``beta_sigma = 1 / rate(U_s)``; the rest
    of its work, ``sum_d w_d``, falls into the rest of the compute span, ``T_c - T_s``, giving
    ``U_r`` and ``alpha_sigma``. A stage's replicas are paced by the slowest, so a stage takes
    the max over the servers of its devices. Exact for data parallelism (every device busy the
    whole span: alpha = G / c) and for a saturated steady phase (every device busy: beta = G /
    c); within a phase it spreads the work evenly, so it is a lower bound where devices
    compute in bursts (:func:`steady_stretch` models the steady phase's bursts). The
    concurrency is capped at the server's computing devices (a short phase would otherwise
    count more than it has).

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


def own_stretch(devs: Sequence[tuple[int, float]], cluster: Cluster) -> float:
    """The stretch of a stage's F_s, B_s when only its own replicas compute: they get their
    slices of a micro-batch together, so on each server its busy replicas are the j largest
    (nested, as in :func:`steady_stretch`) and the largest there finishes at ``1 /
    E[rate(k)]``, relative to the stage's slowest slice. Exact with M = 1, where the one
    micro-batch is at one stage at a time; a server's mean concurrency over the step would
    spread the stage's burst over the time the other stages compute alone."""
    on: dict[int, list[float]] = {}
    for d, w in devs:
        on.setdefault(cluster.server_of(d), []).append(w)
    w_max = max(w for _, w in devs)
    out = 1.0
    for ws in on.values():
        ws.sort(reverse=True)
        if ws[0] <= 0.0:
            continue
        dist = _nested([w / ws[0] for w in ws])
        rate = _mean_rate(dist, cluster.compute_rate)
        out = max(out, ws[0] / (rate * w_max))
    return out


def shared_periods(
    F: Sequence[float],
    B: Sequence[float],
    K: Sequence[int | None],
    M: int,
    period: Sequence[float],
    beta: Sequence[float],
    devices: Sequence[Sequence[tuple[int, float]] | None],
    cluster: Cluster,
) -> list[float]:
    """Steady periods on shared cores: per stage the larger of the periods of F_s, B_s stretched
    by the steady phase's bursts (:func:`steady_stretch`) and the unstretched ``period``
    stretched by the servers' capacity (``beta``, :func:`shared_compute_scale`'s mean
    concurrency: a server computes no faster than its c units however its devices' bursts
    fall). With M = 1 there is no steady phase and the capacity's stretch stands.

    Args:
        F: F_s of all S stages (host CPU included), unstretched.
        B: B_s likewise.
        K: in-flight bound per stage (None: unbounded), as for
            :func:`~dapple.cost.latency.steady_periods`.
        M: micro-batches.
        period: the steady periods of the unstretched F, B.
        beta: the mean-concurrency stretch per stage (1.0 for comm stages).
        devices: per stage ``(device id, w_d)`` of every replica (None for comm stages).
        cluster: the shared compute capacity.
    """
    capacity = [p * b for p, b in zip(period, beta, strict=True)]
    if M <= 1:
        return capacity

    def period_of(x: Sequence[float]) -> list[float]:
        return steady_periods(
            [f * v for f, v in zip(F, x, strict=True)],
            [b * v for b, v in zip(B, x, strict=True)],
            K,
            M,
        )

    bursts = period_of(steady_stretch(period_of, devices, K, cluster))
    return [max(a, b) for a, b in zip(bursts, capacity, strict=True)]


STRETCH_TOL = 1e-3
""":func:`steady_stretch` stops when no stretch moves by more than this between two rounds."""
STRETCH_ROUNDS = 100
"""... or after this many rounds. A round moves the whole way to the map's answer; each time the
answer turns back against the round before (overshooting), the move halves from then on."""


def steady_stretch(
    period_of: Callable[[Sequence[float]], Sequence[float]],
    devices: Sequence[Sequence[tuple[int, float]] | None],
    K: Sequence[int | None],
    cluster: Cluster,
) -> list[float]:
    """beta_s: how much processor sharing stretches each stage's F_s, B_s in the steady phase,
    from the bursts in which its devices compute (a mean-field fixed point).

    Each steady period P = ``max_s period_s`` (the periods of the stretched F_s, B_s,
    :func:`dapple.cost.latency.steady_periods`) replica d of stage s computes its ``w_d
    beta_s`` once: it is busy a fraction ``u_d = w_d beta_s / P`` of the time. What it shares
    a server with:

    * its own stage's replicas on that server: they get their slices of a micro-batch
      together and compute at the same rate there, so the busy ones are always the j largest
      slices (nested), and over replica d's burst a smaller one computes for ``w_j / w_d`` of
      it;
    * each other stage t with devices there: its count of busy replicas, nested the same
      way with fractions ``u``, taken as independent of stage s, except when the earlier of
      the two keeps one micro-batch in flight (K = 1): its one micro-batch is then at only one
      of them at a time, so they never compute together.

    The largest replica of s on each server thus sees k computing devices with a known
    distribution and finishes at the mean rate ``E[rate(k)]`` (:meth:`Cluster.compute_rate`):
    ``beta_s = 1 / E[rate(k)]``, the largest over its servers (relative to its slowest slice).
    From beta = 1, iterated to a fixed point (:data:`STRETCH_ROUNDS`). Where every device computes all
    the time (data parallelism, a saturated steady phase) it equals the mean-concurrency
    factor of :func:`shared_compute_scale`; where a pipeline's stages compute in bursts that
    overlap by chance, it charges the overlaps the mean spreads thin.

    Args:
        period_of: the steady periods of all S stages with computation stage s's F_s, B_s
            times ``x[s]`` (comm stages ``x = 1``).
        devices: per stage ``(device id, w_d)`` of every replica, w_d unstretched per
            micro-batch (:func:`slice_work` plus host CPU); None for comm stages.
        K: per stage its in-flight bound (None or 0: unbounded).
        cluster: supplies ``compute_cores_per_server`` (None: all 1) and the servers.
    """
    S = len(devices)
    if cluster.compute_cores_per_server is None:
        return [1.0] * S
    on: dict[int, dict[int, list[float]]] = {}  # server -> stage -> its works there
    w_max = [0.0] * S
    for s, devs in enumerate(devices):
        for d, w in devs or ():
            on.setdefault(cluster.server_of(d), {}).setdefault(s, []).append(w)
            w_max[s] = max(w_max[s], w)
    # servers holding the same works behave alike: one of each, and only those where enough
    # devices compute to slow each other down
    servers = {
        tuple((s, tuple(sorted(ws, reverse=True))) for s, ws in sorted(row.items()))
        for row in on.values()
    }
    shares = [_Server(dict(sig), K, cluster) for sig in sorted(servers)]
    shares = [sh for sh in shares if sh.rates[-1] < 1.0]
    beta = [1.0] * S
    if not shares:
        return beta
    x = [dict.fromkeys(sh.works, 1.0) for sh in shares]
    step, last = 1.0, [0.0] * sum(len(xs) for xs in x)
    for _ in range(STRETCH_ROUNDS):
        P = max(period_of(beta))
        new = [sh.stretches(xs, P) for sh, xs in zip(shares, x, strict=True)]
        r = [n[s] - xs[s] for n, xs in zip(new, x, strict=True) for s in xs]
        if sum(a * b for a, b in zip(r, last, strict=True)) < 0.0:  # turned back: overshot
            step /= 2
        last = r
        moved = step * max(map(abs, r))
        x = [{s: xs[s] + step * (n[s] - xs[s]) for s in xs} for n, xs in zip(new, x, strict=True)]
        beta = [1.0] * S
        for sh, xs in zip(shares, x, strict=True):
            for s, v in xs.items():
                beta[s] = max(beta[s], sh.works[s][0] * v / w_max[s])
        if moved < STRETCH_TOL:
            break
    return beta


class _Server:
    """One server's stages for :func:`steady_stretch`: their works there (largest first), the
    rate at each count of computing devices and each stage's own replicas' busy count."""

    def __init__(
        self, works: dict[int, tuple[float, ...]], K: Sequence[int | None], cluster: Cluster
    ):
        self.works = works
        self.rates = [cluster.compute_rate(k) for k in range(sum(map(len, works.values())) + 1)]
        self.own = {s: _nested([w / ws[0] for w in ws]) for s, ws in works.items()}
        self.apart = {(s, t) for s in works for t in works if s != t and K[min(s, t)] == 1}

    def stretches(self, x: dict[int, float], P: float) -> dict[int, float]:
        """Per stage s, 1 / E[rate(k)] of its largest replica here at stretches ``x``."""
        busy = {
            t: _nested([w * x[t] / P for w in ws] if P > 0 else [1.0] * len(ws))
            for t, ws in self.works.items()
        }
        out = {}
        for s in self.works:
            dist = self.own[s]
            for t in self.works:
                if t != s and (s, t) not in self.apart:
                    dist = _convolve(dist, busy[t])
            out[s] = 1.0 / _mean_rate(dist, self.rates.__getitem__)
        return out


def _mean_rate(dist: Sequence[float], rate: Callable[[int], float]) -> float:
    """E[rate(k)] over a busy count k of distribution ``dist`` (``P(k)`` by k)."""
    return sum(p * rate(k) for k, p in enumerate(dist) if p > 0.0)


def _nested(fracs: Sequence[float]) -> list[float]:
    """``P(N = j)`` for the busy count N of a stage's replicas when replica i (largest work
    first) is busy a fraction ``fracs[i]`` of the time and the busy ones are always the j
    largest."""
    f = [min(1.0, max(0.0, v)) for v in fracs] + [0.0]
    return [1.0 - f[0]] + [max(0.0, f[j - 1] - f[j]) for j in range(1, len(f))]


def _convolve(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The distribution of the sum of two independent counts."""
    out = [0.0] * (len(a) + len(b) - 1)
    for k, pa in enumerate(a):
        if pa > 0.0:
            for j, pb in enumerate(b):
                out[k + j] += pa * pb
    return out


def all_at_once(
    devices: Sequence[Sequence[tuple[int, float]] | None], cluster: Cluster
) -> list[float]:
    """Per stage ``1 / rate(k)`` with k every computing device of its servers (the largest over
    them; 1.0 for comm stages): the stretch of work they all do at once, as the step's host
    CPU at its end."""
    count: dict[int, int] = {}
    for devs in devices:
        for d, _ in devs or ():
            count[cluster.server_of(d)] = count.get(cluster.server_of(d), 0) + 1
    return [
        max((1.0 / cluster.compute_rate(count[cluster.server_of(d)]) for d, _ in devs), default=1.0)
        if devs
        else 1.0
        for devs in devices
    ]
