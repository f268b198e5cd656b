"""dapple's own plan for a published run's model, cluster and global batch (``published.py``).

For each row dapple expresses, :func:`dapple.planner.search.dapple_search` plans the row's
profile (:func:`_published_model.profile_for`) on its cluster for its global batch, over the
planner's own candidates: partition, replication and placement, M, tensor widths (the
planner's :func:`~dapple.planner.widths.width_candidates`: 1, 2, 4, 8 within a server) and
per stage ZeRO 0-3 where memory asks for it (``zero_stage="auto"``). The plan is simulated beside the
row's own configuration expressed as a dapple plan (:func:`_published_model.plan_for`), on
the same profile and cluster: the speed-up is the cost model's, and :func:`differences` names
what the two plans do differently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from _published_model import Prediction, cluster_for, plan_for, profile_for, simulate_plan
from dapple.core.plan import Plan
from dapple.errors import InfeasibleError
from dapple.planner.search import dapple_search

__all__ = ["Searched", "differences", "search_row"]


@dataclass(frozen=True, slots=True)
class Searched:
    """dapple's plan for one row beside the row's own configuration."""

    planning_s: float
    """Wall time of :func:`dapple_search` on this machine."""
    published: Prediction
    """The row's own configuration, simulated."""
    own: Prediction | None
    """dapple's plan, simulated; None: no plan fits device memory (``infeasible`` says why)."""
    differs: str
    """What dapple's plan does differently (:func:`differences`)."""
    infeasible: str = ""


def search_row(run: dict[str, Any]) -> Searched:
    """Plan ``run``'s model, cluster and global batch with dapple's search and simulate the plan
    beside the row's own configuration."""
    prof, cluster = profile_for(run), cluster_for(run)
    mine = plan_for(run, prof, cluster)
    published = simulate_plan(run, mine, prof, cluster)
    t0 = time.perf_counter()
    try:
        plan = dapple_search(prof, cluster, run["parallel"]["global_batch"], zero_stage="auto")
    except InfeasibleError as e:
        return Searched(time.perf_counter() - t0, published, None, "", str(e))
    planning_s = time.perf_counter() - t0
    own = simulate_plan(run, plan, prof, cluster)
    return Searched(planning_s, published, own, differences(mine, plan))


def _per_group(plan: Plan) -> dict[str, str]:
    groups = plan.stages[: plan.num_groups]

    def one(values: list[str]) -> str:
        if len(set(values)) == 1:
            return values[0]
        if len(values) <= 8:
            return "/".join(values)
        return "mixed " + "/".join(sorted(set(values), key=lambda v: (len(v), v)))

    zero = [
        f"{st.zero_stage}{'r' if st.regather else ''}" if st.replicas > 1 else "0" for st in groups
    ]
    sizes = [st.layers[1] - st.layers[0] for st in groups]
    return {
        "stages": str(len(groups)),
        "replicas": one([str(st.replicas) for st in groups]),
        "width": one([str(st.tensor_width) for st in groups]),
        "ZeRO": one(zero),
        "RC": one(["y" if st.recompute else "n" for st in groups]),
        "layers": "even" if max(sizes) - min(sizes) <= 1 else f"{min(sizes)}-{max(sizes)}",
        "b": str(plan.micro_batch_size),
        "M": str(plan.num_micro_batches),
        "schedule": plan.schedule
        + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
        "devices": str(sum(len(st.devices) for st in groups)),
    }


def differences(published: Plan, own: Plan) -> str:
    """``key a -> b`` for each property the two plans differ in: stages, replicas r_s, tensor
    width t_s, ZeRO stage (``3r``: re-gathered per micro-batch), re-computation, layers per
    stage, b, M, schedule, devices used; per-stage values joined by ``/`` (the distinct ones
    after ``mixed`` beyond 8 stages); ``same plan`` when none differs."""
    a, b = _per_group(published), _per_group(own)
    out = [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k]]
    return "; ".join(out) or "same plan"
