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

The per-stage pick is local (a stage's AR_s + U_s against M more forward passes), so on a plan
L may be lower with ZeRO-1 and re-computation where the pick takes ZeRO-2 (its M-fold gradient
traffic in AR_s), and the local search of per-stage widths from such a start may climb to a
higher L: :class:`WithoutZero2` is auto without ZeRO-2, another scorer for that local search
(:func:`without_zero2`). Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.planner.move_scores import WidthStage
from dapple.planner.scorer import Scorer
from dapple.planner.stage_widths import MixedScorer
from dapple.planner.zero_modes import ZeroMode

__all__ = ["TWIN_STAGES", "WithoutZero2", "without_zero2", "zero_twins"]

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


class WithoutZero2(Scorer):
    """A :class:`Scorer` under ``auto`` that offers a replicated stage every mode but ZeRO-2."""

    def _modes(self, s: int, e: int, replicas: int) -> tuple[ZeroMode, ...]:
        return tuple(m for m in super()._modes(s, e, replicas) if m.stage != 2)


def without_zero2(scorers: Mapping[int, Scorer]) -> dict[int, Scorer] | None:
    """``scorers`` (by tensor width) as :class:`WithoutZero2`, or None unless every one is a
    plain :class:`Scorer` under ``auto`` (a scorer of expert widths picks its own modes)."""
    if not all(type(sc) is Scorer and sc.zero_stage == "auto" for sc in scorers.values()):
        return None
    return {
        t: WithoutZero2(sc.profile, sc.real_cluster, sc.global_batch_size, "auto", t)
        for t, sc in scorers.items()
    }
