"""Pipeline latency L of a GPipe or DAPPLE plan (paper section 5.1, equations 1-3), per stage.

:func:`pipeline_latency` reads a plan's terms (:func:`dapple.cost.terms.stage_terms`), evaluates
L over the arrays of :meth:`PlanTerms.pipeline <dapple.cost.terms.PlanTerms.pipeline>` and lists
every stage (comm stages included) with its memory. Design choices beyond the paper, each
documented where used:

* A micro-batch is split over the r_s replicas of a stage with
  :func:`dapple.core.plan.split_sizes` (evenly, or by the stage's shares); F_s/B_s are those of
  the slowest replica (:attr:`dapple.cost.terms.StageTerms.forward_ms`). On a cluster with
  device kinds each replica's slice is held in its own kind's memory (:func:`_fits_kinds`).
* Comm stages and AllReduce share a server's network interface (:mod:`dapple.cost.comm`).
* Steady phase with bounded in-flight micro-batches: the per-micro-batch period of stage s is
  the slowest cycle of its early-backward order, ``max(F_s + B_s, RT(s..t) / (K_s - K_t +
  1))`` over the stages t after it (:func:`dapple.cost.latency.steady_periods`), which
  reduces to the paper's ``F_s + B_s`` when memory is ample.
* CPU hosts (runtime overheads per action, step and MiB; compute cores shared by a server's
  devices): a separate pass, :func:`dapple.cost.host.apply_host`, only when the cluster
  has those terms (:func:`dapple.cost.host.has_host_terms`).

Pure, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.peak_memory import stage_peak
from dapple.cost.terms import PlanTerms, stage_terms
from dapple.schedule.registry import get_schedule, in_flight_counts

__all__ = [
    "LatencyBreakdown",
    "StageCost",
    "in_flight_bounds",
    "latency_breakdown",
    "pipeline_latency",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCost:
    """One row of the latency breakdown: a computation stage or a comm stage."""

    kind: str
    """``compute`` or ``comm``."""
    index: int
    """Computation stage index (for comm stages: the stage before the cut)."""
    forward_ms: float
    """F_s for one micro-batch (with its host CPU extra, :mod:`dapple.cost.host`)."""
    backward_ms: float
    """B_s for one micro-batch (includes re-computation and the host CPU extra)."""
    allreduce_ms: float
    """AR(P_s, g_s) (ZeRO's reductions and gathers instead under a zero stage) plus the
    optimizer update U_s when the profile measured one (:func:`~dapple.cost.comm.
    stage_update_ms`); 0 for comm stages."""
    host_step_ms: float = 0.0
    """Host CPU once per step after the last backward (:mod:`dapple.cost.host`), added to
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
    fits_memory: bool
    """Every replica fits ``cluster.usable_memory_bytes``; on a cluster with device kinds, its
    share fits its own kind's (:meth:`~dapple.core.cluster.Cluster.usable_memory_of`)."""

    @property
    def pivot(self) -> StageCost:
        """The row of stage Q."""
        return self.stages[self.Q]


def in_flight_bounds(plan: Plan) -> tuple[list[int], list[int | None]]:
    """``(K_i, bound_i)`` per computation stage: the micro-batches stage i keeps in flight
    under the plan's schedule (its memory rule, :func:`~dapple.schedule.registry.in_flight_counts`)
    and the bound they put on its steady period (K_i for a ``bounded`` schedule, DAPPLE; None
    for the others, e.g. GPipe, whose steady phase is not in-flight bound).

    Raises:
        ValidationError: a schedule without per-stage counts (interleaved), or a bad policy.
    """
    ks = in_flight_counts(
        plan.schedule,
        plan.num_stages,
        plan.num_micro_batches,
        plan.policy,
        [st.max_in_flight for st in plan.stages],
    )
    bounded = get_schedule(plan.schedule).bounded
    return ks, [k if bounded else None for k in ks]


def latency_breakdown(terms: PlanTerms) -> LatencyBreakdown:
    """L of the plan of ``terms`` (equations 1-3), with per-stage rows and memory.

    Raises:
        ValidationError: the plan's schedule has no per-stage in-flight counts
            (:func:`in_flight_bounds`).
    """
    plan, profile = terms.plan, terms.profile
    ks, bounds = in_flight_bounds(plan)
    pipe = terms.pipeline(bounds)
    lat = pipe.latency()
    rows: list[StageCost] = []
    for s in range(len(pipe.F)):
        i = s // 2  # computation stage, or for a comm stage the one before the cut
        compute = s % 2 == 0
        st = plan.stages[i]
        rows.append(
            StageCost(
                kind="compute" if compute else "comm",
                index=i,
                forward_ms=pipe.F[s],
                backward_ms=pipe.B[s],
                allreduce_ms=pipe.AR[s],
                host_step_ms=pipe.host_step[s],
                memory_bytes=(
                    stage_peak(
                        profile,
                        st,
                        plan.micro_batch_size,
                        ks[i],
                        plan.num_micro_batches,
                        terms.zero_stage,
                    ).peak
                    if compute
                    else 0.0
                ),
                in_flight=ks[i] if compute else 0,
            )
        )
    return LatencyBreakdown(
        L_ms=lat.L_ms,
        T_w_ms=lat.T_w_ms,
        T_s_ms=lat.T_s_ms,
        T_e_ms=lat.T_e_ms,
        Q=lat.Q,
        S=len(rows),
        stages=tuple(rows),
        fits_memory=(
            _fits_kinds(terms, ks)
            if terms.cluster.kinds
            else all(r.memory_bytes <= terms.cluster.usable_memory_bytes for r in rows)
        ),
    )


def _fits_kinds(terms: PlanTerms, ks: list[int]) -> bool:
    """Whether every replica's peak (:func:`~dapple.cost.peak_memory.stage_peak` of its slice,
    K_i in flight) fits its device kind's usable memory."""
    plan, cl, b = terms.plan, terms.cluster, terms.plan.micro_batch_size
    for st, k in zip(plan.stages, ks, strict=True):
        held = {
            (n, cl.usable_memory_of(d))
            for d, n in zip(st.replica_devices, st.slice_sizes(b), strict=True)
        }
        for n, usable in held:
            peak = stage_peak(
                terms.profile, st, b, k, plan.num_micro_batches, terms.zero_stage, samples=n
            )
            if peak.peak > usable:
                return False
    return True


def pipeline_latency(
    plan: Plan, profile: ModelProfile, cluster: Cluster, zero_stage: int = 0
) -> LatencyBreakdown:
    """L of ``plan`` under the cost model (equations 1-3), with per-stage rows and memory.

    Reads the plan's F_s, B_s, AR_s (:func:`~dapple.cost.terms.stage_terms`) and the in-flight
    bound K_s of every stage (:func:`in_flight_bounds`), runs the CPU-host pass when the
    cluster has host terms, and evaluates :func:`dapple.cost.latency.latency`
    (:func:`latency_breakdown`).

    Args:
        plan: the plan (stages, M, b, schedule, policy, max_in_flight).
        profile: the model profile it was made for.
        cluster: the cluster it runs on.
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2): less memory, AR_s as
            :func:`dapple.cost.comm.stage_sync_ms`. A stage's own ``StagePlan.zero_stage``
            applies when larger.

    A plan made for sequence lengths (``plan.mean_seq_len``) is costed at them when the profile was
    measured at several (:func:`dapple.cost.at_length.profile_for_plan`).

    Raises:
        ValidationError: the plan's schedule has no per-stage in-flight counts (interleaved).
    """
    return latency_breakdown(stage_terms(plan, profile, cluster, zero_stage))
