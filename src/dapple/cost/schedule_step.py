"""The step time of a plan under its schedule, and memory by replaying its compute order.

Pure, no torch. :func:`schedule_step_ms` asks the schedule registry
(:func:`dapple.schedule.registry.get_schedule`): a schedule without a step rule of its own
(GPipe, DAPPLE) keeps the paper's latency L (equations 1-3,
:func:`dapple.cost.pipeline.pipeline_latency`) over its in-flight counts K_i; one with a rule
(interleaved 1F1B, ZB-H1, ZB-V, DualPipeV: :func:`dapple.schedule.replay.replayed_step_ms`, the
longest path through their compute order) gets the plan's terms as
:class:`~dapple.schedule.spec.StepTerms`: the compute order, each stage's F, B, I and W with
their host CPU extras (the slowest replica's slice, :func:`dapple.cost.terms.stage_terms`), each
boundary's transfers one way and back (what a source replica pushes through its way out, and the
link latency), each device group's tail (its replicated stages' synchronisation and its
optimizer step, the part after the step point) and the step point of the run's non-finite mode
(the step's collective that every group waits for, or none: ``on_nonfinite`` off). The replay
touches every action, so :func:`schedule_step_ms` refuses more than
:data:`MAX_REPLAYED_ACTIONS` of them before it builds the order.

Memory: :func:`device_memory_by_group` replays a plan's compute order and returns each device
group's step peak (:mod:`dapple.cost.peak_memory`), whatever the schedule;
:func:`activation_peak_bytes` its activations alone.
"""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.at_length import profile_for_plan
from dapple.cost.memory import held_activation_bytes
from dapple.cost.overlap import NO_OVERLAP, CommOverlap
from dapple.cost.peak_memory import device_peak, plan_stage_bytes
from dapple.cost.pipeline import in_flight_bounds
from dapple.cost.terms import PlanTerms, stage_terms
from dapple.errors import ValidationError
from dapple.schedule.ir import ActionKind, step_point_kind
from dapple.schedule.lower import plan_compute_order
from dapple.schedule.registry import get_schedule
from dapple.schedule.spec import LinkTimes, StageTimes, StepTerms

__all__ = [
    "MAX_REPLAYED_ACTIONS",
    "activation_peak_bytes",
    "device_memory_by_group",
    "schedule_latency",
    "schedule_step_ms",
    "shared_capacity_ms",
    "step_terms",
]

K = ActionKind

MAX_REPLAYED_ACTIONS = 1 << 22
"""Most compute actions (M x stages x 2, or 3 with the split backward) a step rule replays:
about 4 million, seconds of Python."""


def _links(terms: PlanTerms) -> tuple[LinkTimes, ...]:
    """Per stage boundary, what its slowest replica pushes through its way out for one
    micro-batch: activations forward (summed over a source replica's slices) and gradients
    back (over a destination replica's), with the latency of its link."""
    plan, out = terms.plan, []
    for s, boundary in enumerate(terms.boundaries):
        fwd: dict[int, float] = {}
        bwd: dict[int, float] = {}
        latency = 0.0
        for x in boundary.transfers:
            fwd[x.src_replica] = fwd.get(x.src_replica, 0.0) + x.forward_ms
            bwd[x.dst_replica] = bwd.get(x.dst_replica, 0.0) + x.backward_ms
            if x.forward_ms > 0.0 or x.backward_ms > 0.0:
                src = plan.stages[s].replica_devices[x.src_replica]
                dst = plan.stages[s + 1].replica_devices[x.dst_replica]
                latency = max(latency, terms.cluster.latency_ms(src, dst))
        out.append(LinkTimes(max(fwd.values()), max(bwd.values()), latency))
    return tuple(out)


