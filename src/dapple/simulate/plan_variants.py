"""A plan under a schedule: the plan's stages, replication and placement run by the schedule
named on the command line (:func:`with_schedule`), or by the schedule it is compared with
(:func:`compared_plan`); and simulation runs in the paper's order (:func:`baseline_first`).

Pure: no torch. Choosing a schedule by simulation is the planner's
(:mod:`dapple.planner.schedule_choice`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dapple.core.plan import DEFAULT_SCHEDULE, Plan, interleave
from dapple.schedule.registry import check_virtual_stages, get_schedule
from dapple.simulate.engine import SimResult

__all__ = [
    "baseline_first",
    "compared_plan",
    "unchunked",
    "with_schedule",
]


def unchunked(plan: Plan) -> Plan:
    """``plan`` with one contiguous stage per device group: each group's chunks joined
    (``plan`` itself when v = 1)."""
    if plan.virtual_stages == 1:
        return plan
    P = plan.num_groups
    start, rebuilt = 0, []
    for g, st in enumerate(plan.stages[:P]):
        n = sum(
            plan.stages[k].layers[1] - plan.stages[k].layers[0] for k in plan.stages_of_group(g)
        )
        rebuilt.append(dataclasses.replace(st, layers=(start, start + n)))
        start += n
    return dataclasses.replace(plan, virtual_stages=1, stages=tuple(rebuilt))


def with_schedule(
    plan: Plan, schedule: str, virtual_stages: int = 1, policy: str | None = None
) -> Plan:
    """``plan``'s stages, replication and placement under ``schedule``.

    A schedule with chunks cuts each device group's layers into ``virtual_stages`` chunks
    (its ``ScheduleSpec.chunk_count`` when it has one, ZB-V's 2) by its ``ScheduleSpec.cut``
    (default :func:`dapple.core.plan.interleave`, round robin; ZB-V's
    :func:`dapple.schedule.zbv.v_shape`, a V); then the schedule's own rules
    (``ScheduleSpec.check``) must hold. The predicted step is the plan's as given.

    Raises:
        ValidationError: unknown schedule, v > 1 for a schedule without chunks, v not
            dividing a device group's layers, or a rule of the schedule (interleaved: M a
            multiple of the device groups; ZB-V: two device groups at least).
    """
    spec = get_schedule(schedule)
    check_virtual_stages(virtual_stages, schedule)
    base = unchunked(plan)
    kw: dict[str, Any] = {"policy": policy} if policy else {}
    if spec.chunks:
        cut = spec.cut or interleave
        chunked = cut(dataclasses.replace(base, **kw), spec.chunk_count or virtual_stages)
        out = dataclasses.replace(chunked, schedule=spec.name)
    else:
        out = dataclasses.replace(base, schedule=spec.name, **kw)
    if spec.check is not None:
        spec.check(out)
    return out


def compared_plan(plan: Plan) -> Plan:
    """``plan`` under the schedule it is compared with (``ScheduleSpec.compare_with``: GPipe
    beside DAPPLE, DAPPLE beside the others)."""
    return with_schedule(plan, get_schedule(plan.schedule).compare_with or DEFAULT_SCHEDULE)


def baseline_first(runs: list[tuple[str, SimResult]]) -> list[tuple[str, SimResult]]:
    """``runs`` with the baseline schedule's (GPipe) on top, as in the paper; the others in
    their order."""
    return sorted(runs, key=lambda run: not get_schedule(run[1].schedule).baseline)
