"""Names of :mod:`dapple.cost.schedules` that callers outside the planner and the simulator
import from here: :func:`~dapple.cost.schedules.schedule_latency` and
:func:`~dapple.cost.schedules.device_memory_by_group`."""

from __future__ import annotations

from dapple.cost.schedules import device_memory_by_group, schedule_latency

__all__ = ["device_memory_by_group", "schedule_latency"]
