"""Which schedules the runtime executes; the others are planned and simulated only."""

from __future__ import annotations

from dapple.core.plan import Plan
from dapple.errors import ValidationError

__all__ = ["RUNTIME_SCHEDULES", "require_runtime_support"]

RUNTIME_SCHEDULES = ("gpipe", "dapple", "zbh1")
"""Schedules :mod:`dapple.runtime` runs. ``interleaved`` needs a rank to host several stage
chunks, which the runtime does not do yet."""


def require_runtime_support(plan: Plan) -> None:
    """Refuse, before any process starts, a plan whose schedule the runtime cannot run.

    Raises:
        ValidationError: the plan's schedule is not in :data:`RUNTIME_SCHEDULES`.
    """
    if plan.schedule not in RUNTIME_SCHEDULES:
        chunks = f" with v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
        raise ValidationError(
            f"schedule {plan.schedule!r}{chunks} is planned and simulated only: the runtime "
            f"does not support it yet (it runs {', '.join(RUNTIME_SCHEDULES)}); use "
            "'dapple simulate' for it, or --schedule dapple to run the plan"
        )
