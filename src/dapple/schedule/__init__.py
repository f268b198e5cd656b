"""Schedules as data: IR, GPipe/DAPPLE generators and lowering to per-device programs."""

from dapple.schedule.forward import forward_order, lower_forward
from dapple.schedule.generators import (
    compute_order,
    dapple,
    gpipe,
    in_flight_counts,
    warmup_counts,
)
from dapple.schedule.ir import (
    Action,
    ActionKind,
    ComputeOrder,
    Schedule,
    format_actions,
    parse_action,
)
from dapple.schedule.lower import lower, plan_compute_order
from dapple.schedule.validate import format_grid, validate, validate_compute_order

__all__ = [
    "Action",
    "ActionKind",
    "ComputeOrder",
    "Schedule",
    "compute_order",
    "dapple",
    "format_actions",
    "format_grid",
    "forward_order",
    "gpipe",
    "in_flight_counts",
    "lower",
    "lower_forward",
    "parse_action",
    "plan_compute_order",
    "validate",
    "validate_compute_order",
    "warmup_counts",
]
