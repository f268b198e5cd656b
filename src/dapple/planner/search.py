"""DAPPLE planning algorithm (section 5.3, equations 4-5): DP over partition, replication, placement.

``T_PL(j, m, g)``: the first j layers are planned as stages on the m devices ``g`` and the
remaining layers ``[j, N)`` form the last stage on the other G - m devices; its value is the
pipeline latency L of that whole plan (equation 2). One step (equation 5) cuts the last stage
at ``j' > j`` into a new stage ``[j, j')`` on ``m'`` devices placed by each of the three
policies (section 5.2) and a last stage ``[j', N)`` on the rest. Each state keeps its best
prefix (memoised search); the answer (equation 4) is the best state. The device set g is
represented by the per-server occupancy, which the placement policies fully determine. The
DP of one M is :class:`dapple.planner.cut_search.CutSearch`; :func:`dapple_search` resolves
its limits, ranks the M by their seeds (:func:`_rank_micro_batches`), runs the DP for the most
promising and refines the best plan.

Beyond the paper: the search also chooses M among divisors of the global batch size (at most
:data:`MAX_MICRO_BATCH_COUNTS` of them, :func:`micro_batch_candidates`, so the work does not
grow with the batch), the warm-up policy A/B, and per stage re-computation and the in-flight
bound D when memory demands them (:class:`dapple.planner.scorer.Scorer`), and the tensor width
t_i of each stage: one search per width t with every stage of width t, each plan then refined to
per-stage widths by a local search (:mod:`dapple.planner.stage_widths`), which also starts from
the width's plan of most stages at that plan's M (:func:`_finest_start`) and, under
``--zero-stage auto``, refines a plan also without ZeRO-2 where that lowers its L
(:func:`_without_zero2`: the per-stage pick of a zero mode is local). It offers the
uniform torchtitan-style grid's 1F1B plans inside its space (:mod:`dapple.planner.grid`) and,
with ``interleaved=True``, interleaved 1F1B: its own plans cut into v = 2 chunks per device
group and the grid's interleaved points, costed by the interleaved step rule and memory replay
(:mod:`dapple.planner.interleaving`); its plan is never slower by L than any of them.
It is kept fast by:

* on a cluster of more devices than any plan of the batch keeps busy (S_max x B x t_max), the
  search enumerates only the first servers holding that many (:mod:`dapple.core.usable`);
* a lower bound ``L >= M (F_s + B_s)`` of a computation stage s: a new stage reaching the best
  L found stops the scan over longer stages, and prefixes holding such a stage are dropped; a
  regular candidate whose bound reaches both its M's best and the best L is not scored;
* regular seed candidates (:func:`_seeds`: k time-balanced stages on r consecutive devices,
  also with idle devices) scored first, giving a good incumbent and ranking the M;
* states keyed by occupancy up to a permutation of servers (servers are interchangeable);
* on instances with N x G > 128 only: a beam of ``states_per_layer`` states per cut point
  (4, or 2 beyond 128 devices), new cuts within ``window`` cut points of the two-stage
  balance point (2, or 1 beyond 128 devices), one prefix per state
  (the paper's memoisation; small instances keep 64), the DP for the 3 most promising M;
* beyond ``cut_limit`` layers, cuts only at that many equal-time positions
  (:func:`cut_points`); always a final one-layer hill climb of the best plan's cuts and a
  re-pick of M (:func:`_refine`);
* beyond 32 devices, replica counts by server counts (:func:`candidate_replicas`);
* the widths t in increasing order, each searched as it is alone (no width's L prunes another's:
  :func:`_refine` can take a plan above it to one below it); a width-t search (t > 1) stops a new stage's scan where the stage alone fits no memory
  (:attr:`~dapple.planner.cut_search.SearchLimits.drop_unfit`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.core.usable import usable_cluster, usable_devices
from dapple.cost.host import has_host_terms
from dapple.errors import InfeasibleError
from dapple.planner.batches import (
    DENSE_MICRO_BATCH_COUNTS,
    DIVISOR_SCAN,
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_COUNTS,
    check_global_batch_size,
    infeasible_message,
    micro_batch_candidates,
)
from dapple.planner.cut_search import (
    CutSearch,
    Incumbent,
    SearchLimits,
    candidate_replicas,
    search_limits,
    stage_bound,
)
from dapple.planner.expert_width import (
    has_experts,
    make_scorer,
    with_and_without_widths,
    zero_zero_twin,
)
from dapple.planner.move_scores import WidthStage
from dapple.planner.partition import block_partition
from dapple.planner.scorer import Scored, Scorer, StageSpec
from dapple.planner.search_offers import with_offers
from dapple.planner.stage_widths import MixedScorer, refine_stage_widths
from dapple.planner.widths import real_devices, width_candidates
from dapple.planner.zero_twins import without_zero2

__all__ = [
    "DENSE_MICRO_BATCH_COUNTS",
    "DIVISOR_SCAN",
    "MAX_GLOBAL_BATCH_SIZE",
    "MAX_MICRO_BATCH_COUNTS",
    "candidate_replicas",
    "check_global_batch_size",
    "dapple_search",
    "micro_batch_candidates",
]

log = logging.getLogger(__name__)

SECOND_PASS_M = 3
"""On a profile with MoE layers, the search without expert widths runs its DP for this many M
(the most promising by their seeds, as a large instance does) unless ``m_candidates`` is given."""

BOUND_ROUNDING = 1e-9
"""Relative margin of :func:`_lower_bound` for the rounding of L's sums."""

