"""Names of :mod:`dapple.cost` that callers outside the planner and the simulator import from
here: :func:`~dapple.cost.pipeline.pipeline_latency` and
:func:`~dapple.cost.memory.zero_saved_bytes`."""

from __future__ import annotations

from dapple.cost.memory import zero_saved_bytes
from dapple.cost.pipeline import LatencyBreakdown, pipeline_latency

__all__ = ["LatencyBreakdown", "pipeline_latency", "zero_saved_bytes"]
