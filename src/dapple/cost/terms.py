"""A plan's cost terms, assembled once: what L, the schedules' step times and the simulator read.

Two assemblies, each the only one of its kind:

* :func:`stage_terms` - every term of a :class:`~dapple.core.plan.Plan`. Per computation stage:
  F, B and the split backward's I, W of each replica's slice (:mod:`dapple.cost.compute`; from
  its device kind's own profile where it has one, :mod:`dapple.core.kind_profiles`), the
  host CPU extras of each replica (:mod:`dapple.cost.host`; CPU-time inputs as wall time,
  :mod:`dapple.cost.cpu_clock`), AR(P_s, g_s), the synchronisation
  under the stage's zero stage and the optimizer update U_s (:mod:`dapple.cost.comm`). Per stage
  boundary: the comm stage (split-concat over the busiest link) and every slice transfer.
  :func:`dapple.cost.pipeline.pipeline_latency`, :func:`dapple.cost.schedule_step.schedule_latency`
  and the simulator (:func:`dapple.simulate.engine.simulate`) take their numbers from it.
* :func:`pipeline_terms` - the per-stage arrays of equations 1-3 over all S stages (a comm
  stage between each two computation stages), after the CPU-host pass
  (:func:`dapple.cost.host.apply_host`) where the cluster has host terms. It reads one
  :class:`StageTerms` per computation stage: a plan's (:meth:`PlanTerms.pipeline`), or those
  the planner's :class:`~dapple.planner.scorer.Scorer` builds from its cached prefix sums.

Notation: S stages including the comm stages (index s), M micro-batches of b samples, F_s/B_s
the forward/backward time of stage s for one micro-batch, AR(P_s, g_s) the gradient AllReduce
of its parameters P_s over its devices g_s, U_s its optimizer update, K_i the micro-batches
computation stage i keeps in flight. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dapple.core.cluster import Cluster
from dapple.core.kind_profiles import profile_of
from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan, StagePlan, transfers
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import check_tensor_groups
from dapple.cost.at_length import profile_for_plan
from dapple.cost.comm import (
    allreduce_ms,
    comm_stage_ms,
    shared_samples,
    stage_update_ms,
    transfer_ms,
)
from dapple.cost.compute import compute_ms, split_backward_ms
from dapple.cost.cpu_clock import on_wall_clock
from dapple.cost.host import HostExtra, apply_host, has_host_terms, host_extras, slowest_extra
from dapple.cost.latency import Latency, cycle_paced, latency, steady_periods
from dapple.cost.memory import boundary_bytes, sharded_layer_bytes, sharded_parameter_bytes
from dapple.cost.moe import (
    check_expert_stage,
    expert_slice_times,
    expert_stage_sync_ms,
    stage_rank_parameter_bytes,
)
from dapple.cost.overlap import NO_OVERLAP, CommOverlap, exposed_fsdp_pass_ms, exposed_sync_ms
from dapple.cost.replica_shares import at_speeds
from dapple.cost.sharing import slice_work
from dapple.cost.tensor import (
    fsdp_pass_ms,
    replica_sync_ms,
    tensor_compute_ms,
    tensor_split_backward_ms,
)

__all__ = [
    "BoundaryTerms",
    "PipelineTerms",
    "PlanStageTerms",
    "PlanTerms",
    "ReplicaTerms",
    "StageTerms",
    "TransferTerms",
    "pipeline_terms",
    "stage_terms",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTerms:
    """What equations 1-3 read of one computation stage."""

    forward_ms: float
    """F_s: the slowest replica's (the largest slice: ``split_sizes(b, r_s)[0]``; on a cluster
    with device kinds the largest F + B of a share over its device's speed), without host CPU."""
    backward_ms: float
    """B_s of that slice, re-computation included."""
    sync_ms: float
    """AR(P_s, g_s), or ZeRO's reductions and gathers under the stage's zero stage
    (:func:`~dapple.cost.comm.stage_sync_ms`)."""
    update_ms: float = 0.0
    """U_s, the optimizer update after the synchronisation
    (:func:`~dapple.cost.comm.stage_update_ms`)."""
    work: tuple[tuple[int, float], ...] = ()
    """``(device, w_d)`` per replica, w_d the F + B of its own slice without host CPU
    (:func:`~dapple.cost.sharing.slice_work`); at expert width e_s > 1 its whole F + B, the
    all-to-alls included (the simulator shares F and B as a whole). Filled only on shared compute
    cores, the one case the CPU-host pass reads it."""


