"""The schedule as part of the search: the best plan per schedule by simulation
(``dapple plan --compare``) and the best over all of them (``dapple plan --schedule best``).

Pure: no torch. Every registered schedule (:mod:`dapple.schedule.registry`) is compared here,
each variant it declares (``ScheduleSpec.variants``), by simulated step time
(:func:`dapple.simulate.engine.simulate`), under the memory limit; the runtime runs each of
them. A plan is put under a schedule by :func:`dapple.simulate.plan_variants.with_schedule`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import cast

from dapple.core.cluster import Cluster
from dapple.core.cuts import rounded_to_chunks
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.core.usable import usable_cluster, usable_devices
from dapple.cost.schedule_step import schedule_latency
from dapple.errors import DappleError, ValidationError
from dapple.schedule.registry import builtin_schedules, get_schedule, schedules
from dapple.schedule.spec import ScheduleSpec
from dapple.simulate.engine import SimResult, simulate
from dapple.simulate.plan_variants import unchunked, with_schedule

__all__ = [
    "SCHEDULE_VARIANTS",
    "ScheduleChoice",
    "balanced_pipelines",
    "best_per_schedule",
    "best_schedule",
    "best_under_schedule",
    "check_v_layers",
    "refine_cuts",
    "schedule_variants",
    "under_schedule",
]


def schedule_variants(
    specs: tuple[ScheduleSpec, ...] | None = None,
) -> tuple[tuple[str, str, int], ...]:
    """``(schedule, policy, v)`` of each column of :func:`best_per_schedule`: each schedule's
    ``variants``, in registry order (default: every registered schedule)."""
    specs = schedules() if specs is None else specs
    return tuple((s.name, policy, v) for s in specs for policy, v in s.variants)


SCHEDULE_VARIANTS: tuple[tuple[str, str, int], ...] = schedule_variants(builtin_schedules())
"""The built-in schedules' variants: gpipe, dapple/A, dapple/B, interleaved v=2 and v=4,
zbh1, zbv, dualpipev."""


@dataclass(frozen=True, slots=True)
class ScheduleChoice:
    """The best plan found for one schedule variant, or why there is none."""

    label: str
    """The variant's ``ScheduleSpec.label``: ``gpipe``, ``dapple/A``, ``dapple/B``,
    ``interleaved v=2``, ``interleaved v=4``, ``zbh1``, ``zbv``, ``dualpipev``."""
    plan: Plan | None
    result: SimResult | None
    note: str = ""
    """Why no plan fits (layers, M, memory), empty otherwise."""


def balanced_pipelines(
    profile: ModelProfile, cluster: Cluster, global_batch_size: int
) -> list[Plan]:
    """Extra partitions for :func:`best_per_schedule`: for every P >= 2 dividing the device count
    (and at most the layer count), P device groups of ``D / P`` consecutive devices, the layers
    cut where the running sum of per-sample forward + backward time crosses each ``k/P`` of the
    total. The DAPPLE planner optimises partitions for its own latency; these give the other
    schedules, interleaving above all, pipelines of every depth to work with. On a cluster of
    more devices than N stages of B replicas keep busy (B the global batch size), the device
    count is that of the fewest first servers holding N x B
    (:func:`~dapple.core.usable.usable_cluster`).
    """
    N = profile.num_layers
    D = usable_cluster(cluster, usable_devices(N, global_batch_size, [1])).num_devices
    work = [x.forward.at(1) + x.backward.at(1) for x in profile.layers]
    total = sum(work) or 1.0
    out = []
    for P in range(2, min(D, N) + 1):
        if D % P:
            continue
        cuts, acc, k = [0], 0.0, 1
        for i, w in enumerate(work[:-1]):
            acc += w
            if k < P and acc >= total * k / P and i + 1 > cuts[-1] and N - (i + 1) >= P - k:
                cuts.append(i + 1)
                k += 1
        while len(cuts) < P:  # too few crossings: split the largest-index tail evenly
            cuts.append(cuts[-1] + 1)
        cuts.append(N)
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            continue
        r = D // P
        stages = tuple(
            StagePlan(layers=(cuts[g], cuts[g + 1]), devices=tuple(range(g * r, (g + 1) * r)))
            for g in range(P)
        )
        out.append(
            Plan(
                planner=f"balanced-{P}",
                global_batch_size=global_batch_size,
                micro_batch_size=global_batch_size,
                num_micro_batches=1,
                stages=stages,
                model_name=profile.model_name,
            )
        )
    return out


def best_per_schedule(
    bases: list[Plan],
    profile: ModelProfile,
    cluster: Cluster,
    micro_batch_counts: list[int] | None = None,
    *,
    on_nonfinite: str = "stop",
) -> list[ScheduleChoice]:
    """For each of :func:`schedule_variants`, the fastest simulated plan that fits the memory.

    Each base plan (e.g. the DAPPLE planner's and the straight pipeline) keeps its stages,
    replication and placement; the schedule and the number of micro-batches M vary (every M
    of ``micro_batch_counts`` that divides the global batch, default: the divisors of the
    global batch up to 64). Chunked variants (interleaved) also try each base with its cuts
    moved to the nearest multiples of v (each device group must hold a multiple of v layers).

    Args:
        bases: plans whose partition, replication and placement are tried.
        profile: per-layer costs.
        cluster: devices, links and the memory limit (``usable_memory_bytes``).
        micro_batch_counts: M values to try.
        on_nonfinite: the run's non-finite mode, whose step point the plans are simulated
            with (:func:`dapple.simulate.simulate`: ``off`` overlaps consecutive steps).
    """
    return [
        _best_variant(
            schedule, policy, v, bases, profile, cluster, micro_batch_counts, on_nonfinite
        )
        for schedule, policy, v in schedule_variants()
    ]


def _best_variant(
    schedule: str,
    policy: str,
    v: int,
    bases: list[Plan],
    profile: ModelProfile,
    cluster: Cluster,
    micro_batch_counts: list[int] | None,
    on_nonfinite: str = "stop",
) -> ScheduleChoice:
    """One column of :func:`best_per_schedule`: the fastest fitting plan of the variant, or
    the last reason a try failed."""
    spec = get_schedule(schedule)
    label = spec.label_of(policy, v)
    N = bases[0].num_layers if bases else 0
    if _round_robin(spec, v) and N % v:
        note = (
            f"the {N} layers are not a multiple of v={v} (every device group holds a multiple "
            "of v layers)"
        )
        return ScheduleChoice(label, None, None, note)
    best: tuple[Plan, SimResult] | None = None
    notes: list[str] = []
    for base in _variant_bases(bases, v) if _round_robin(spec, v) else bases:
        if v > 1 and base.num_groups == 1:
            notes.append("one device group (data parallelism): nothing to interleave")
            continue
        gbs = base.global_batch_size
        ms = micro_batch_counts or [m for m in range(1, min(gbs, 64) + 1) if gbs % m == 0]
        for M in ms:
            if gbs % M:
                continue
            got = _simulated(base, M, schedule, policy, v, profile, cluster, on_nonfinite)
            if isinstance(got, str):
                notes.append(got)
            elif best is None or got[1].step_ms < best[1].step_ms:
                best = got
    if best is None:
        return ScheduleChoice(label, None, None, notes[-1] if notes else "no plan")
    predicted = schedule_latency(best[0], profile, cluster, on_nonfinite=on_nonfinite)
    return ScheduleChoice(label, dataclasses.replace(best[0], predicted_step_ms=predicted), best[1])


def _round_robin(spec: ScheduleSpec, v: int) -> bool:
    """Whether the variant cuts each device group into v > 1 chunks by
    :func:`~dapple.core.plan.interleave`, which needs a multiple of v layers per group. A
    schedule with its own cut (the V schedules' :func:`~dapple.schedule.zbv.v_shape`: two
    chunks of any group of at least two layers) refuses what it cannot cut itself."""
    return v > 1 and spec.chunks and spec.cut is None


def _variant_bases(bases: list[Plan], v: int) -> list[Plan]:
    """The bases a variant with v chunks tries: all, and for v > 1 also each with its cuts
    moved to multiples of v."""
    if v == 1:
        return list(bases)
    rounded = (rounded_to_chunks(b, v) for b in bases)
    return [*bases, *(r for r in rounded if r is not None and r not in bases)]


def _simulated(
    base: Plan,
    M: int,
    schedule: str,
    policy: str,
    v: int,
    profile: ModelProfile,
    cluster: Cluster,
    on_nonfinite: str = "stop",
) -> tuple[Plan, SimResult] | str:
    """``base`` with M micro-batches under the variant, simulated: the plan and its result, or
    why it does not run or fit the memory (one line)."""
    try:
        sized = dataclasses.replace(
            base, micro_batch_size=base.global_batch_size // M, num_micro_batches=M
        )
        plan = with_schedule(sized, schedule, v, policy)
        res = simulate(plan, profile, cluster, on_nonfinite=on_nonfinite)
    except DappleError as e:
        return str(e).splitlines()[0]
    if res.peak_memory_bytes > cluster.usable_memory_bytes:
        return f"M={M}: {res.peak_memory_bytes / 2**30:.1f} GiB peak exceeds memory"
    return plan, res


def best_schedule(
    plan: Plan, profile: ModelProfile, cluster: Cluster, *, on_nonfinite: str = "stop"
) -> tuple[ScheduleChoice, list[ScheduleChoice]]:
    """The schedule as part of the search: every variant of :func:`schedule_variants` on
    ``plan``'s partition, replication and placement and on the balanced pipelines of every
    depth, each M (:func:`best_per_schedule`); the fastest simulated plan that fits the memory,
    simulated with the step point of ``on_nonfinite`` (``off``: consecutive steps overlap).

    Returns:
        The chosen variant (its plan predicted by its schedule's latency) and every variant's
        best, in :func:`schedule_variants` order.

    Raises:
        ValidationError: no variant fits the memory (each variant's reason listed).
    """
    bases = [plan, *balanced_pipelines(profile, cluster, plan.global_batch_size)]
    choices = [
        refine_cuts(c, profile, cluster, on_nonfinite=on_nonfinite)
        for c in best_per_schedule(bases, profile, cluster, on_nonfinite=on_nonfinite)
    ]
    fits = [c for c in choices if c.plan is not None and c.result is not None]
    if not fits:
        raise ValidationError(
            "no schedule fits the memory: " + "; ".join(f"{c.label}: {c.note}" for c in choices)
        )
    return min(fits, key=lambda c: cast(SimResult, c.result).step_ms), choices


def under_schedule(
    plan: Plan,
    schedule: str,
    virtual_stages: int,
    profile: ModelProfile,
    cluster: Cluster,
    *,
    on_nonfinite: str = "stop",
) -> Plan:
    """The planned stages of ``plan`` under ``schedule`` (``virtual_stages`` chunks per device
    group where it interleaves; :func:`~dapple.simulate.plan_variants.with_schedule`), its
    step predicted as the schedule's own (:func:`~dapple.cost.schedule_step.schedule_latency`:
    L of equations 1-3 for GPipe and DAPPLE, else its step rule under the step point of
    ``on_nonfinite``). A schedule with its own cut (a V) that the DAPPLE planner's plan cannot
    hold (a group of one layer): its best plan on balanced pipelines
    (:func:`best_under_schedule`). The one schedule step of :func:`dapple.api.plan` and of
    ``dapple plan --schedule`` with GPipe or DAPPLE.

    Raises:
        ValidationError: ``plan``'s stages cannot run under ``schedule`` (from
            :func:`~dapple.simulate.plan_variants.with_schedule`) and, for a V on a searched
            plan, no balanced pipeline fits either.
    """
    from dapple.planner.registry import searched

    try:
        new = with_schedule(plan, schedule, virtual_stages)
    except ValidationError:  # a V the DAPPLE planner's plan cannot hold: balanced pipelines
        if get_schedule(schedule).cut is None or not searched(plan):
            raise
        chosen = best_under_schedule(plan, schedule, profile, cluster, on_nonfinite=on_nonfinite)
        if chosen.plan is None:
            raise
        return chosen.plan
    predicted = schedule_latency(new, profile, cluster, on_nonfinite=on_nonfinite)
    return dataclasses.replace(new, predicted_step_ms=predicted)


def check_v_layers(schedule: str, profile: ModelProfile, cluster: Cluster) -> None:
    """Before any search: a schedule with its own cut (a V: ZB-V, DualPipeV) holds
    ``chunk_count`` chunks of at least one layer on each of at least two device groups, so it
    needs N >= 2 x ``chunk_count`` layers and two devices.

    Raises:
        ValidationError: fewer layers or devices than that (naming both counts).
    """
    spec = get_schedule(schedule)
    if spec.cut is None:
        return
    chunks = spec.chunk_count or 2
    need, layers, devices = 2 * chunks, profile.num_layers, cluster.num_devices
    if layers < need or devices < 2:
        raise ValidationError(
            f"--schedule {schedule} cuts each of at least 2 device groups into {chunks} chunks "
            f"of at least one layer (N >= {need} layers, 2 devices), but {profile.model_name!r} "
            f"has N = {layers} layers and {cluster.name!r} {devices} device(s)"
        )


def best_under_schedule(
    plan: Plan,
    schedule: str,
    profile: ModelProfile,
    cluster: Cluster,
    *,
    on_nonfinite: str = "stop",
) -> ScheduleChoice:
    """The fastest simulated plan under ``schedule`` (each of its variants) that fits the
    memory, on ``plan``'s partition, replication and placement and on the balanced pipelines
    of every depth (:func:`balanced_pipelines`), each M, its cuts then refined
    (:func:`refine_cuts`). For a schedule with its own cut (a V) the planner does not plan
    for: a plan of the DAPPLE planner may hold a device group of one layer, which the V cannot
    cut into two chunks. Simulated with the step point of ``on_nonfinite``.

    Returns:
        The best choice, or (no plan) the last variant's reason.
    """
    bases = [plan, *balanced_pipelines(profile, cluster, plan.global_batch_size)]
    choices = [
        refine_cuts(
            _best_variant(schedule, policy, v, bases, profile, cluster, None, on_nonfinite),
            profile,
            cluster,
            on_nonfinite=on_nonfinite,
        )
        for policy, v in get_schedule(schedule).variants
    ]
    fits = [c for c in choices if c.plan is not None and c.result is not None]
    if not fits:
        return choices[-1]
    return min(fits, key=lambda c: cast(SimResult, c.result).step_ms)


def refine_cuts(
    choice: ScheduleChoice,
    profile: ModelProfile,
    cluster: Cluster,
    max_moves: int = 64,
    *,
    on_nonfinite: str = "stop",
) -> ScheduleChoice:
    """A partition search for ``choice``'s schedule: hill climbing on the simulated step.

    Each boundary between two device groups moves by one step (v layers for interleaved v, so
    every group keeps a multiple of v; one layer otherwise) either way while both groups keep
    at least v layers (a V schedule's two chunks: two); a move is kept when the plan under the same schedule, M,
    replication and placement simulates faster and fits the memory. Stops when no move
    helps, or after ``max_moves`` kept moves. A partition the climb has simulated before (the
    move back to a partition it moved from) is not simulated again: it was no faster than the
    plan the climb holds now, so it cannot be kept. Simulated with the step point of
    ``on_nonfinite``.
    """
    if choice.plan is None or choice.result is None:
        return choice
    plan, res = choice.plan, choice.result
    v = plan.virtual_stages
    step = v if _round_robin(get_schedule(plan.schedule), v) else 1
    policy = plan.policy
    base = unchunked(plan)
    tried: set[tuple[tuple[int, int], ...]] = set()
    for _ in range(max_moves):
        better: tuple[Plan, Plan, SimResult] | None = None
        for g in range(base.num_stages - 1):
            for d in (-step, step):
                moved = _moved(base, g, d, v)
                if moved is None or _cuts(moved) in tried:
                    continue
                tried.add(_cuts(moved))
                try:
                    cand = with_schedule(moved, plan.schedule, v, policy)
                    r = simulate(cand, profile, cluster, on_nonfinite=on_nonfinite)
                except DappleError:
                    continue
                best_ms = res.step_ms if better is None else better[2].step_ms
                if r.peak_memory_bytes <= cluster.usable_memory_bytes and r.step_ms < best_ms:
                    better = (moved, cand, r)
        if better is None:
            break
        base, plan, res = better
    if plan is choice.plan:
        return choice
    predicted = schedule_latency(plan, profile, cluster, on_nonfinite=on_nonfinite)
    return ScheduleChoice(choice.label, dataclasses.replace(plan, predicted_step_ms=predicted), res)


def _cuts(base: Plan) -> tuple[tuple[int, int], ...]:
    """The layers of each device group of an unchunked plan: what :func:`refine_cuts` moves."""
    return tuple(st.layers for st in base.stages)


def _moved(base: Plan, g: int, d: int, v: int) -> Plan | None:
    """``base`` with the boundary after device group g moved by d layers; None when a group
    would keep fewer than v layers."""
    lo, mid = base.stages[g].layers
    _, hi = base.stages[g + 1].layers
    cut = mid + d
    if cut - lo < v or hi - cut < v:
        return None
    stages = list(base.stages)
    stages[g] = dataclasses.replace(stages[g], layers=(lo, cut))
    stages[g + 1] = dataclasses.replace(stages[g + 1], layers=(cut, hi))
    return dataclasses.replace(base, stages=tuple(stages))
