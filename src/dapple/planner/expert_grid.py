"""The uniform EP x PP x DP grid: one expert-parallel width for every MoE stage of a grid point.

Megatron-Core, DeepSpeed-MoE and torchtitan give a job one expert-parallel degree: every stage
shards its experts over the same e consecutive replicas of its dp. This baseline takes each
1F1B DDP point of the torchtitan-style grid (:mod:`dapple.planner.grid`: dp x pp, tp = 1, the
layers cut as torchtitan cuts them) and each width e > 1 dividing dp and every MoE layer's E,
and scores it with every MoE stage at width e (:class:`~dapple.planner.expert_width.ExpertScorer`
offered e alone): the same cost model and memory fit as the DAPPLE search, each stage holding
the K_i of 1F1B (policy A) without re-computation, as the grid's 1F1B points. e = 1 is the
grid's own points (:func:`~dapple.planner.grid.grid_candidates`, tensor parallelism, FSDP and
interleaving included); :func:`uniform_expert_grid_plan` returns the best over both. Pure, no
torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import InfeasibleError
from dapple.planner.batches import infeasible_message
from dapple.planner.expert_width import ExpertScorer
from dapple.planner.grid import (
    INTERLEAVED,
    GridPoint,
    grid_candidates,
    grid_points,
    torchtitan_cuts,
)

__all__ = ["ExpertGridCandidate", "expert_grid_candidates", "uniform_expert_grid_plan"]


@dataclass(frozen=True, slots=True)
class ExpertGridCandidate:
    """A scored grid point at a uniform EP width."""

    point: GridPoint
    plan: Plan
    """The point as a plan (``planner="grid"``), every MoE stage at ``expert_width``."""
    L_ms: float
    """The cost model's L in ms."""
    expert_width: int
    """e: every MoE stage's EP width."""

    @property
    def label(self) -> str:
        """The grid point's label with its EP width, ``dp8 x ep8 x tp1 x pp4 DDP M=8 1F1B``."""
        return self.point.label.replace(" x tp", f" x ep{self.expert_width} x tp", 1)


def _uniform_widths(profile: ModelProfile, dp: int) -> list[int]:
    """The widths e > 1 dividing dp and every MoE layer's E."""
    experts = [x.moe.experts for x in profile.layers if x.moe is not None]
    g = math.gcd(*experts) if experts else 1
    return [e for e in range(2, dp + 1) if dp % e == 0 and g % e == 0]


def expert_grid_candidates(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    *,
    micro_batches: Sequence[int] | None = None,
) -> list[ExpertGridCandidate]:
    """The grid's 1F1B DDP points at tp = 1 (:func:`~dapple.planner.grid.grid_points`,
    ``micro_batches`` as there), each at every uniform EP width e > 1 that fits, scored (module
    docstring). Empty for a profile without MoE layers."""
    scorers: dict[int, ExpertScorer] = {}
    out = []
    points = grid_points(
        profile, cluster, global_batch_size, interleaved=False, micro_batches=micro_batches
    )
    for p in points:
        if p.parallel.tensor_parallel or p.parallel.shards_params or p.schedule == INTERLEAVED:
            continue
        cuts = torchtitan_cuts(profile.num_layers, p.pp)
        stages = [
            (cuts[i], cuts[i + 1], tuple(range(i * p.dp, (i + 1) * p.dp))) for i in range(p.pp)
        ]
        for e in _uniform_widths(profile, p.dp):
            sc = scorers.get(e)
            if sc is None:
                sc = scorers[e] = ExpertScorer(profile, cluster, global_batch_size, 0, (e,))
            got = sc.score(stages, p.M, policies=("A",), recompute=False)
            if got is None or any(d is not None for d in got.max_in_flight):
                continue  # 1F1B needs every stage to hold its K_i
            plan = sc.build_plan("grid", stages, p.M, got)
            out.append(ExpertGridCandidate(p, plan, got.L_ms, e))
    return out


def uniform_expert_grid_plan(
    profile: ModelProfile, cluster: Cluster, global_batch_size: int
) -> tuple[Plan, str]:
    """The best plan of the uniform grid, EP widths included: the feasible candidate of least L
    over :func:`expert_grid_candidates` and the grid's own points, with its label.

    Raises:
        InfeasibleError: no point fits device memory.
    """
    best: tuple[float, Plan, str] | None = None
    for c in grid_candidates(profile, cluster, global_batch_size):
        if c.fits and (best is None or c.L_ms < best[0]):
            best = (c.L_ms, c.plan, c.point.label)
    for x in expert_grid_candidates(profile, cluster, global_batch_size):
        if best is None or x.L_ms < best[0]:
            best = (x.L_ms, x.plan, x.label)
    if best is None:
        raise InfeasibleError("grid: " + infeasible_message(profile, cluster, global_batch_size))
    return best[1], best[2]