def _tails(terms: PlanTerms) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per device group g, what its lowered program runs after its last compute - its replicated
    stages' gradient synchronisation (AR, or ZeRO's reductions and gathers) and its optimizer
    step (the host CPU per step of stage g's slowest replica and U_s of each of its stages) -
    and the optimizer step alone (after the step point)."""
    plan, tails, updates = terms.plan, [], []
    for g in range(plan.num_groups):
        sync, update = 0.0, terms.stages[g].replicas[0].host.step_ms
        for k in plan.stages_of_group(g):
            st = terms.stages[k]
            update += st.terms.update_ms
            sync += st.terms.sync_ms if plan.stages[k].parallel.data_parallel else 0.0
        tails.append(sync + update)
        updates.append(update)
    return tuple(tails), tuple(updates)


def step_terms(terms: PlanTerms, *, on_nonfinite: str = "stop") -> StepTerms:
    """What a schedule's step rule reads of the plan's terms (module docstring) under the step
    point of ``on_nonfinite`` (:func:`dapple.schedule.ir.step_point_kind`).

    Raises:
        ValidationError: ``on_nonfinite`` is none of stop, skip and off.
    """
    plan = terms.plan
    overlapped = step_point_kind(on_nonfinite) is K.POST
    tails, updates = _tails(terms)
    return StepTerms(
        M=plan.num_micro_batches,
        P=plan.num_groups,
        v=plan.virtual_stages,
        order=plan_compute_order(plan),
        stages=tuple(
            StageTimes(
                r.forward_ms + r.host.forward_ms,
                r.backward_ms + r.host.backward_ms,
                r.input_grad_ms + r.host.backward_ms,
                r.weight_grad_ms,
            )
            for r in (st.replicas[0] for st in terms.stages)  # the slowest replica's slice
        ),
        links=_links(terms),
        tails=tails,
        updates=updates,
        overlapped=overlapped,
    )


def schedule_step_ms(terms: PlanTerms, *, on_nonfinite: str = "stop") -> float:
    """Predicted step time in ms of the plan of ``terms`` under its schedule (module
    docstring): L (:meth:`PlanTerms.pipeline <dapple.cost.terms.PlanTerms.pipeline>`,
    equations 1-3) for a schedule without a step rule (GPipe, DAPPLE), else its rule (the
    replay of interleaved 1F1B, ZB-H1, ZB-V and DualPipeV; on shared cores at least
    :func:`shared_capacity_ms`) under the step point of ``on_nonfinite`` (stop and skip: the non-finite guard's collective; off: none, consecutive
    steps overlap). L does not read the step point: under GPipe's and DAPPLE's orders stage 0
    ends a step last and every other stage's next step waits for its forwards.

    Raises:
        ValidationError: an unknown schedule, or one without either (from the registry); a
            rule's plan of more than :data:`MAX_REPLAYED_ACTIONS` compute actions.
    """
    plan = terms.plan
    step_point_kind(on_nonfinite)  # refused before the replay
    spec = get_schedule(plan.schedule)
    if spec.step_ms is None:
        return terms.pipeline(in_flight_bounds(plan)[1]).latency().L_ms
    actions = plan.num_micro_batches * plan.num_stages * (3 if spec.split_backward else 2)
    if actions > MAX_REPLAYED_ACTIONS:
        raise ValidationError(
            f"the {spec.title_of(plan)} step is replayed action by action: M = "
            f"{plan.num_micro_batches:,} micro-batches x {plan.num_stages} stages is "
            f"{actions:,} compute actions, more than {MAX_REPLAYED_ACTIONS:,}; give a smaller "
            "global batch or larger micro-batches"
        )
    return max(
        spec.step_ms(step_terms(terms, on_nonfinite=on_nonfinite)), shared_capacity_ms(terms)
    )


def shared_capacity_ms(terms: PlanTerms) -> float:
    """On devices that share compute cores (``Cluster.compute_cores_per_server``), the least
    time a step takes: per server, its devices' work over what they get done together. A step
    rule replays each device's actions at full speed; this bound is what processor sharing adds
    to it (the simulator shares event by event). 0 on dedicated devices.

    A device's work is each of its replicas' M micro-batches (F + B of its slice with their host
    CPU extras, re-computation included) and its per-step host CPU; k computing devices of a
    server get ``k rate(k)`` of a device's work done per ms (:meth:`Cluster.compute_rate`).
    """
    cl, plan = terms.cluster, terms.plan
    if cl.compute_cores_per_server is None:
        return 0.0
    M = plan.num_micro_batches
    work: dict[int, float] = {}
    step: dict[int, float] = {}
    for st in terms.stages:
        for r in st.replicas:
            h = r.host
            work[r.device] = work.get(r.device, 0.0) + M * (
                r.forward_ms + r.backward_ms + h.forward_ms + h.backward_ms
            )
            step[r.device] = max(step.get(r.device, 0.0), h.step_ms)
    per_server: dict[int, list[float]] = {}
    for d, w in work.items():
        per_server.setdefault(cl.server_of(d), []).append(w + step[d])
    return max(sum(ws) / (len(ws) * cl.compute_rate(len(ws))) for ws in per_server.values())


def schedule_latency(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    overlap: CommOverlap = NO_OVERLAP,
    *,
    on_nonfinite: str = "stop",
) -> float:
    """Predicted step time of ``plan`` in ms under its schedule (:func:`schedule_step_ms` of
    :func:`~dapple.cost.terms.stage_terms`), with the traffic ``overlap`` leaves exposed
    (:mod:`dapple.cost.overlap`; default: dapple's runtime, all of it) and the step point of
    ``on_nonfinite``.

    Raises:
        ValidationError: the plan does not fit the profile (from the cost model).
    """
    return schedule_step_ms(
        stage_terms(plan, profile, cluster, overlap=overlap), on_nonfinite=on_nonfinite
    )


def activation_peak_bytes(plan: Plan, profile: ModelProfile) -> list[float]:
    """Largest activation bytes each device group holds at once, by replaying the plan's
    compute order: F adds its stage's held activations (slowest replica's slice), B or W
    frees them (the weight gradient needs the layers' inputs, so ZB-H1 holds them until W).

    Returns:
        one value per device group (stage g of the first P stages).
    """
    profile = profile_for_plan(profile, plan).for_memory
    order = plan_compute_order(plan)
    peaks = []
    for g in range(plan.num_groups):
        n = max(plan.stages[g].slice_sizes(plan.micro_batch_size))
        level = peak = 0.0
        for a in order[g]:
            held = float(held_activation_bytes(profile, plan.stages[a.stage], n))
            if a.kind is K.FORWARD:
                level += held
                peak = max(peak, level)
            elif a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
                level -= held
        peaks.append(peak)
    return peaks


def device_memory_by_group(plan: Plan, profile: ModelProfile) -> list[float]:
    """Peak memory of each device group's first replica under the plan's schedule: its
    stages' (v chunks with interleaving) step peak, replayed over its compute order
    (:func:`dapple.cost.peak_memory.device_peak`).

    Returns:
        one value per device group (stage g of the first P stages), bytes.
    """
    profile = profile_for_plan(profile, plan)
    order = plan_compute_order(plan)
    out = []
    for g in range(plan.num_groups):
        parts = {
            k: plan_stage_bytes(profile, plan.stages[k], plan.micro_batch_size)
            for k in plan.stages_of_group(g)
        }
        out.append(device_peak(parts, order[g]).peak)
    return out