Progress = Callable[[int, int], None]


def cut_points(sc: Scorer, limit: int) -> list[int]:
    """Layer boundaries the DP may cut at: all of 0..N when N <= limit, else ``limit`` points
    at equal steps of cumulative compute time (the final plan's cuts are then refined by
    :func:`_refine` to single layers)."""
    N = sc.N
    if limit >= N:
        return list(range(N + 1))
    total = sum(sc.fb_ms(0, N, 1))
    out = {0, N}
    layer = 0
    for k in range(1, limit):
        target = total * k / limit
        while layer < N and sum(sc.fb_ms(0, layer, 1)) < target:
            layer += 1
        out.add(layer)
    return sorted(out)


def _refine(
    sc: Scorer, stages: list[StageSpec], M: int, best: Scored, Ms: Sequence[int]
) -> tuple[list[StageSpec], int, Scored]:
    """Hill-climb the cut positions one layer at a time, then re-pick M for the structure."""
    improved = True
    rounds = 0
    while improved and rounds < 4 * sc.N:
        improved = False
        rounds += 1
        for i in range(len(stages) - 1):
            for delta in (-1, 1):
                cut = stages[i][1] + delta
                if not stages[i][0] < cut < stages[i + 1][1]:
                    continue
                cand = list(stages)
                cand[i] = (stages[i][0], cut, stages[i][2])
                cand[i + 1] = (cut, stages[i + 1][1], stages[i + 1][2])
                got = sc.score(cand, M)
                if got is not None and got.L_ms < best.L_ms:
                    stages, best, improved = cand, got, True
    for m in Ms:
        got = sc.score(stages, m)
        if got is not None and got.L_ms < best.L_ms:
            M, best = m, got
    return stages, M, best


