"""DAPPLE planner (paper section 5): cost model, DP search, baselines and an exhaustive oracle."""

from __future__ import annotations

from dapple.planner.cost import LatencyBreakdown, pipeline_latency

__all__ = ["LatencyBreakdown", "pipeline_latency"]
