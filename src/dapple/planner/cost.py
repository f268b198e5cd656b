"""DAPPLE cost model: stage compute, comm stages, AllReduce, memory and pipeline latency L.

Pure functions (no torch) over :class:`ModelProfile`, :class:`Cluster` and :class:`Plan`,
following the paper's section 5.1. Notation: S stages *including* the communication stages
inserted between computation stages, M micro-batches of b samples, F_s/B_s forward/backward
time of stage s for one micro-batch, AR(P_s, g_s) the gradient AllReduce of stage s's
parameters P_s over its device set g_s, K_i the micro-batches computation stage i keeps in
flight, Q the pivot stage (equation 3).

:func:`pipeline_latency` builds the per-stage arrays of a :class:`Plan` and evaluates them with
the one kernel of equations 1-3, :func:`dapple.planner.latency.latency`, which the planner's
:class:`~dapple.planner.evaluate.Scorer` calls too. Design choices beyond the paper, each
documented where used:

* A micro-batch is split over the r_s replicas of a stage with
  :func:`dapple.core.plan.split_sizes`; F_s/B_s are those of the largest (first) slice, the
  slowest replica.
* Comm stages and AllReduce share a server's network interface (:mod:`dapple.planner.comm`).
* Steady phase with bounded in-flight micro-batches: the per-micro-batch period of stage s is
  ``max(F_s + B_s, RT_s / K_s)`` (:func:`dapple.planner.latency.steady_periods`), which
  reduces to the paper's ``F_s + B_s`` when memory is ample.
* CPU hosts (runtime overheads per action, step and MiB; compute cores shared by a server's
  devices): a separate pass, :func:`dapple.planner.host.apply_host`, only when the cluster
  has those terms (:func:`dapple.planner.host.has_host_terms`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan, split_sizes
from dapple.core.profile import ModelProfile
from dapple.planner.comm import (
    allreduce_ms,
    busiest_link_ms,
    comm_stage_ms,
    link_loads,
    overlaps,
    stage_sync_ms,
    stage_update_ms,
    transfer_ms,
)
from dapple.planner.host import apply_host, has_host_terms, stage_host_extras
from dapple.planner.latency import Latency, latency, steady_periods
from dapple.planner.lengths import profile_for_plan
from dapple.planner.memory import (
    boundary_bytes,
    device_memory_bytes,
    device_state_bytes,
    held_activation_bytes,
    in_flight_options,
    parameter_state_bytes,
    weight_cast_bytes,
    zero_saved_bytes,
)
from dapple.planner.sharing import shared_compute_scale, slice_work
from dapple.schedule.generators import in_flight_counts

__all__ = [
    "Latency",
    "LatencyBreakdown",
    "StageCost",
    "allreduce_ms",
    "boundary_bytes",
    "busiest_link_ms",
    "comm_stage_ms",
    "compute_ms",
    "device_memory_bytes",
    "device_state_bytes",
    "held_activation_bytes",
    "in_flight_options",
    "latency",
    "link_loads",
    "overlaps",
    "parameter_state_bytes",
    "pipeline_latency",
    "shared_compute_scale",
    "stage_compute_ms",
    "stage_sync_ms",
    "steady_periods",
    "transfer_ms",
    "weight_cast_bytes",
    "zero_saved_bytes",
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
    """AR(P_s, g_s) (ZeRO's reductions and gathers instead under a zero stage) plus the
    optimizer update U_s when the profile measured one (:func:`~dapple.planner.comm.
    stage_update_ms`); 0 for comm stages."""
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
    """Every replica fits ``cluster.usable_memory_bytes``."""

    @property
    def pivot(self) -> StageCost:
        """The row of stage Q."""
        return self.stages[self.Q]


def pipeline_latency(
    plan: Plan, profile: ModelProfile, cluster: Cluster, zero_stage: int = 0
) -> LatencyBreakdown:
    """L of ``plan`` under the cost model (equations 1-3), with per-stage rows and memory.

    Builds F_s, B_s, AR_s and the in-flight bound K_s of every stage (a comm stage between
    each two computation stages), runs the CPU-host pass when the cluster has host terms,
    and evaluates :func:`dapple.planner.latency.latency`.

    Args:
        plan: the plan (stages, M, b, schedule, policy, max_in_flight).
        profile: the model profile it was made for.
        cluster: the cluster it runs on.
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2): less memory, AR_s as
            :func:`dapple.planner.comm.stage_sync_ms`. A stage's own ``StagePlan.zero_stage``
            applies when larger.

    A plan made for sequence lengths (``plan.seq_len``) is costed at them when the profile was
    measured at several (:func:`dapple.planner.lengths.profile_for_plan`).
    """
    profile = profile_for_plan(profile, plan)
    b, M = plan.micro_batch_size, plan.num_micro_batches
    ks = in_flight_counts(
        plan.schedule, plan.num_stages, M, plan.policy, [st.max_in_flight for st in plan.stages]
    )
    bounded = plan.schedule == "dapple"  # GPipe's steady phase is not in-flight bound
    kinds: list[str] = []  # per stage s: "compute" or "comm"
    index: list[int] = []  # computation stage index (comm: the stage before the cut)
    F: list[float] = []
    B: list[float] = []
    AR: list[float] = []
    K: list[int | None] = []
    for i, st in enumerate(plan.stages):
        if i > 0:
            cf, cb = comm_stage_ms(profile, cluster, plan.stages[i - 1], st, b)
            kinds.append("comm")
            index.append(i - 1)
            F.append(cf)
            B.append(cb)
            AR.append(0.0)
            K.append(None)
        f, bw = stage_compute_ms(profile, cluster, st, b)
        s0, e0 = st.layers
        grad_bytes = float(sum(layer.parameter_bytes for layer in profile.layers[s0:e0]))
        kinds.append("compute")
        index.append(i)
        F.append(f)
        B.append(bw)
        z = max(zero_stage, st.zero_stage)
        AR.append(
            stage_sync_ms(cluster, grad_bytes, st.devices, z, plan.num_micro_batches)
            + stage_update_ms(cluster, profile, grad_bytes, st.replicas, z)
        )
        K.append(ks[i] if bounded else None)
    step = [0.0] * len(F)
    if has_host_terms(cluster):
        extras = stage_host_extras(
            profile, cluster, [(*st.layers, st.replicas) for st in plan.stages], b
        )

        def work(s: int) -> list[tuple[int, float]]:
            st = plan.stages[index[s]]
            return slice_work(
                st.devices, b, lambda n: compute_ms(profile, cluster, st.layers, n), st.recompute
            )

        h = apply_host(
            F,
            B,
            AR,
            K,
            M,
            cluster,
            [extras[i] if k == "compute" else None for k, i in zip(kinds, index, strict=True)],
            work,
        )
        lat = latency(h.F, h.B, h.AR, M, h.period)
        F, B, step = h.F, h.B, h.step
    else:
        lat = latency(F, B, AR, M, steady_periods(F, B, K))
    rows = tuple(
        StageCost(
            kind=kinds[s],
            index=index[s],
            forward_ms=F[s],
            backward_ms=B[s],
            allreduce_ms=AR[s],
            host_step_ms=step[s],
            memory_bytes=(
                device_memory_bytes(
                    profile,
                    plan.stages[index[s]],
                    b,
                    ks[index[s]],
                    max(zero_stage, plan.stages[index[s]].zero_stage),
                )
                if kinds[s] == "compute"
                else 0.0
            ),
            in_flight=ks[index[s]] if kinds[s] == "compute" else 0,
        )
        for s in range(len(F))
    )
    return LatencyBreakdown(
        L_ms=lat.L_ms,
        T_w_ms=lat.T_w_ms,
        T_s_ms=lat.T_s_ms,
        T_e_ms=lat.T_e_ms,
        Q=lat.Q,
        S=len(rows),
        stages=rows,
        fits_memory=all(r.memory_bytes <= cluster.usable_memory_bytes for r in rows),
    )
