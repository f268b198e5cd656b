"""DAPPLE planner (paper section 5): cost model, DP search, baselines and an exhaustive oracle.

``make_plan(profile, cluster, global_batch_size, planner)`` is the entry point; every planner
returns a :class:`dapple.core.plan.Plan` whose ``predicted_step_ms`` is the cost model's L.
"""

from __future__ import annotations

from collections.abc import Callable

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.planner.baselines import dp_plan, gpipe_plan, pipedream_plan, straight_plan_baseline
from dapple.planner.cost import LatencyBreakdown, pipeline_latency
from dapple.planner.oracle import exhaustive_plan
from dapple.planner.search import Progress, dapple_search

__all__ = [
    "PLANNERS",
    "LatencyBreakdown",
    "dapple_search",
    "dp_plan",
    "exhaustive_plan",
    "gpipe_plan",
    "make_plan",
    "pipedream_plan",
    "pipeline_latency",
    "straight_plan_baseline",
]

PLANNERS: dict[str, Callable[[ModelProfile, Cluster, int], Plan]] = {
    "dapple": dapple_search,
    "dp": dp_plan,
    "straight": straight_plan_baseline,
    "gpipe": gpipe_plan,
    "pipedream": pipedream_plan,
    "exhaustive": exhaustive_plan,
}
"""Planner names accepted by :func:`make_plan` and ``dapple plan --planner``."""


def make_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    planner: str = "dapple",
    *,
    progress: Progress | None = None,
    zero_stage: int = 0,
) -> Plan:
    """Plan ``profile`` on ``cluster`` for ``global_batch_size`` samples per step.

    Args:
        profile: model profile.
        cluster: devices and links.
        global_batch_size: samples per optimizer step.
        planner: one of :data:`PLANNERS`.
        progress: ``progress(done, total)`` callback (DAPPLE search only).
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2); -1 (``ZERO_AUTO``): per stage, where memory asks for it.
            DAPPLE search only, the baselines plan unsharded.

    Raises:
        ValidationError: unknown planner or bad batch size.
        InfeasibleError: no plan fits.
    """
    if planner not in PLANNERS:
        raise ValidationError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValidationError(
            f"global batch size must be an integer >= 1, got {global_batch_size!r}"
        )
    if planner == "dapple":
        return dapple_search(
            profile, cluster, global_batch_size, progress=progress, zero_stage=zero_stage
        )
    return PLANNERS[planner](profile, cluster, global_batch_size)
