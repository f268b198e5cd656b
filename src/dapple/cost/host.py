"""Host CPU overheads of the runtime, for devices that share a host's cores (CPU workers).

An extension beyond the paper's cost model (section 5.1), which times only layer compute and
link transfers: on a CPU host the runtime itself burns CPU - per program action (Python,
autograd bookkeeping, posting a message), per step (optimizer, the non-finite check and the
step collective) and per byte sent or received (copies through host memory and sockets) -
and that CPU competes with F/B for the same cores. The three terms are
``Cluster.action_overhead_ms``, ``Cluster.step_overhead_ms`` and
``Cluster.comm_cpu_ms_per_mb`` (measured by ``dapple calibrate``; all 0 for GPUs, whose host
work overlaps device compute, and then every extra here is 0).

For replica j of computation stage s, with ``n_in`` pieces of its micro-batch slice arriving
from stage s-1 and ``n_out`` pieces leaving to stage s+1 (split-concat,
:func:`dapple.core.plan.transfers`):

* F extra = ``a (1 + n_in + n_out) + c (bytes_in + bytes_out)``: the F action, its RECV_F and
  SEND_F actions and the bytes they move;
* B extra = the same with the gradients going the other way (RECV_B from s+1, SEND_B to s-1);
* step extra = ``step_overhead_ms + c * 2 * 2 (r-1)/r * P_s``: a ring AllReduce over the r
  replicas sends and receives ``2 (r-1)/r`` times the stage's gradient bytes P_s.

with a = ``action_overhead_ms`` and c = ``comm_cpu_ms_per_mb`` per byte.

:func:`apply_host` is the cost model's CPU-host pass: it adds these extras to the per-stage
arrays of :func:`dapple.cost.latency.latency` and, on shared cores, stretches them by
:func:`dapple.cost.sharing.shared_compute_scale`. It runs only when
:func:`has_host_terms`; on dedicated devices equations 1-3 alone give L. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import transfers
from dapple.core.profile import ModelProfile
from dapple.cost.latency import cycle_paced, latency, steady_periods
from dapple.cost.sharing import all_at_once, own_stretch, shared_compute_scale, shared_periods

__all__ = [
    "MIB",
    "HostExtra",
    "HostStages",
    "apply_host",
    "has_host_terms",
    "host_extras",
    "slowest_extra",
    "stage_host_extras",
]

MIB = 1024**2


@dataclass(frozen=True, slots=True)
class HostExtra:
    """Host CPU ms of one replica: per micro-batch on its F and its B, and once per step."""

    forward_ms: float = 0.0
    backward_ms: float = 0.0
    step_ms: float = 0.0

    def per_mb(self, M: int) -> float:
        """Host CPU per micro-batch over a step of M micro-batches: F + B extras + step / M."""
        return self.forward_ms + self.backward_ms + self.step_ms / M


def host_extras(
    profile: ModelProfile,
    cluster: Cluster,
    stages: Sequence[tuple[int, int, int]],
    b: int,
    shares: Sequence[Sequence[int] | None] | None = None,
) -> list[list[HostExtra]]:
    """Host CPU extras of every replica of every computation stage.

    Args:
        profile: boundary activation sizes and parameter bytes.
        cluster: the three overhead terms (module docstring).
        stages: ``(first layer, end layer, replicas)`` per computation stage, in order.
        b: samples of one micro-batch (before the split over replicas).
        shares: per computation stage its replicas' slices
            (:attr:`~dapple.core.plan.StagePlan.shares`); None: every stage's even.

    Returns:
        ``extras[s][j]`` for replica j of stage s.
    """
    S = len(stages)
    if not cluster.host_overheads:
        return [[HostExtra()] * r for _, _, r in stages]
    a = cluster.action_overhead_ms
    c = cluster.comm_cpu_ms_per_mb / MIB
    out: list[list[HostExtra]] = []
    sh = list(shares) if shares is not None else [None] * S
    for s, (lo, hi, r) in enumerate(stages):
        # samples of each piece replica j receives from s-1 and sends to s+1 (split-concat)
        ins: list[list[int]] = [[] for _ in range(r)]
        outs: list[list[int]] = [[] for _ in range(r)]
        if s > 0:
            for _, k, p_lo, p_hi in transfers(b, stages[s - 1][2], r, sh[s - 1], sh[s]):
                ins[k].append(p_hi - p_lo)
        if s < S - 1:
            for j, _, p_lo, p_hi in transfers(b, r, stages[s + 1][2], sh[s], sh[s + 1]):
                outs[j].append(p_hi - p_lo)
        in_bytes = profile.layers[lo - 1].output_bytes_per_sample if lo > 0 else 0.0
        out_bytes = profile.layers[hi - 1].output_bytes_per_sample
        params = sum(x.parameter_bytes for x in profile.layers[lo:hi])
        step = cluster.step_overhead_ms + (c * 4 * (r - 1) / r * params if r > 1 else 0.0)
        row = []
        for j in range(r):
            n_in, n_out = len(ins[j]), len(outs[j])
            moved = sum(ins[j]) * in_bytes + sum(outs[j]) * out_bytes
            per_mb = a * (1 + n_in + n_out) + c * moved
            row.append(HostExtra(per_mb, per_mb, step))
        out.append(row)
    return out


def stage_host_extras(
    profile: ModelProfile,
    cluster: Cluster,
    stages: Sequence[tuple[int, int, int]],
    b: int,
) -> list[HostExtra]:
    """Per computation stage, the largest extras over its replicas (:func:`slowest_extra`)."""
    return [slowest_extra(row) for row in host_extras(profile, cluster, stages, b)]


def slowest_extra(row: Sequence[HostExtra]) -> HostExtra:
    """The largest extras over a stage's replicas: the slowest replica paces the stage, as F_s
    and B_s use the largest slice."""
    return HostExtra(
        max(x.forward_ms for x in row),
        max(x.backward_ms for x in row),
        max(x.step_ms for x in row),
    )


def has_host_terms(cluster: Cluster) -> bool:
    """Whether :func:`apply_host` applies: host CPU overhead terms or shared compute cores."""
    return cluster.host_overheads or cluster.compute_cores_per_server is not None


@dataclass(frozen=True, slots=True)
class HostStages:
    """Per-stage arrays over all S stages after the CPU-host pass, for
    :func:`dapple.cost.latency.latency`."""

    F: list[float]
    """F_s with the host CPU of the forward and its messages, stretched on shared cores."""
    B: list[float]
    """B_s likewise."""
    AR: list[float]
    """AR_s plus :attr:`step`: the per-step host CPU ends a stage like its AllReduce."""
    period: list[float]
    """Steady period of the host-extended F_s, B_s, stretched by beta_s on shared cores."""
    step: list[float]
    """Per-step host CPU of each stage (0 for comm stages), stretched on shared cores."""
    paced: list[bool]
    """Whether a cycle of its in-flight limit paces the stage, read before the stretch
    (:func:`dapple.cost.latency.cycle_paced`)."""


def apply_host(
    F: Sequence[float],
    B: Sequence[float],
    AR: Sequence[float],
    K: Sequence[int | None],
    M: int,
    cluster: Cluster,
    extras: Sequence[HostExtra | None],
    work: Callable[[int], list[tuple[int, float]]],
) -> HostStages:
    """The CPU-host pass over the dedicated-device arrays of equations 1-3.

    1. F_s, B_s gain the stage's host extras (module docstring); the steady periods are
       those of the extended F_s, B_s (:func:`dapple.cost.latency.steady_periods`).
    2. Only with ``cluster.compute_cores_per_server``: F_s, B_s and the per-step host CPU
       stretch by alpha_s (:func:`shared_compute_scale`, from the compute span: equations 1-3
       with the per-step host CPU in place of AR), the periods by the steady phase's bursts
       and the servers' capacity (:func:`~dapple.cost.sharing.shared_periods`). With M = 1
       F_s, B_s stretch by their own replicas' sharing alone
       (:func:`~dapple.cost.sharing.own_stretch`): the one micro-batch is at one stage at a
       time, so a server's mean concurrency would spread a stage's burst over the others'.
    3. The per-step host CPU joins AR_s.

    Args:
        F: F_s per stage, comm stages included, without host CPU.
        B: B_s likewise (with re-computation).
        AR: AR(P_s, g_s) per stage (0 for comm stages).
        K: in-flight bound per stage for the steady period (None: unbounded).
        M: micro-batches.
        cluster: the host terms and the shared compute capacity.
        extras: per stage the extras of its slowest replica (:func:`stage_host_extras`);
            None for comm stages.
        work: ``work(s)``, for computation stage s (index among all S), ``(device, w_d)`` of
            every replica, w_d the F + B of its own slice without host CPU
            (:func:`dapple.cost.sharing.slice_work`); called only on shared cores.
    """
    F2, B2, step = list(F), list(B), [0.0] * len(F)
    for s, e in enumerate(extras):
        if e is not None:
            F2[s] += e.forward_ms
            B2[s] += e.backward_ms
            step[s] = e.step_ms
    period = steady_periods(F2, B2, K, M)
    paced = cycle_paced(F2, B2, K, M, period)
    if cluster.compute_cores_per_server is not None:
        devices = [
            None if e is None else [(d, w + e.per_mb(M)) for d, w in work(s)]
            for s, e in enumerate(extras)
        ]
        span, _, steady, _, _ = latency(F2, B2, step, M, period, paced)
        scale = shared_compute_scale(span, steady, M, devices, cluster)
        period = shared_periods(F2, B2, K, M, period, [b for _, b in scale], devices, cluster)
        fb = (  # M = 1: the one micro-batch is at one stage at a time, alone with its replicas
            [1.0 if d is None else own_stretch(d, cluster) for d in devices]
            if M == 1
            else [a for a, _ in scale]
        )
        F2 = [f * a for f, a in zip(F2, fb, strict=True)]
        B2 = [v * a for v, a in zip(B2, fb, strict=True)]
        if M == 1:  # ... and its step's host CPU meets the others' backward and steps
            step = [v * t for v, t in zip(step, all_at_once(devices, cluster), strict=True)]
        else:
            step = [v * a for v, (a, _) in zip(step, scale, strict=True)]
    return HostStages(
        F=F2,
        B=B2,
        AR=[a + h for a, h in zip(AR, step, strict=True)],
        period=period,
        step=step,
        paced=paced,
    )