class PipelineTerms(NamedTuple):
    """The per-stage arrays of equations 1-3 over all S stages (comm stages included), as
    :func:`pipeline_terms` assembled them (a named tuple, as cheap to build as the arrays: the
    planner's scorer builds one per candidate)."""

    M: int
    F: Sequence[float]
    """F_s with the host CPU extra, stretched on shared compute cores."""
    B: Sequence[float]
    """B_s likewise."""
    AR: Sequence[float]
    """AR_s + U_s (0 for comm stages), without host CPU."""
    host_step: Sequence[float]
    """Host CPU once per step after the last backward (0 without host terms)."""
    ending: Sequence[float]
    """What stage s does once after its last backward: AR_s + U_s + its host step."""
    period: Sequence[float]
    """Steady period per micro-batch (:func:`~dapple.cost.latency.steady_periods`)."""
    paced: Sequence[bool] = ()
    """Whether a cycle of its in-flight limit paces the stage
    (:func:`~dapple.cost.latency.cycle_paced`)."""
    K: Sequence[int | None] = ()
    """K_s per stage (None for comm stages and unbounded ones; empty: not given)."""

    def latency(self) -> Latency:
        """L = T_w + T_s + T_e and the pivot Q (equations 1-3,
        :func:`~dapple.cost.latency.latency`)."""
        return latency(self.F, self.B, self.ending, self.M, self.period, self.paced, self.K)


