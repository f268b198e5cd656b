"""A plan under every schedule: the schedule named on the command line, the best plan per
schedule by simulation (``dapple plan --compare``) and the best over all of them
(``dapple plan --schedule best``).

Pure: no torch. Every schedule is compared here by simulated step time, under the memory
limit; the runtime runs each of them.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, cast

from dapple.core.cluster import Cluster
from dapple.core.plan import SCHEDULES, Plan, StagePlan, interleave
from dapple.core.profile import ModelProfile
from dapple.cost.schedules import schedule_latency
from dapple.errors import DappleError, ValidationError
from dapple.simulate.engine import SimResult, simulate

__all__ = [
    "SCHEDULE_VARIANTS",
    "ScheduleChoice",
    "balanced_pipelines",
    "best_per_schedule",
    "best_schedule",
    "refine_cuts",
    "with_schedule",
]

SCHEDULE_VARIANTS: tuple[tuple[str, str, int], ...] = (
    ("gpipe", "A", 1),
    ("dapple", "A", 1),
    ("dapple", "B", 1),
    ("interleaved", "A", 2),
    ("interleaved", "A", 4),
    ("zbh1", "A", 1),
)
"""(schedule, policy, v) of each column of :func:`best_per_schedule`."""


def with_schedule(
    plan: Plan, schedule: str, virtual_stages: int = 1, policy: str | None = None
) -> Plan:
    """``plan``'s stages, replication and placement under ``schedule``.

    ``interleaved`` cuts each device group's layers into ``virtual_stages`` chunks
    (:func:`dapple.core.plan.interleave`); the predicted step is the schedule's
    (:func:`dapple.cost.schedules.schedule_latency`) when the plan had one.

    Raises:
        ValidationError: unknown schedule, v > 1 for another schedule, v not dividing a
            device group's layers, or an interleaved plan whose M is not a multiple of its
            device groups.
    """
    if schedule not in SCHEDULES:
        raise ValidationError(
            f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
        )
    if virtual_stages != 1 and schedule != "interleaved":
        raise ValidationError(
            f"--virtual-stages {virtual_stages} needs --schedule interleaved, got {schedule!r}"
        )
    base = plan
    if plan.virtual_stages > 1:  # back to one contiguous stage per device group
        P = plan.num_groups
        start, rebuilt = 0, []
        for g, st in enumerate(plan.stages[:P]):
            n = sum(
                plan.stages[k].layers[1] - plan.stages[k].layers[0]
                for k in range(g, plan.num_stages, P)
            )
            rebuilt.append(dataclasses.replace(st, layers=(start, start + n)))
            start += n
        base = dataclasses.replace(plan, schedule="dapple", virtual_stages=1, stages=tuple(rebuilt))
    kw: dict[str, Any] = {"policy": policy} if policy else {}
    if schedule == "interleaved":
        out = interleave(dataclasses.replace(base, **kw), virtual_stages)
        if out.num_micro_batches % out.num_groups:
            raise ValidationError(
                f"interleaved 1F1B needs M={out.num_micro_batches} to be a multiple of the "
                f"{out.num_groups} device groups of the plan"
            )
    else:
        out = dataclasses.replace(base, schedule=cast(Any, schedule), **kw)
    return out


@dataclass(frozen=True, slots=True)
class ScheduleChoice:
    """The best plan found for one schedule variant, or why there is none."""

    label: str
    """``gpipe``, ``dapple/A``, ``dapple/B``, ``interleaved v=2``, ``interleaved v=4``, ``zbh1``."""
    plan: Plan | None
    result: SimResult | None
    note: str = ""
    """Why no plan fits (layers, M, memory), empty otherwise."""


def _rounded(plan: Plan, v: int) -> Plan | None:
    """``plan`` with every cut moved to the nearest multiple of v, so each device group holds a
    multiple of v layers; None when impossible (v does not divide the layers, or two cuts
    would meet)."""
    N = plan.num_layers
    if plan.virtual_stages != 1 or N % v:
        return None
    cuts = [0, *(v * round(c / v) for c in plan.split_positions), N]
    if any(b <= a for a, b in itertools.pairwise(cuts)):
        return None
    stages = tuple(
        dataclasses.replace(st, layers=(cuts[g], cuts[g + 1])) for g, st in enumerate(plan.stages)
    )
    return dataclasses.replace(plan, stages=stages)


def balanced_pipelines(
    profile: ModelProfile, cluster: Cluster, global_batch_size: int
) -> list[Plan]:
    """Extra partitions for :func:`best_per_schedule`: for every P >= 2 dividing the device count
    (and at most the layer count), P device groups of ``D / P`` consecutive devices, the layers
    cut where the running sum of per-sample forward + backward time crosses each ``k/P`` of the
    total. The DAPPLE planner optimises partitions for its own latency; these give the other
    schedules, interleaving above all, pipelines of every depth to work with.
    """
    D, N = cluster.num_devices, profile.num_layers
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


def _label(schedule: str, policy: str, v: int) -> str:
    if schedule == "dapple":
        return f"dapple/{policy}"
    return f"interleaved v={v}" if schedule == "interleaved" else schedule


def best_per_schedule(
    bases: list[Plan],
    profile: ModelProfile,
    cluster: Cluster,
    micro_batch_counts: list[int] | None = None,
) -> list[ScheduleChoice]:
    """For each of :data:`SCHEDULE_VARIANTS`, the fastest simulated plan that fits the memory.

    Each base plan (e.g. the DAPPLE planner's and the straight pipeline) keeps its stages,
    replication and placement; the schedule and the number of micro-batches M vary (every M
    of ``micro_batch_counts`` that divides the global batch, default: the divisors of the
    global batch up to 64). Interleaved variants also try each base with its cuts moved to
    the nearest multiples of v (each device group must hold a multiple of v layers).

    Args:
        bases: plans whose partition, replication and placement are tried.
        profile: per-layer costs.
        cluster: devices, links and the memory limit (``usable_memory_bytes``).
        micro_batch_counts: M values to try.
    """
    out = []
    for schedule, policy, v in SCHEDULE_VARIANTS:
        best: tuple[Plan, SimResult] | None = None
        notes: list[str] = []
        N = bases[0].num_layers if bases else 0
        if v > 1 and N % v:
            label = _label(schedule, policy, v)
            out.append(
                ScheduleChoice(
                    label,
                    None,
                    None,
                    f"the {N} layers are not a multiple of v={v} (every device group holds a "
                    "multiple of v layers)",
                )
            )
            continue
        tried = list(bases)
        if v > 1:  # also the same cuts moved to multiples of v
            tried += [
                r for r in (_rounded(b, v) for b in bases) if r is not None and r not in bases
            ]
        for base in tried:
            gbs = base.global_batch_size
            ms = micro_batch_counts or [m for m in range(1, min(gbs, 64) + 1) if gbs % m == 0]
            if v > 1 and base.num_groups == 1:
                notes.append("one device group (data parallelism): nothing to interleave")
                continue
            for M in ms:
                if gbs % M:
                    continue
                try:
                    sized = dataclasses.replace(
                        base, micro_batch_size=gbs // M, num_micro_batches=M
                    )
                    plan = with_schedule(sized, schedule, v, policy)
                    res = simulate(plan, profile, cluster)
                except DappleError as e:
                    notes.append(str(e).splitlines()[0])
                    continue
                if res.peak_memory_bytes > cluster.usable_memory_bytes:
                    notes.append(
                        f"M={M}: {res.peak_memory_bytes / 2**30:.1f} GiB peak exceeds memory"
                    )
                    continue
                if best is None or res.step_ms < best[1].step_ms:
                    best = (plan, res)
        label = _label(schedule, policy, v)
        if best is None:
            out.append(ScheduleChoice(label, None, None, notes[-1] if notes else "no plan"))
        else:
            plan = dataclasses.replace(
                best[0], predicted_step_ms=schedule_latency(best[0], profile, cluster)
            )
            out.append(ScheduleChoice(label, plan, best[1]))
    return out


def best_schedule(
    plan: Plan, profile: ModelProfile, cluster: Cluster
) -> tuple[ScheduleChoice, list[ScheduleChoice]]:
    """The schedule as part of the search: every variant of :data:`SCHEDULE_VARIANTS` on
    ``plan``'s partition, replication and placement and on the balanced pipelines of every
    depth, each M (:func:`best_per_schedule`); the fastest simulated plan that fits the memory.

    Returns:
        The chosen variant (its plan predicted by its schedule's latency) and every variant's
        best, in :data:`SCHEDULE_VARIANTS` order.

    Raises:
        ValidationError: no variant fits the memory (each variant's reason listed).
    """
    bases = [plan, *balanced_pipelines(profile, cluster, plan.global_batch_size)]
    choices = [refine_cuts(c, profile, cluster) for c in best_per_schedule(bases, profile, cluster)]
    fits = [c for c in choices if c.plan is not None and c.result is not None]
    if not fits:
        raise ValidationError(
            "no schedule fits the memory: " + "; ".join(f"{c.label}: {c.note}" for c in choices)
        )
    return min(fits, key=lambda c: cast(SimResult, c.result).step_ms), choices


def refine_cuts(
    choice: ScheduleChoice, profile: ModelProfile, cluster: Cluster, max_moves: int = 64
) -> ScheduleChoice:
    """A partition search for ``choice``'s schedule: hill climbing on the simulated step.

    Each boundary between two device groups moves by one step (v layers for interleaved v, so
    every group keeps a multiple of v; one layer otherwise) either way while both groups keep
    at least one step of layers; a move is kept when the plan under the same schedule, M,
    replication and placement simulates faster and fits the memory. Stops when no move
    helps, or after ``max_moves`` kept moves.
    """
    if choice.plan is None or choice.result is None:
        return choice
    plan, res = choice.plan, choice.result
    v = plan.virtual_stages
    policy = plan.policy
    base = with_schedule(plan, "dapple") if v > 1 else plan
    for _ in range(max_moves):
        better: tuple[Plan, Plan, SimResult] | None = None
        for g in range(base.num_stages - 1):
            for d in (-v, v):
                moved = _moved(base, g, d, v)
                if moved is None:
                    continue
                try:
                    cand = with_schedule(moved, plan.schedule, v, policy)
                    r = simulate(cand, profile, cluster)
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
    plan = dataclasses.replace(plan, predicted_step_ms=schedule_latency(plan, profile, cluster))
    return ScheduleChoice(choice.label, plan, res)


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
