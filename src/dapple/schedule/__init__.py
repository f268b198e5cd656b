"""Schedules as data: IR, GPipe / DAPPLE / interleaved 1F1B / ZB-H1 generators and lowering to
per-device programs."""

from dapple.schedule.forward import forward_order, lower_forward
from dapple.schedule.generators import (
    compute_order,
    dapple,
    gpipe,
    in_flight_counts,
    warmup_counts,
)
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
from dapple.schedule.validate import format_grid, validate, validate_compute_order
from dapple.schedule.zerobubble import zbh1

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
    "interleaved",
    "interleaved_warmup",
    "lower",
    "lower_forward",
    "parse_action",
    "plan_compute_order",
    "validate",
    "validate_compute_order",
    "warmup_counts",
    "zbh1",
]