def pipeline_terms(
    stages: Sequence[StageTerms],
    comm_ms: Sequence[float],
    in_flight: Sequence[int | None],
    M: int,
    cluster: Cluster,
    host: Sequence[HostExtra] | None = None,
) -> PipelineTerms:
    """The arrays of equations 1-3: a comm stage between each two computation stages, then the
    CPU-host pass when ``host`` is given.

    Args:
        stages: per computation stage i, its :class:`StageTerms`.
        comm_ms: per boundary i|i+1, the comm stage's time, its F and its B alike (gradients
            take the same links back).
        in_flight: K_i per computation stage, bounding its steady period; None: unbounded (the
            GPipe schedule, whose forwards all run before its backwards).
        M: micro-batches.
        cluster: the host terms and the shared compute capacity.
        host: per computation stage the host CPU extras of its slowest replica
            (:func:`~dapple.cost.host.stage_host_extras`): runs the CPU-host pass
            (:func:`~dapple.cost.host.apply_host`); None (dedicated devices): no pass.
    """
    F: list[float] = []
    B: list[float] = []
    AR: list[float] = []
    K: list[int | None] = []
    for i, st in enumerate(stages):
        if i > 0:
            c = comm_ms[i - 1]
            F.append(c)
            B.append(c)
            AR.append(0.0)
            K.append(None)
        F.append(st.forward_ms)
        B.append(st.backward_ms)
        AR.append(st.sync_ms + st.update_ms)
        K.append(in_flight[i])
    if host is None:
        period = steady_periods(F, B, K, M)
        paced = cycle_paced(F, B, K, M, period)
        return PipelineTerms(M, F, B, AR, [0.0] * len(F), AR, period, paced, K)
    h = apply_host(
        F,
        B,
        AR,
        K,
        M,
        cluster,
        [None if x % 2 else host[x // 2] for x in range(len(F))],
        lambda x: list(stages[x // 2].work),
    )
    return PipelineTerms(M, h.F, h.B, AR, h.step, h.AR, h.period, h.paced, K)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaTerms:
    """One replica's slice of a micro-batch on a computation stage."""

    device: int
    samples: int
    """Its slice of the micro-batch (:meth:`~dapple.core.plan.StagePlan.slice_sizes`)."""
    forward_ms: float
    backward_ms: float
    """Re-computation included."""
    input_grad_ms: float
    """I of the split backward (ZB-H1), the re-computed forward included."""
    weight_grad_ms: float
    """W of the split backward."""
    host: HostExtra
    """Host CPU extras (:func:`~dapple.cost.host.host_extras`; zero without host terms)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStageTerms:
    """Every term of one computation stage of a plan."""

    terms: StageTerms
    """What equations 1-3 read (its slowest replica's slice, AR_s under its zero stage, U_s)."""
    replicas: tuple[ReplicaTerms, ...]
    parameter_bytes: int
    """P_s, the gradient bytes AR(P_s, g_s) reduces."""
    allreduce_ms: float
    """AR(P_s, g_s) of the unsharded gradients (:func:`~dapple.cost.comm.allreduce_ms`)."""
    host: HostExtra | None
    """The largest host CPU extras over its replicas (the slowest paces the stage); None on a
    cluster without host terms (:func:`~dapple.cost.host.has_host_terms`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferTerms:
    """One slice overlap crossing a stage boundary (split-concat,
    :func:`~dapple.core.plan.transfers`)."""

    src_replica: int
    dst_replica: int
    samples: int
    nbytes: float
    """Activations (and, backwards, their gradients) of ``samples`` samples at the cut."""
    forward_ms: float
    """Activations from the source replica's device to the destination's, sharing its ports
    with every slice through them (:func:`~dapple.cost.comm.shared_samples`): a sender's own
    slices take turns on its way out in the simulator, each its part of the port's load."""
    backward_ms: float
    """Gradients back from the destination replica's device to the source's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryTerms:
    """The cut between computation stages i and i+1."""

    comm_ms: float
    """The comm stage's F (= B): the busiest link of the split-concat
    (:func:`~dapple.cost.comm.comm_stage_ms`)."""
    transfers: tuple[TransferTerms, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTerms:
    """Every cost term of a plan (:func:`stage_terms`)."""

    plan: Plan
    profile: ModelProfile
    """The profile at the plan's lengths (:func:`~dapple.cost.at_length.profile_for_plan`)."""
    cluster: Cluster
    zero_stage: int
    """The zero stage given to :func:`stage_terms`; a stage's own applies when larger."""
    stages: tuple[PlanStageTerms, ...]
    """Per computation stage."""
    boundaries: tuple[BoundaryTerms, ...]
    """Per boundary i|i+1 between computation stages."""

    def pipeline(self, in_flight: Sequence[int | None]) -> PipelineTerms:
        """The arrays of equations 1-3 (:func:`pipeline_terms`) with K_i = ``in_flight[i]``."""
        host = [st.host for st in self.stages if st.host is not None]
        return pipeline_terms(
            [st.terms for st in self.stages],
            [x.comm_ms for x in self.boundaries],
            in_flight,
            self.plan.num_micro_batches,
            self.cluster,
            host if has_host_terms(self.cluster) else None,
        )


def stage_terms(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    zero_stage: int = 0,
    overlap: CommOverlap = NO_OVERLAP,
) -> PlanTerms:
    """Every cost term of ``plan`` (module docstring), once.

    Args:
        plan: stages, replicas, devices, b and M.
        profile: the model profile; a plan made for sequence lengths (``plan.mean_seq_len``) is
            costed at them (:func:`~dapple.cost.at_length.profile_for_plan`).
        cluster: devices, links and host terms.
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2), with AR_s as :func:`~dapple.cost.comm.stage_sync_ms`. A
            stage's own ``StagePlan.zero_stage`` applies when larger.
        overlap: the data-parallel and ZeRO traffic the training framework hides under
            compute (:mod:`dapple.cost.overlap`); :data:`~dapple.cost.overlap.NO_OVERLAP`
            (dapple's runtime, the default): none, every byte on the critical path.

    Raises:
        ValidationError: a tensor group of the plan spans servers
            (:func:`~dapple.core.tensor_layout.check_tensor_groups`).
    """
    check_tensor_groups(plan, cluster)
    profile = profile_for_plan(profile, plan)
    cluster = on_wall_clock(profile, cluster)  # CPU-time inputs as a lone device's wall time
    b = plan.micro_batch_size
    extras = host_extras(
        profile,
        cluster,
        [(*st.layers, st.replicas) for st in plan.stages],
        b,
        [st.shares for st in plan.stages],
    )
    stages = tuple(
        _stage_terms(
            plan, profile, cluster, st, st.parallel.floored(zero_stage), extras[i], overlap
        )
        for i, st in enumerate(plan.stages)
    )
    boundaries = tuple(
        _boundary_terms(profile, cluster, plan.stages[i], plan.stages[i + 1], b)
        for i in range(plan.num_stages - 1)
    )
    return PlanTerms(
        plan=plan,
        profile=profile,
        cluster=cluster,
        zero_stage=zero_stage,
        stages=stages,
        boundaries=boundaries,
    )


def _stage_terms(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    st: StagePlan,
    par: Parallelism,
    extras: Sequence[HostExtra],
    overlap: CommOverlap = NO_OVERLAP,
) -> PlanStageTerms:
    """The terms of computation stage ``st`` of ``plan`` laid out as ``par`` (its own layout
    under the run's ZeRO floor), with the traffic ``overlap`` leaves exposed."""
    b, M = plan.micro_batch_size, plan.num_micro_batches
    sizes = st.slice_sizes(b)
    t = st.tensor_width
    s0, e0 = st.layers
    pbytes = sum(layer.parameter_bytes for layer in profile.layers[s0:e0])
    tp = st.parallel.tensor_parallel
    grad_bytes = sharded_parameter_bytes(profile, st.layers, t) if tp else float(pbytes)
    check_expert_stage(profile, st, par)
    owns = [profile_of(cluster, d, profile) for d in st.replica_devices]  # a kind's own, if any
    times = {}
    for p in {id(x): x for x in owns}.values():
        ts = {
            n: _slice_times(p, cluster, st, n, grad_bytes, overlap)
            for n in sorted({n for x, n in zip(owns, sizes, strict=True) if x is p})
        }
        if st.parallel.expert_parallel:  # the all-to-alls and the experts' sharded compute
            ts = expert_slice_times(p, cluster, st, ts, max(sizes))
        times.update({(id(p), n): v for n, v in ts.items()})
    if par.expert_parallel and not par.shards_optimizer:  # the experts' sharded state (cost.moe)
        grad_bytes = stage_rank_parameter_bytes(profile, st.layers, st.expert_width)
    # under ZeRO-1/2 each replica updates (P_dense + P_experts) / r_s at any e_s: grad_bytes / r_s
    replicas = tuple(
        ReplicaTerms(
            device=d,
            samples=n,
            forward_ms=times[id(p), n][0][0],
            backward_ms=times[id(p), n][0][1],
            input_grad_ms=times[id(p), n][1][0],
            weight_grad_ms=times[id(p), n][1][1],
            host=x,
        )
        for d, p, n, x in zip(st.replica_devices, owns, sizes, extras, strict=True)
    )
    if cluster.kinds:  # devices of other speeds than the profile's
        replicas = at_speeds(replicas, [cluster.speed_of(x.device) for x in replicas])
    work = (
        tuple((x.device, x.forward_ms + x.backward_ms) for x in replicas)
        if st.parallel.expert_parallel and cluster.compute_cores_per_server is not None
        # the exchange runs inside F and B, shared like compute as the simulator shares it
        else tuple(
            (d, w)
            for j, (_lead, w) in enumerate(
                slice_work(
                    st.replica_devices,
                    b,
                    lambda n: _compute(profile, cluster, st.layers, n, t),
                    bool(st.recompute),
                    st.shares,
                )
            )
            for d in st.tensor_group(j)
        )
        if cluster.compute_cores_per_server is not None
        else ()
    )
    sync = (
        expert_stage_sync_ms(profile, cluster, st, par.gradient_reductions(M))
        if par.expert_parallel
        else replica_sync_ms(cluster, grad_bytes, st, par, M)
    )
    if overlap.any and sync > 0:
        fwd, bwd, nbytes = _layer_times(profile, cluster, st, max(sizes))
        sync = exposed_sync_ms(overlap, sync, par, M, fwd, bwd, nbytes)
    slowest = max(replicas, key=lambda x: x.forward_ms + x.backward_ms)  # the first slowest
    terms = StageTerms(
        forward_ms=slowest.forward_ms,
        backward_ms=slowest.backward_ms,
        sync_ms=sync,
        update_ms=stage_update_ms(cluster, profile, grad_bytes, par),
        work=work,
    )
    return PlanStageTerms(
        terms=terms,
        replicas=replicas,
        parameter_bytes=pbytes,
        allreduce_ms=allreduce_ms(cluster, pbytes, st.devices)
        if not tp
        else replica_sync_ms(cluster, grad_bytes, st, par.unsharded(), M),
        host=slowest_extra(extras) if has_host_terms(cluster) else None,
    )


def _compute(
    profile: ModelProfile, cluster: Cluster, layers: tuple[int, int], n: int, t: int
) -> tuple[float, float]:
    """F, B of layers on n samples on one rank of a width-t tensor group, no re-computation."""
    if t == 1:
        return compute_ms(profile, cluster, layers, n)
    return tensor_compute_ms(profile, cluster, layers, n, t)


def _layer_times(
    profile: ModelProfile, cluster: Cluster, st: StagePlan, n: int
) -> tuple[list[float], list[float], list[float]]:
    """Per layer of stage ``st`` on n samples of one tensor rank: F, B (re-computation
    included) and the gradient bytes, in layer order: what :mod:`dapple.cost.overlap` hides
    traffic under."""
    t = st.tensor_width
    fwd: list[float] = []
    bwd: list[float] = []
    nbytes: list[float] = []
    for i in range(*st.layers):
        f, b = _compute(profile, cluster, (i, i + 1), n, t)
        fwd.append(f)
        bwd.append(b + (f if st.recompute else 0.0))
        nbytes.append(sharded_layer_bytes(profile.layers[i], t))
    return fwd, bwd, nbytes


def _slice_times(
    profile: ModelProfile,
    cluster: Cluster,
    st: StagePlan,
    n: int,
    grad_bytes: float,
    overlap: CommOverlap = NO_OVERLAP,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((F, B), (I, W))`` of one replica's slice of n samples on stage ``st``: the paper's
    (:mod:`dapple.cost.compute`) at t_s = 1, else one tensor rank's
    (:mod:`dapple.cost.tensor`), plus ZeRO-3's per-micro-batch gathers when it re-gathers
    (:func:`~dapple.cost.tensor.fsdp_pass_ms`: the all-gather in F and I, the reduce-scatter in
    W); the part ``overlap`` leaves exposed, :func:`~dapple.cost.overlap.exposed_fsdp_pass_ms`,
    when it hides any)."""
    t, rc = st.tensor_width, bool(st.recompute)
    if not st.parallel.tensor_parallel and not st.regather:
        return (
            compute_ms(profile, cluster, st.layers, n, recompute=rc),
            split_backward_ms(profile, cluster, st.layers, n, recompute=rc),
        )
    f, b = tensor_compute_ms(profile, cluster, st.layers, n, t, recompute=rc)
    i, w = tensor_split_backward_ms(profile, cluster, st.layers, n, t, recompute=rc)
    ag, ag_rs = fsdp_pass_ms(cluster, grad_bytes, st) if n > 0 else (0.0, 0.0)
    if overlap.any and ag_rs > 0:
        fwd, bwd, nbytes = _layer_times(profile, cluster, st, n)
        ag, ag_rs = exposed_fsdp_pass_ms(overlap, ag, ag_rs - ag, fwd, bwd, nbytes)
        return (f + ag, b + ag_rs), (i + ag, w + max(0.0, ag_rs - ag))
    return (f + ag, b + ag_rs), (i + ag, w + ag_rs - ag)


def _boundary_terms(
    profile: ModelProfile, cluster: Cluster, src: StagePlan, dst: StagePlan, b: int
) -> BoundaryTerms:
    """The comm stage and the slice transfers across the cut between ``src`` and ``dst``.

    The slices of one micro-batch cross the cut at once: a slice shares its ports with the
    other senders' slices (:func:`~dapple.cost.comm.shared_samples`), forwards from the
    replicas before the cut and gradients back from those after it."""
    rows = []
    a, c = src.replica_devices, dst.replica_devices
    cut = transfers(b, src.replicas, dst.replicas, src.shares, dst.shares)
    fwd = shared_samples(cluster, [(a[j], c[k], hi - lo) for j, k, lo, hi in cut])
    bwd = shared_samples(cluster, [(c[k], a[j], hi - lo) for j, k, lo, hi in cut])
    for (j, k, lo, hi), f, g in zip(cut, fwd, bwd, strict=True):
        nbytes = float(boundary_bytes(profile, dst.layers[0], hi - lo))
        per_sample = nbytes / (hi - lo)  # transfers() yields only non-empty overlaps
        rows.append(
            TransferTerms(
                src_replica=j,
                dst_replica=k,
                samples=hi - lo,
                nbytes=nbytes,
                forward_ms=transfer_ms(cluster, per_sample * f, a[j], c[k]),
                backward_ms=transfer_ms(cluster, per_sample * g, c[k], a[j]),
            )
        )
    comm, _ = comm_stage_ms(profile, cluster, src, dst, b)
    return BoundaryTerms(comm_ms=comm, transfers=tuple(rows))
