"""Schedules as data: the IR, one module per schedule (GPipe, DAPPLE early backward, interleaved
1F1B, ZB-H1) declaring a :class:`ScheduleSpec`, the registry that names them, and lowering to
per-device programs.

Adding a schedule: a module with its generator and ``SCHEDULE = ScheduleSpec(...)``, then
:func:`register` (or the module's path in ``DAPPLE_SCHEDULES``, see
:mod:`dapple.schedule.registry`); a built-in one is listed in the registry's ``_BUILTIN``.
"""

from dapple.schedule.early_backward import dapple, warmup_counts
from dapple.schedule.fill_drain import gpipe
from dapple.schedule.forward import forward_order, lower_forward
from dapple.schedule.interleaved import interleaved, interleaved_warmup
from dapple.schedule.ir import (
    Action,
    ActionKind,
    ComputeOrder,
    Schedule,
    format_actions,
    parse_action,
)
from dapple.schedule.lower import lower, plan_compute_order
from dapple.schedule.registry import (
    builtin_schedules,
    check_virtual_stages,
    compute_order,
    get_schedule,
    in_flight_counts,
    load_schedule,
    register,
    registered,
    schedule_names,
    schedules,
    unregister,
)
from dapple.schedule.spec import ScheduleSpec, Shape, StageTimes, StepTerms
from dapple.schedule.validate import format_grid, validate, validate_compute_order
from dapple.schedule.zerobubble import zbh1

__all__ = [
    "Action",
    "ActionKind",
    "ComputeOrder",
    "Schedule",
    "ScheduleSpec",
    "Shape",
    "StageTimes",
    "StepTerms",
    "builtin_schedules",
    "check_virtual_stages",
    "compute_order",
    "dapple",
    "format_actions",
    "format_grid",
    "forward_order",
    "get_schedule",
    "gpipe",
    "in_flight_counts",
    "interleaved",
    "interleaved_warmup",
    "load_schedule",
    "lower",
    "lower_forward",
    "parse_action",
    "plan_compute_order",
    "register",
    "registered",
    "schedule_names",
    "schedules",
    "unregister",
    "validate",
    "validate_compute_order",
    "warmup_counts",
    "zbh1",
]
