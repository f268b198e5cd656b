"""The plans :func:`~dapple.planner.search.dapple_search` offers beside its DP's: ZeRO twins,
the uniform dp x tp x pp grid's points (:mod:`dapple.planner.grid`, torchtitan's layout) and
interleaved 1F1B plans (:mod:`dapple.planner.interleaving`), so its plan is never slower by L
than any of them that its options allow."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.cost.host import has_host_terms
from dapple.planner.expert_width import has_experts, without_expert_widths
from dapple.planner.grid import GridPoint, grid_candidates
from dapple.planner.interleaving import best_interleaved, grid_offers, own_offers
from dapple.planner.scorer import Scorer
from dapple.planner.zero_twins import zero_twins

__all__ = ["with_offers"]


def with_offers(
    found: Sequence[tuple[float, int, Plan]],
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    widths: Sequence[int],
    scorers: Mapping[int, Scorer],
    Ms: Sequence[int],
    *,
    zero_stage: ZeroChoice,
    max_stages: int | None,
    grid: bool,
    interleaved: bool,
) -> list[tuple[float, int, Plan]]:
    """``found``, the search's own plans ``(L, t, plan)`` for tensor widths ``widths`` (their
    scorers ``scorers``) at micro-batch counts ``Ms``, and after them the plans offered beside
    them, in this order:

    * under ``zero_stage`` auto, on a profile without MoE layers: each plan found also with
      every replicated stage at ZeRO 0-3 (:func:`~dapple.planner.zero_twins.zero_twins`);
    * with ``grid``: the grid's 1F1B points inside the search's space (:func:`_grid_filter`:
      widths among ``widths``, at most ``max_stages`` device groups, ZeRO-3 under 3 or auto;
      none under ZeRO-1/2, which the grid has no points of; :func:`_grid_offers`);
    * with ``interleaved``, not on a cluster with host terms (the interleaved step rule does
      not cost them, so its L would not compare with the DP's): the fastest interleaved plan
      (v = 2) below the least L so far that fits, among the plans so far cut into chunks (their
      expert widths dropped: the runtime runs EP under 1F1B only) and, with ``grid``, the
      grid's interleaved points (:func:`_interleaved_offers`).
    """
    found = list(found)
    if zero_stage == "auto" and not has_experts(profile):  # twins are scored without EP widths
        found += zero_twins(found, profile, cluster, global_batch_size)
    own = [(t, without_expert_widths(plan)) for _, t, plan in found]  # EP runs under 1F1B only
    accept = _grid_filter(zero_stage, widths, max_stages) if grid else None
    if accept is not None and zero_stage not in (1, 2):  # the grid has no ZeRO-1/2 points
        found += _grid_offers(profile, cluster, global_batch_size, Ms, accept, zero_stage)
    if interleaved and not has_host_terms(cluster):  # the step rule has no CPU-host pass
        found += _interleaved_offers(
            scorers, own, accept, Ms, min((x[0] for x in found), default=math.inf)
        )
    return found


def _grid_offers(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    Ms: Sequence[int],
    accept: Callable[[GridPoint], bool],
    zero_stage: ZeroChoice = 0,
) -> list[tuple[float, int, Plan]]:
    """The feasible 1F1B points of the uniform grid (:mod:`dapple.planner.grid`) at this
    search's M (``Ms``) that ``accept`` takes (:func:`_grid_filter`); the interleaved ones are
    :func:`_interleaved_offers`. Under ``zero_stage`` auto an FSDP point is offered where its
    DDP twin does not fit or is slower by L: the search's own stages shard only where memory
    asks for it (:func:`~dapple.planner.stage_options.pick_zero_mode`), so the grid point whose
    shards' 1/r_s update lowers L comes in as a whole plan."""
    cands = grid_candidates(
        profile, cluster, global_batch_size, interleaved=False, micro_batches=Ms
    )
    ddp_L = {c.point: c.L_ms for c in cands if c.fits and not c.point.parallel.shards_params}

    def offered(p: GridPoint, L_ms: float) -> bool:
        twin = ddp_L.get(dataclasses.replace(p, zero_stage=0), math.inf)
        return accept(p) and not (
            zero_stage == "auto" and p.parallel.shards_params and twin <= L_ms
        )

    return [
        (c.L_ms, c.point.tp, dataclasses.replace(c.plan, planner="dapple"))
        for c in cands
        if c.fits and offered(c.point, c.L_ms)
    ]


def _grid_filter(
    zero_stage: ZeroChoice, widths: Sequence[int], max_stages: int | None
) -> Callable[[GridPoint], bool]:
    """Whether a grid point is inside this search's space: its width among ``widths``, at most
    ``max_stages`` device groups (pp; an interleaved point's pp x v virtual stages run on pp
    groups), ZeRO-3 only when ``zero_stage`` allows it (3 or auto) and nothing under ZeRO-1/2
    (the grid has no ZeRO-1/2 points)."""

    def accept(p: GridPoint) -> bool:
        if zero_stage in (1, 2) or p.tp not in widths:
            return False
        if max_stages is not None and p.pp > max_stages:
            return False
        return not p.parallel.shards_params or zero_stage in (3, "auto")

    return accept


def _interleaved_offers(
    scorers: Mapping[int, Scorer],
    own: Sequence[tuple[int, Plan]],
    accept: Callable[[GridPoint], bool] | None,
    Ms: Sequence[int],
    below_ms: float,
) -> list[tuple[float, int, Plan]]:
    """The interleaved 1F1B plan of least L below ``below_ms`` that fits, if any
    (:mod:`dapple.planner.interleaving`): the search's ``own`` plans interleaved, and the grid's
    interleaved points that ``accept`` takes (none when None), at this search's M (``Ms``)."""
    sc = next(iter(scorers.values()))
    profile, cluster, B = sc.profile, sc.real_cluster, sc.global_batch_size
    offers = own_offers(own, profile, list(scorers), Ms)
    if accept is not None:
        offers += grid_offers(profile, cluster, B, list(scorers), Ms, accept)
    got = best_interleaved(offers, scorers, profile, cluster, below_ms)
    return [] if got is None else [got]
