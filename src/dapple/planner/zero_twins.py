"""A plan's zero twins: its stages re-scored with every replicated stage at one explicit zero stage.

Under ``--zero-stage auto`` the scorer keeps a stage unsharded wherever it holds its K_i
micro-batches (:func:`~dapple.planner.stage_options.pick_zero_mode`), so a search under auto
does not see what an explicit ZeRO stage buys a stage that memory does not ask to shard: the
1/r_s update in AR_s + U_s, and the room that interleaving's extra micro-batches in flight
need. :func:`zero_twins` scores each plan the search found again under each explicit zero
stage (:data:`TWIN_STAGES`): the same cuts, devices, widths and M, each stage's
re-computation and D chosen again by that stage's scorer. The search offers the twins beside
the plans (1F1B) and interleaves them with the plans (:mod:`dapple.planner.interleaving`), so
a plan under auto is never slower by L than an explicit zero stage's on those structures.
Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.planner.move_scores import WidthStage
from dapple.planner.scorer import Scorer
from dapple.planner.stage_widths import MixedScorer

__all__ = ["TWIN_STAGES", "zero_twins"]

TWIN_STAGES: tuple[ZeroChoice, ...] = (0, 1, 2, 3)
"""The explicit zero stages a plan found under auto is re-scored at."""

Found = tuple[float, int, Plan]
"""``(L, tensor width of the search that found it, plan)``, as the search collects them."""


def zero_twins(
    found: Sequence[Found], profile: ModelProfile, cluster: Cluster, global_batch_size: int
) -> list[Found]:
    """Each 1F1B plan of ``found`` scored under each of :data:`TWIN_STAGES`: the twins that fit
    and differ from their plan in some stage's zero stage, re-computation or D, as
    ``(L, width, plan)`` with the plan's width (whatever their L: a twin slower under 1F1B may
    interleave faster).

    Args:
        found: the search's plans, each of one device group per stage (``schedule`` dapple).
        profile: the searched profile.
        cluster: the searched cluster (its usable devices).
        global_batch_size: samples per step.
    """
    plans = [(t, p) for _, t, p in found if p.virtual_stages == 1 and p.schedule == "dapple"]
    widths = sorted({st.tensor_width for _, p in plans for st in p.stages})
    out: list[Found] = []
    if not plans:  # nothing fits: nothing to twin
        return out
    seen = {p.stages for _, p in plans}
    for z in TWIN_STAGES:
        mixed = MixedScorer({w: Scorer(profile, cluster, global_batch_size, z, w) for w in widths})
        for t, plan in plans:
            stages: list[WidthStage] = [
                (*st.layers, st.devices, st.tensor_width) for st in plan.stages
            ]
            M = plan.num_micro_batches
            got = mixed.score(stages, M)
            if got is None:
                continue
            twin = mixed.build_plan(plan.planner, stages, M, got)
            if twin.stages not in seen:
                seen.add(twin.stages)
                out.append((got.L_ms, t, twin))
    return out
