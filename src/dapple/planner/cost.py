"""DAPPLE cost model: stage compute, comm stages, AllReduce, memory and pipeline latency L.

Pure functions (no torch) over :class:`ModelProfile`, :class:`Cluster` and :class:`Plan`,
following the paper's section 5.1. Notation: S stages *including* the communication stages
inserted between computation stages, M micro-batches of b samples, F_s/B_s forward/backward
time of stage s for one micro-batch, AR(P_s, g_s) the gradient AllReduce of stage s's
parameters P_s over its device set g_s, Q the pivot stage (equation 3).

Design choices beyond the paper (each documented where used):

* A micro-batch is split over the r_s replicas of a stage with :func:`dapple.core.plan.split_sizes`;
  F_s/B_s are those of the largest (first) slice, the slowest replica.
* Cross-server traffic of one server shares its one network interface: the inter-server
  bandwidth is per server, so concurrent transfers (and hierarchical AllReduce shards) leaving
  or entering a server add up.
* Steady phase with bounded in-flight micro-batches: a stage that may keep only K_i micro-batches
  in flight cannot start a new forward more often than every ``RT_i / K_i`` where RT_i is the
  round trip of one micro-batch from its forward to its backward (Little's law). The paper's
  equation 1 assumes ``K_i`` large enough; we use ``max(F_s + B_s, RT_s / K_s)`` as the
  per-micro-batch period of stage s, which reduces to the paper's when memory is ample.
* Shared compute (an extension beyond equations 1-2, only when
  ``cluster.compute_cores_per_server`` = c is set, e.g. CPU worker processes on fewer cores):
  F_s, B_s stretch by alpha_s and the steady period by beta_s, the mean concurrency outside
  and inside the steady phase; see :func:`dapple.planner.sharing.shared_compute_scale`. With c = None every number is the paper's model above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan, slice_bounds, split_sizes
from dapple.core.profile import ModelProfile
from dapple.planner.host import stage_host_extras
from dapple.planner.memory import (
    activation_bytes,
    boundary_bytes,
    device_memory_bytes,
    max_in_flight_fitting,
    parameter_state_bytes,
)
from dapple.planner.sharing import shared_compute_scale
from dapple.schedule.generators import warmup_counts

__all__ = [
    "LatencyBreakdown",
    "StageCost",
    "activation_bytes",
    "allreduce_ms",
    "boundary_bytes",
    "comm_ms",
    "comm_stage_ms",
    "compute_ms",
    "device_memory_bytes",
    "in_flight_counts",
    "latency_from_stages",
    "max_in_flight_fitting",
    "overlaps",
    "parameter_state_bytes",
    "pipeline_latency",
    "shared_compute_scale",
    "stage_compute_ms",
    "transfer_ms",
]


def compute_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    samples: int,
    *,
    recompute: bool = False,
) -> tuple[float, float]:
    """Forward and backward time of one call of layers ``[start, end)`` on ``samples`` samples.

    Args:
        profile: per-layer affine times.
        cluster: supplies ``compute_slowdown``.
        layers: ``(start, end)`` layer range.
        samples: samples of the call (0 gives 0, 0: no call).
        recompute: the backward re-runs the forward first (activation re-computation), so it
            includes the forward time.

    Returns:
        ``(forward_ms, backward_ms)``.
    """
    s, e = layers
    f = sum(layer.forward.at(samples) for layer in profile.layers[s:e]) * cluster.compute_slowdown
    b = sum(layer.backward.at(samples) for layer in profile.layers[s:e]) * cluster.compute_slowdown
    return f, b + (f if recompute else 0.0)


def stage_compute_ms(
    profile: ModelProfile, cluster: Cluster, stage: StagePlan, micro_batch_size: int
) -> tuple[float, float]:
    """F_s, B_s of a computation stage: its slowest replica's slice ``split_sizes(b, r_s)[0]``.

    Args:
        profile: per-layer times.
        cluster: supplies ``compute_slowdown``.
        stage: layer range, replicas and re-computation flag.
        micro_batch_size: b, samples of one micro-batch before the split.
    """
    samples = split_sizes(micro_batch_size, stage.replicas)[0]
    return compute_ms(profile, cluster, stage.layers, samples, recompute=stage.recompute)


def transfer_ms(cluster: Cluster, nbytes: float, src_device: int, dst_device: int) -> float:
    """Point-to-point time of ``nbytes``: link latency + bytes / bandwidth; 0 when nothing moves.

    Args:
        cluster: link classes (same server or across servers).
        nbytes: bytes sent.
        src_device: sending device id.
        dst_device: receiving device id (the same device costs nothing).
    """
    if nbytes <= 0 or src_device == dst_device:
        return 0.0
    return cluster.latency_ms(src_device, dst_device) + nbytes / cluster.bandwidth_bytes_per_ms(
        src_device, dst_device
    )


def _server_counts(cluster: Cluster, devices: Sequence[int]) -> list[int]:
    counts: dict[int, int] = {}
    for d in devices:
        s = cluster.server_of(d)
        counts[s] = counts.get(s, 0) + 1
    return list(counts.values())


def allreduce_ms(cluster: Cluster, nbytes: float, devices: Sequence[int]) -> float:
    """AR(P_s, g_s): time to all-reduce ``nbytes`` of gradients over ``devices``.

    Ring within one server: ``2(n-1)/n * bytes / bw + 2(n-1) * latency``. When the set spans k
    servers, hierarchical: intra-server reduce-scatter, inter-server ring all-reduce of the
    shards (all shards of a server share its network interface, so a server moves
    ``2(k-1)/k * bytes`` in all), intra-server all-gather. Zero for one replica.

    Args:
        cluster: bandwidths and latencies.
        nbytes: gradient bytes (the stage's parameter bytes).
        devices: the replicas' device ids.
    """
    n = len(devices)
    if n <= 1 or nbytes <= 0:
        return 0.0
    counts = _server_counts(cluster, devices)
    k = len(counts)
    intra_bpms = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
    inter_bpms = cluster.inter_server_bandwidth_gbps * 1e9 / 8 / 1e3
    if k == 1:
        return 2 * (n - 1) / n * nbytes / intra_bpms + 2 * (n - 1) * cluster.intra_server_latency_ms
    c = max(counts)  # the most crowded server paces the intra-server phases
    intra = 0.0
    if c > 1:
        intra = 2 * ((c - 1) / c * nbytes / intra_bpms + (c - 1) * cluster.intra_server_latency_ms)
    inter = 2 * (k - 1) / k * nbytes / inter_bpms + 2 * (k - 1) * cluster.inter_server_latency_ms
    return intra + inter


def comm_stage_ms(
    profile: ModelProfile,
    cluster: Cluster,
    src: StagePlan,
    dst: StagePlan,
    micro_batch_size: int,
) -> tuple[float, float]:
    """F and B of the communication stage between computation stages ``src`` and ``dst``.

    Split-concat (section 6.2, :func:`dapple.core.plan.transfers`): replica j of ``src`` sends its
    overlap with replica k's slice to ``dst.devices[k]``. Transfers proceed concurrently; a
    device link carries its own intra-server messages, and a server's network interface
    carries the sum of all cross-server bytes leaving (or entering) it. The stage time is the
    busiest of these links. Backward gradients take the same links in reverse: same time.

    Args:
        profile: boundary activation sizes.
        cluster: link classes.
        src: the stage before the cut (its end is the cut).
        dst: the stage after the cut.
        micro_batch_size: b.

    Returns:
        ``(forward_ms, backward_ms)``.
    """
    return comm_ms(profile, cluster, src.layers[1], src.devices, dst.devices, micro_batch_size)


def comm_ms(
    profile: ModelProfile,
    cluster: Cluster,
    cut: int,
    src_devices: Sequence[int],
    dst_devices: Sequence[int],
    micro_batch_size: int,
) -> tuple[float, float]:
    """:func:`comm_stage_ms` on bare device tuples (the planner's fast path).

    Args:
        profile: boundary activation sizes.
        cluster: link classes.
        cut: first layer of the destination stage.
        src_devices: replicas before the cut, in slice order.
        dst_devices: replicas after the cut, in slice order.
        micro_batch_size: b.
    """
    per_sample = boundary_bytes(profile, cut, 1)
    intra_bpms = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
    inter_bpms = cluster.inter_server_bandwidth_gbps * 1e9 / 8 / 1e3
    dev_out: dict[int, float] = {}
    dev_in: dict[int, float] = {}
    nic_out: dict[int, float] = {}
    nic_in: dict[int, float] = {}
    for j, k, lo, hi in overlaps(micro_batch_size, len(src_devices), len(dst_devices)):
        a, b = src_devices[j], dst_devices[k]
        nbytes = per_sample * (hi - lo)
        if a == b or nbytes <= 0:
            continue
        if cluster.same_server(a, b):
            dev_out[a] = dev_out.get(a, 0.0) + nbytes
            dev_in[b] = dev_in.get(b, 0.0) + nbytes
        else:
            sa, sb = cluster.server_of(a), cluster.server_of(b)
            nic_out[sa] = nic_out.get(sa, 0.0) + nbytes
            nic_in[sb] = nic_in.get(sb, 0.0) + nbytes
    t = 0.0
    for v in (*dev_out.values(), *dev_in.values()):
        t = max(t, cluster.intra_server_latency_ms + v / intra_bpms)
    for v in (*nic_out.values(), *nic_in.values()):
        t = max(t, cluster.inter_server_latency_ms + v / inter_bpms)
    return t, t


def overlaps(b: int, r_src: int, r_dst: int) -> list[tuple[int, int, int, int]]:
    """:func:`dapple.core.plan.transfers` in O(r_src + r_dst) by a two-pointer sweep over the
    slice bounds (``transfers`` compares every pair)."""
    src = slice_bounds(b, r_src)
    dst = slice_bounds(b, r_dst)
    out: list[tuple[int, int, int, int]] = []
    j = k = 0
    while j < r_src and k < r_dst:
        lo = max(src[j][0], dst[k][0])
        hi = min(src[j][1], dst[k][1])
        if lo < hi:
            out.append((j, k, lo, hi))
        # advance whichever slice ends first (empty slices end where they start)
        if src[j][1] <= dst[k][1]:
            j += 1
        else:
            k += 1
    return out


def in_flight_counts(plan: Plan) -> list[int]:
    """K_i of each computation stage: M for the GPipe schedule, else :func:`warmup_counts`."""
    S, M = plan.num_stages, plan.num_micro_batches
    if plan.schedule == "gpipe":
        return [M] * S
    return warmup_counts(S, M, plan.policy, [st.max_in_flight for st in plan.stages])


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCost:
    """One row of the latency breakdown: a computation stage or a comm stage."""

    kind: str
    """``compute`` or ``comm``."""
    index: int
    """Computation stage index (for comm stages: the stage before the cut)."""
    forward_ms: float
    """F_s for one micro-batch (with its host CPU extra, :mod:`dapple.planner.host`)."""
    backward_ms: float
    """B_s for one micro-batch (includes re-computation and the host CPU extra)."""
    allreduce_ms: float
    """AR(P_s, g_s); 0 for comm stages."""
    host_step_ms: float = 0.0
    """Host CPU once per step after the last backward (:mod:`dapple.planner.host`), added to
    the stage's ending like AR; 0 for comm stages and dedicated devices."""
    memory_bytes: float
    """Peak memory of one replica (0 for comm stages)."""
    in_flight: int
    """K_i (comm stages: 0)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyBreakdown:
    """Pipeline latency L = T_w + T_s + T_e (equations 1-2) and its ingredients."""

    L_ms: float
    T_w_ms: float
    T_s_ms: float
    T_e_ms: float
    Q: int
    """Pivot stage index among all S stages (comm stages counted)."""
    S: int
    """Number of stages, comm stages included."""
    stages: tuple[StageCost, ...]
    """Per-stage rows in pipeline order, comm stages between computation stages."""
    fits_memory: bool
    """Every replica fits ``cluster.device_memory_bytes``."""

    @property
    def pivot(self) -> StageCost:
        """The row of stage Q."""
        return self.stages[self.Q]


def latency_from_stages(
    F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int, period: Sequence[float]
) -> tuple[float, float, float, float, int]:
    """Equations 1-3 over S stages (comm stages included).

    Args:
        F: F_s per stage.
        B: B_s per stage.
        AR: AR(P_s, g_s) per stage (0 for comm stages).
        M: micro-batches.
        period: per-micro-batch steady period of each stage, ``F_s + B_s`` in the paper (see
            the module docstring for the bounded in-flight extension).

    Returns:
        ``(L, T_w, T_s, T_e, Q)``.

    Equation 3 picks the pivot scanning s = S-1 .. 0: s replaces Q when its bubble-free steady
    phase ``T_st^s = (M-1) period_s`` exceeds ``T_st^Q`` plus the F + B of the stages strictly
    between.

    Ending phase: at the end of T_s the pivot has run its last forward; the last micro-batch
    still goes forward through stages Q+1..S-1 and back (the "tail"), then stage s finishes its
    last backward and all-reduces. Stage s <= Q ends at ``tail_F + tail_B + sum_{a=s}^{Q} B_a +
    AR_s``, stage s > Q at ``tail_F + sum_{a=s}^{S-1} B_a + AR_s``. For Q = S-1 (no tail) this
    is exactly equation 1 with stage Q in its first branch (so that L >= M (F_Q + B_Q)); for
    Q < S-1 equation 1 as printed omits the tail and would under-estimate L.
    """
    S = len(F)
    Q = S - 1
    between = 0.0  # sum of F + B over stages s+1 .. Q-1
    for s in range(S - 2, -1, -1):
        if (M - 1) * period[s] > (M - 1) * period[Q] + between:
            Q = s
            between = 0.0
        else:
            between += F[s] + B[s]
    T_w = sum(F[: Q + 1])
    T_s = (M - 1) * period[Q]
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
    return T_w + T_s + T_e, T_w, T_s, T_e, Q


def pipeline_latency(plan: Plan, profile: ModelProfile, cluster: Cluster) -> LatencyBreakdown:
    """L of ``plan`` under the cost model (equations 1-3), with per-stage rows and memory.

    Args:
        plan: the plan (stages, M, b, schedule, policy, max_in_flight).
        profile: the model profile it was made for.
        cluster: the cluster it runs on.
    """
    b, M = plan.micro_batch_size, plan.num_micro_batches
    ks = in_flight_counts(plan)
    host = stage_host_extras(profile, cluster, [(*st.layers, st.replicas) for st in plan.stages], b)
    rows: list[StageCost] = []
    for i, st in enumerate(plan.stages):
        if i > 0:
            cf, cb = comm_stage_ms(profile, cluster, plan.stages[i - 1], st, b)
            rows.append(
                StageCost(
                    kind="comm",
                    index=i - 1,
                    forward_ms=cf,
                    backward_ms=cb,
                    allreduce_ms=0.0,
                    memory_bytes=0.0,
                    in_flight=0,
                )
            )
        f, bw = stage_compute_ms(profile, cluster, st, b)
        s0, e0 = st.layers
        grad_bytes = float(sum(layer.parameter_bytes for layer in profile.layers[s0:e0]))
        rows.append(
            StageCost(
                kind="compute",
                index=i,
                forward_ms=f + host[i].forward_ms,
                backward_ms=bw + host[i].backward_ms,
                allreduce_ms=allreduce_ms(cluster, grad_bytes, st.devices),
                host_step_ms=host[i].step_ms,
                memory_bytes=device_memory_bytes(profile, st, b, ks[i]),
                in_flight=ks[i],
            )
        )
    F = [r.forward_ms for r in rows]
    Bk = [r.backward_ms for r in rows]
    period = _periods(F, Bk, rows, plan.schedule)
    if cluster.compute_cores_per_server is not None:
        devs = [
            _slice_demand(profile, cluster, plan.stages[r.index], b, host[r.index].per_mb(M))
            if r.kind == "compute"
            else None
            for r in rows
        ]
        # the compute span: no AR, but the host CPU at the end of the step is compute too
        span, _, steady, _, _ = latency_from_stages(
            F, Bk, [r.host_step_ms for r in rows], M, period
        )
        scale = shared_compute_scale(span, steady, M, devs, cluster)
        rows = [
            dataclasses.replace(
                r,
                forward_ms=r.forward_ms * a,
                backward_ms=r.backward_ms * a,
                host_step_ms=r.host_step_ms * a,
            )
            for r, (a, _) in zip(rows, scale, strict=True)
        ]
        F = [r.forward_ms for r in rows]
        Bk = [r.backward_ms for r in rows]
        period = [p * beta for p, (_, beta) in zip(period, scale, strict=True)]
    AR = [r.allreduce_ms + r.host_step_ms for r in rows]
    L, tw, ts, te, Q = latency_from_stages(F, Bk, AR, M, period)
    fits = all(r.memory_bytes <= cluster.device_memory_bytes for r in rows)
    return LatencyBreakdown(
        L_ms=L,
        T_w_ms=tw,
        T_s_ms=ts,
        T_e_ms=te,
        Q=Q,
        S=len(rows),
        stages=tuple(rows),
        fits_memory=fits,
    )


def _periods(
    F: Sequence[float], B: Sequence[float], rows: Sequence[StageCost], schedule: str
) -> list[float]:
    """Steady period per stage: ``max(F_s + B_s, RT_s / K_s)`` (Little's law, module docstring)."""
    S = len(F)
    out = [F[s] + B[s] for s in range(S)]
    if schedule == "gpipe":
        return out
    rt = 0.0
    for s in range(S - 1, -1, -1):
        rt += F[s] + B[s]
        k = rows[s].in_flight
        if rows[s].kind == "compute" and k > 0:
            out[s] = max(out[s], rt / k)
    return out


def _slice_demand(
    profile: ModelProfile, cluster: Cluster, stage: StagePlan, b: int, extra_ms: float = 0.0
) -> list[tuple[int, float]]:
    """``(device, F + B of its slice + extra_ms)`` of every replica (B with re-computation).

    ``extra_ms``: the stage's host CPU per micro-batch (:meth:`HostExtra.per_mb`).
    """
    out = []
    for d, n in zip(stage.devices, split_sizes(b, stage.replicas), strict=True):
        f, bw = compute_ms(profile, cluster, stage.layers, n, recompute=stage.recompute)
        out.append((d, f + bw + extra_ms))
    return out