def _seeds(sc: Scorer, b: int) -> list[list[StageSpec]]:
    """Regular candidates scored first, giving the pruning a good incumbent and covering plans
    that leave devices idle (which the DP, using all G devices like the paper, cannot): k
    stages balanced by time (:func:`block_partition`), each on r consecutive devices, k r <= G.
    """
    N, G = sc.N, sc.G
    big = G > 32
    ks = list(range(1, min(N, G) + 1))
    if big:
        ks = sorted({k for k in ks if k & (k - 1) == 0} | {min(N, G)})
    times = []
    for i in range(N):
        f, bw = sc.fb_ms(i, i + 1, b)
        times.append(f + bw)
    out: list[list[StageSpec]] = []
    for k in ks:
        cuts = block_partition(times, k, exact=N <= 16)
        rs = {G // k} | (
            {r for r in range(1, G // k + 1) if r & (r - 1) == 0}
            if big
            else set(range(1, G // k + 1))
        )
        for r in sorted(rs):
            out.append([(cuts[i], cuts[i + 1], tuple(range(i * r, (i + 1) * r))) for i in range(k)])
    return out


def dapple_search(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    *,
    max_stages: int | None = None,
    states_per_layer: int | None = -1,
    window: int | None = -1,
    keep: int = -1,
    m_candidates: int | None = -1,
    cut_limit: int = 64,
    progress: Progress | None = None,
    zero_stage: ZeroChoice = 0,
    tensor_widths: Sequence[int] | None = None,
    stage_widths: bool = True,
    grid: bool = True,
    interleaved: bool = False,
    experts: bool | None = None,
    below_ms: float = math.inf,
) -> Plan:
    """The DAPPLE plan minimising L (equations 4-5) over partition, replication, placement, M.

    Args:
        profile: model profile (N layers).
        cluster: G devices.
        global_batch_size: samples per step.
        max_stages: cap on computation stages (default: no cap but G).
        states_per_layer: a beam of this many best states per layer boundary (None: every
            state). window: new cuts within this many cut points of the two-stage balance
            point (:func:`~dapple.planner.cut_search.balanced_cut`; None: every cut). keep:
            prefixes kept per state (1 in the paper's memoised search). m_candidates: the DP
            runs for this many M, the most promising by their seeds (:func:`_seeds`; None:
            every :func:`micro_batch_candidates`), and the plan's M is re-picked among all.
            Each -1 (default) is picked by the instance's size
            (:func:`~dapple.planner.cut_search.search_limits`).
        cut_limit: the DP cuts only at :func:`cut_points` (at most this many + 1); the
            final cuts are refined layer by layer.
        progress: called as ``progress(done, total)`` after each candidate M.
        zero_stage: 1 (ZeRO-1) or 2 (ZeRO-2): replicated stages shard their optimizer state
            (and gradients), in memory and in AR_s; 3 (ZeRO-3) also their parameters,
            re-gathered per micro-batch where memory asks for it (``StagePlan.regather``);
            ``auto``: per stage where memory asks for it
            (:class:`~dapple.planner.scorer.Scorer`), with the offers of :func:`with_offers`. The
            plan records each stage's choice (``StagePlan.zero_stage``).
        tensor_widths: the tensor widths t to search (:func:`_search_widths`); None:
            :func:`~dapple.planner.widths.width_candidates` (1 alone for a profile with no
            layer that shards).
        stage_widths: refine each width's plan to per-stage widths t_i (:func:`_search_widths`);
            False keeps the uniform-width plans only.
        grid: also offer the uniform dp x tp x pp grid's plans inside this search's space
            (torchtitan's layout, :func:`with_offers`), so the plan is never slower by L than any
            of them.
        interleaved: also offer interleaved 1F1B (v = 2 chunks per device group,
            :func:`with_offers`); False (default): 1F1B plans only, each with the paper's K_i per
            stage (``dapple plan --interleave`` sets it).
        experts: True: offer each stage of MoE layers an expert-parallel width e_s
            (:mod:`dapple.planner.expert_width`); False: every replica holds all its experts;
            None (default): on a profile with MoE layers both (:func:`_both_expert_ways`).
        below_ms: return only a plan of L below this (InfeasibleError when none is). It
            starts each width's incumbent only where no per-stage widths follow (a uniform
            plan above it may refine to one below it); like any bound that prunes, it may lose
            a plan that :func:`_refine` would have taken below it (see :func:`_search_widths`).

    Raises:
        InfeasibleError: no plan fits device memory for any M.
    """
    if experts is None and has_experts(profile):
        search = partial(dapple_search, profile, cluster, global_batch_size,
                         max_stages=max_stages, states_per_layer=states_per_layer,
                         window=window, keep=keep, cut_limit=cut_limit, zero_stage=zero_stage,
                         tensor_widths=tensor_widths, stage_widths=stage_widths, grid=grid,
                         interleaved=interleaved)  # fmt: skip
        return _both_expert_ways(search, m_candidates, progress)
    widths = width_candidates(profile, cluster) if tensor_widths is None else list(tensor_widths)
    usable = usable_devices(profile.num_layers, global_batch_size, widths, max_stages)
    cluster = usable_cluster(cluster, usable)  # idle devices do not enlarge the search
    Ms = micro_batch_candidates(global_batch_size)
    scorers = {
        t: make_scorer(
            profile, cluster, global_batch_size, zero_stage, t, experts=experts is not False
        )
        for t in widths
    }
    limits = partial(search_limits, max_stages=max_stages, states_per_layer=states_per_layer,
                     window=window, keep=keep, m_candidates=m_candidates)  # fmt: skip
    found = _search_widths(profile, global_batch_size, widths, scorers, Ms, limits, cut_limit,
                           stage_widths, below_ms, progress)  # fmt: skip
    found = with_offers(found, profile, cluster, global_batch_size, widths, scorers, Ms,
                        zero_stage=zero_stage, max_stages=max_stages, grid=grid,
                        interleaved=interleaved)  # fmt: skip
    found = [x for x in found if x[0] < below_ms]
    if not found:
        raise InfeasibleError(infeasible_message(profile, cluster, global_batch_size))
    return min(found, key=lambda x: (x[0], x[1]))[2]


def _both_expert_ways(
    search: Callable[..., Plan], m_candidates: int | None, progress: Progress | None
) -> Plan:
    """On a profile with MoE layers: the search run with the expert widths offered and without
    (``progress`` reports the first only), keeping the plan of lower L
    (:func:`~dapple.planner.expert_width.with_and_without_widths`: a search that prunes is not
    monotone in its options). The second search is bounded: only plans below the first's L
    count (``below_ms``, which prunes its DP), and its DP runs for :data:`SECOND_PASS_M` M
    unless ``m_candidates`` is given."""
    return with_and_without_widths(
        lambda ep, below: search(
            m_candidates=m_candidates if ep or m_candidates != -1 else SECOND_PASS_M,
            progress=progress if ep else None,
            experts=ep,
            below_ms=below,
        )
    )


def _search_widths(
    profile: ModelProfile,
    global_batch_size: int,
    widths: Sequence[int],
    scorers: Mapping[int, Scorer],
    Ms: Sequence[int],
    limits: Callable[..., SearchLimits],
    cut_limit: int,
    stage_widths: bool,
    below_ms: float,
    progress: Progress | None,
) -> list[tuple[float, int, Plan]]:
    """The DP's plans, ``(L, t, plan)``: one search per tensor width t of ``widths`` (its scorer
    in ``scorers``), every stage of width t, in the order of ``widths``. No width's L prunes
    another's search: the DP's plan is refined after it (:func:`_refine`: cut moves, then M
    picked again), which can take a plan above a narrower width's L to one below it. Each
    width's DP prunes by its own incumbent only, as that width searched alone does, so the
    search is never worse than a width's own search; the caller's ``below_ms`` alone starts
    the incumbents, where no per-stage widths follow (the bounded second MoE pass,
    :func:`_both_expert_ways`). Each width's plan is then refined to per-stage widths t_i
    among them (:mod:`dapple.planner.stage_widths`) with ``stage_widths``, when more than one
    width is searched and some layer shards, and so is the width's plan of most stages at its M
    (:func:`_finest_start`), and under ``auto`` also without ZeRO-2 where that lowers the
    plan's L (:func:`_without_zero2`). On a profile with MoE layers a width is searched
    once more with the expert widths at ZeRO 0 only
    (:func:`~dapple.planner.expert_width.zero_zero_twin`), a second start for the per-stage
    widths. ``limits``: :func:`~dapple.planner.cut_search.search_limits` given N, G and the
    devices of a width's groups."""
    shards = any(x.tensor_parallel for x in profile.layers)
    mixed = MixedScorer(scorers) if stage_widths and len(scorers) > 1 and shards else None
    without = without_zero2(scorers) if mixed is not None else None
    no2 = None if without is None else MixedScorer(without)
    found: list[tuple[float, int, Plan]] = []
    # a caller's bound, not a narrower width's L; only where no per-stage widths follow (a
    # uniform plan above it may refine below it)
    start = below_ms if mixed is None else math.inf
    for i, t in enumerate(widths):
        sc = scorers[t]
        width_limits = dataclasses.replace(limits(sc.N, sc.G, devices=sc.G * t), drop_unfit=t > 1)
        step = None if progress is None else partial(_width_progress, progress, i, len(widths))
        twin = zero_zero_twin(sc)  # EP widths at ZeRO 0 only: another start for stage_widths
        passes = [(sc, mixed, step)]
        if twin is not None:
            passes.append((twin, mixed and MixedScorer({**scorers, t: twin}), None))
        for one, mix, report in passes:
            best = Incumbent(start)
            _search_width(one, Ms, global_batch_size, width_limits, best, cut_limit, report)
            if best.scored is not None:
                stages, M, scored = _refine(one, best.stages, best.M, best.scored, Ms)
                found.append((scored.L_ms, t, one.build_plan("dapple", stages, M, scored)))
                if mix is not None:
                    found += _stage_widths(mix, t, stages, M, scored, Ms)
                    found += _finest_start(one, mix, t, best, Ms)
                    if mix is mixed and no2 is not None:
                        found += _without_zero2(no2, t, stages, M, scored, Ms)
    return found


def _without_zero2(
    no2: MixedScorer,
    t: int,
    stages: list[StageSpec],
    M: int,
    scored: Scored,
    Ms: Sequence[int],
) -> list[tuple[float, int, Plan]]:
    """The width-t plan refined to per-stage widths (:func:`_stage_widths`) by ``no2``, the
    scorers without ZeRO-2 (:class:`~dapple.planner.zero_twins.WithoutZero2`), when a stage of
    its ``scored`` picks ZeRO-2 and the plan's L is lower without it: the local picks of ZeRO-2
    made L higher there, and the local search may climb from it to a higher L than without."""
    if all(z.stage != 2 for z in scored.zero_modes):
        return []  # without ZeRO-2 each stage picks as it did: the same L
    got = no2.score(_at_width(stages, t), M)
    if got is None or got.L_ms >= scored.L_ms:
        return []
    return _stage_widths(no2, t, stages, M, got, Ms)


def _at_width(stages: list[StageSpec], t: int) -> list[WidthStage]:
    """The width-t search's stages as per-stage-width stages: each on its real devices, width t."""
    return [(s, e, real_devices(d, t), t) for s, e, d in stages]


def _finest_start(
    sc: Scorer, mixed: MixedScorer, t: int, best: Incumbent, Ms: Sequence[int]
) -> list[tuple[float, int, Plan]]:
    """The per-stage-width plan refined, as the incumbent is (:func:`_refine`, then
    :func:`_stage_widths`), from the width-t search's plan of most stages at the incumbent's M
    (:attr:`~dapple.planner.cut_search.Incumbent.finest`) when it has more stages than the
    incumbent, whatever its L: the local search merges stages and never splits one, so a start
    of more stages leaves it more plans to reach."""
    got = best.finest.get(best.M)
    if got is None or len(got[0]) <= len(best.stages):
        return []
    stages, M, scored = _refine(sc, got[0], best.M, got[1], Ms)
    return _stage_widths(mixed, t, stages, M, scored, Ms)


def _width_progress(progress: Progress, i: int, widths: int, done: int, total: int) -> None:
    """``progress`` over all widths from the ``i``-th width's own ``(done, total)``."""
    progress(i * total + done, widths * total)


def _search_width(
    sc: Scorer,
    Ms: Sequence[int],
    global_batch_size: int,
    limits: SearchLimits,
    best: Incumbent,
    cut_limit: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """The DP of one tensor width: every promising M (the first ``limits.m_candidates`` of
    :func:`_rank_micro_batches`), cuts at :func:`cut_points`; the best found goes to ``best``."""
    ranked = _rank_micro_batches(sc, Ms, global_batch_size, limits.max_stages, best)
    if limits.m_candidates is not None:
        ranked = ranked[: limits.m_candidates]
    cuts = cut_points(sc, cut_limit)
    for done, M in enumerate(ranked, 1):
        CutSearch(sc, sc.cluster, cuts, M, global_batch_size // M, limits, best).run()
        if progress is not None:
            progress(done, len(ranked))
    log.debug("dapple search, width %d: %d candidates scored", sc.tensor_width, sc.evaluations)


def _stage_widths(
    mixed: MixedScorer,
    t: int,
    stages: list[StageSpec],
    M: int,
    scored: Scored,
    Ms: Sequence[int],
) -> list[tuple[float, int, Plan]]:
    """The plan of per-stage widths refined from the width-t search's plan
    (:func:`~dapple.planner.stage_widths.refine_stage_widths`), when its L is lower."""
    got = refine_stage_widths(mixed, _at_width(stages, t), M, Ms)
    if got is None or got[2].L_ms >= scored.L_ms:
        return []
    mixed_stages, m, best = got
    log.debug("dapple search, width %d: per-stage widths L %.3f -> %.3f", t, scored.L_ms, best.L_ms)
    return [(best.L_ms, t, mixed.build_plan("dapple", mixed_stages, m, best))]


def _rank_micro_batches(
    sc: Scorer, Ms: Sequence[int], global_batch_size: int, max_stages: int, best: Incumbent
) -> list[int]:
    """Score every M's regular candidates (:func:`_seeds`, at most ``max_stages`` stages),
    offering each that fits to ``best`` (taken when below its L); the M, most promising (lowest
    such L) first, so that the incumbent prunes the later ones harder."""
    ranked: list[tuple[float, int]] = []
    bounded = not has_host_terms(sc.cluster)  # the CPU-host pass reshapes F and B
    for M in Ms:
        m_best = math.inf
        b = global_batch_size // M
        for stages in _seeds(sc, b):
            if len(stages) > max_stages:
                continue
            if bounded and _lower_bound(sc, stages, b, M) >= max(m_best, best.L_ms):
                continue  # it would change neither this M's rank nor the incumbent
            got = sc.score(stages, M)
            if got is not None:
                m_best = min(m_best, got.L_ms)
                best.offer(stages, M, got)
        ranked.append((m_best, M))
    ranked.sort()
    return [M for _, M in ranked]


def _lower_bound(sc: Scorer, stages: Sequence[StageSpec], b: int, M: int) -> float:
    """A lower bound of the candidate's L, less a rounding margin: the largest of its stages'
    :func:`~dapple.planner.cut_search.stage_bound` (``L >= M (F_s + B_s)``, equations 1-3)."""
    return max(stage_bound(sc, s, e, len(d), b, M) for s, e, d in stages) * (1.0 - BOUND_ROUNDING)
