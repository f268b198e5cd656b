"""The DAPPLE search's named steps (planner/cut_search.py, planner/search.py) on their own."""

from __future__ import annotations

import math

import pytest

from builders import make_cluster, make_profile
from dapple.planner.cut_search import (
    CutSearch,
    Incumbent,
    SearchLimits,
    balanced_cut,
    kept_placements,
    search_limits,
    stage_bound,
)
from dapple.planner.placement import place
from dapple.planner.scorer import Scorer
from dapple.planner.search import (
    _lower_bound,
    _rank_micro_batches,
    _seeds,
    cut_points,
    dapple_search,
)


def _scorer(n: int = 6, servers: int = 1, per_server: int = 4, G: int = 16) -> Scorer:
    return Scorer(make_profile(n), make_cluster(servers, per_server), G, 0)


def test_limits_resolve_the_defaults_by_instance_size() -> None:
    small = search_limits(8, 16, None, -1, -1, -1, -1)  # N x G = 128: small
    assert small == SearchLimits(8, None, None, 64, None)
    mid = search_limits(50, 16, None, -1, -1, -1, -1)
    assert mid == SearchLimits(16, 4, 2, 1, 3)
    huge = search_limits(50, 256, 4, -1, -1, -1, -1)  # beyond 128 devices; S_max capped
    assert huge == SearchLimits(4, 2, 1, 1, 3, idle_beyond_b=False)
    given = search_limits(50, 256, None, 7, None, 5, None)  # given values are kept
    assert given == SearchLimits(50, 7, None, 5, None, idle_beyond_b=False)


def test_incumbent_takes_a_plan_with_its_latency() -> None:
    sc = _scorer()
    best = Incumbent()
    assert best.L_ms == math.inf and best.scored is None
    stages = [(0, 6, (0, 1, 2, 3))]
    got = sc.score(stages, 4)
    assert got is not None
    best.take(stages, 4, got)
    assert (best.L_ms, best.stages, best.M, best.scored) == (got.L_ms, stages, 4, got)


def test_incumbent_keeps_the_plan_of_most_stages_at_each_m_whatever_its_latency() -> None:
    """``offer`` takes a plan below the incumbent's L, and keeps at each M the plan of most
    stages offered (of least L among as many), also when it is above the incumbent's L."""
    sc = _scorer()
    best = Incumbent()
    one = [(0, 6, (0, 1, 2, 3))]
    two = [(0, 3, (0, 1)), (3, 6, (2, 3))]
    two_b = [(0, 2, (0, 1)), (2, 6, (2, 3))]
    got = {M: [sc.score(p, M) for p in (one, two, two_b)] for M in (2, 4)}
    assert all(g is not None for gs in got.values() for g in gs)
    order = [(one, 4, got[4][0]), (two, 4, got[4][1]), (two_b, 4, got[4][2]), (one, 2, got[2][0])]
    for stages, M, scored in order:
        best.offer(stages, M, scored)
    least = min(order, key=lambda x: x[2].L_ms)  # type: ignore[union-attr]
    assert (best.stages, best.M) == (least[0], least[1])
    two_best = min((two, got[4][1]), (two_b, got[4][2]), key=lambda x: x[1].L_ms)  # type: ignore[union-attr]
    assert best.finest[4] == two_best
    assert best.finest[2] == (one, got[2][0])


def test_micro_batch_ranking_offers_every_seed_and_puts_the_best_m_first() -> None:
    sc = _scorer()
    Ms = [1, 2, 4, 8, 16]
    best = Incumbent()
    ranked = _rank_micro_batches(sc, Ms, 16, 4, best)
    assert sorted(ranked) == Ms
    seed_best = {}
    for M in Ms:
        scores = [sc.score(s, M) for s in _seeds(sc, 16 // M)]
        seed_best[M] = min(g.L_ms for g in scores if g is not None)
    assert ranked == sorted(Ms, key=lambda M: (seed_best[M], M))
    assert best.L_ms == min(seed_best.values()) and ranked[0] == best.M


def test_cut_range_is_every_later_cut_or_a_window_around_the_balance_point() -> None:
    sc = _scorer(n=12)
    cuts = cut_points(sc, 64)
    assert cuts == list(range(13))
    every = SearchLimits(4, None, None, 1, None)
    dp = CutSearch(sc, make_cluster(1, 4), cuts, 4, 4, every, Incumbent())
    assert dp.cut_range(2, 1, 3) == (3, 11)
    windowed = SearchLimits(4, None, 1, 1, None)
    dp = CutSearch(sc, make_cluster(1, 4), cuts, 4, 4, windowed, Incumbent())
    mid = balanced_cut(sc, cuts, 0, 1, 3, 4)
    assert dp.cut_range(0, 1, 3) == (max(1, mid - 1), min(11, mid + 1))
    # uniform layers, one replica against three: the balance point gives the first stage
    # at least as much time per micro-batch as the rest
    f1, b1 = sc.fb_ms(0, mid, 4)
    f2, b2 = sc.fb_ms(mid, 12, 2)
    assert f1 + b1 >= f2 + b2


def test_a_state_keeps_its_best_prefixes_and_is_found_at_its_cut() -> None:
    sc = _scorer()
    limits = SearchLimits(4, None, None, 2, None)
    dp = CutSearch(sc, make_cluster(1, 4), list(range(7)), 4, 4, limits, Incumbent())
    assert dp.buckets[0] == [(0, (0,))] and dp.memo[(0, (0,))][0][1] == ()
    key = (3, (1,))
    for lat in (5.0, 3.0, 4.0, 9.0):
        dp.remember(key, lat, ((0, 3, (0,)),), (1,))
    assert [e[0] for e in dp.memo[key]] == [3.0, 4.0]  # the two best, best first
    assert dp.buckets[3] == [key]  # registered once


def test_beam_and_pruning() -> None:
    sc = _scorer()
    beam = SearchLimits(3, 1, None, 1, None)
    best = Incumbent()
    dp = CutSearch(sc, make_cluster(1, 4), list(range(7)), 4, 4, beam, best)
    dp.remember((2, (1,)), 7.0, ((0, 2, (0,)),), (1,))
    dp.remember((2, (2,)), 6.0, ((0, 2, (0, 1)),), (2,))
    assert dp.frontier(2) == [(2, (2,))]  # the beam keeps the best state
    assert not dp.prunable(((0, 2, (0,)),))
    assert dp.prunable(((0, 1, (0,)), (1, 2, (1,))))  # S_max 3: no room for two more stages
    best.L_ms = stage_bound(sc, 0, 2, 1, 4, 4)  # an incumbent the first stage alone reaches
    assert dp.prunable(((0, 2, (0,)),))


def test_the_dp_finds_at_least_the_seeds_best_plan() -> None:
    sc = _scorer()
    best = Incumbent()
    ranked = _rank_micro_batches(sc, [4], 16, 4, best)
    seeded = best.L_ms
    CutSearch(sc, make_cluster(1, 4), cut_points(sc, 64), ranked[0], 4,
              SearchLimits(4, None, None, 64, None), best).run()  # fmt: skip
    assert best.L_ms <= seeded
    plan = dapple_search(make_profile(6), make_cluster(1, 4), 16)
    assert plan.predicted_step_ms <= best.L_ms * (1 + 1e-12)


@pytest.mark.parametrize("servers", [1, 2])
def test_search_is_deterministic(servers: int) -> None:
    p, c = make_profile(8), make_cluster(servers, 4)
    assert dapple_search(p, c, 32) == dapple_search(p, c, 32)


def test_micro_batch_ranking_skips_seeds_by_their_bound_and_ranks_as_scoring_all() -> None:
    """16 devices, 12 layers: the ranking scores only the seeds whose ``M (F_s + B_s)`` bound
    is below both their M's best and the incumbent, and still ranks the M and takes the
    incumbent as scoring every seed does."""
    sc = Scorer(make_profile(12), make_cluster(2, 8), 64, 0)
    Ms = [1, 2, 4, 8, 16, 32, 64]
    best = Incumbent()
    ranked = _rank_micro_batches(sc, Ms, 64, 16, best)
    seeds = {M: _seeds(sc, 64 // M) for M in Ms}
    assert sc.evaluations < sum(len(s) for s in seeds.values())  # the bound skipped some
    brute = Scorer(make_profile(12), make_cluster(2, 8), 64, 0)
    seed_best = {}
    first: tuple[float, int, int] | None = None  # (L, M's index, seed's index) of the best
    for mi, M in enumerate(Ms):
        scores = [brute.score(s, M) for s in seeds[M]]
        seed_best[M] = min((g.L_ms for g in scores if g is not None), default=math.inf)
        for si, g in enumerate(scores):
            if g is not None and (first is None or g.L_ms < first[0]):
                first = (g.L_ms, mi, si)
    assert first is not None
    assert ranked == sorted(Ms, key=lambda M: (seed_best[M], M))
    assert (best.L_ms, best.M, best.stages) == (
        first[0],
        Ms[first[1]],
        seeds[Ms[first[1]]][first[2]],
    )


def test_a_seeds_bound_is_below_its_latency_and_reaches_it() -> None:
    """``_lower_bound`` (the largest ``M (F_s + B_s)``, less a rounding margin) never exceeds
    a seed's L at any M, and equals it up to the margin where one stage alone paces the step
    (M = 1, one stage on one device)."""
    sc = Scorer(make_profile(12), make_cluster(2, 8), 64, 0)
    ratios = []
    for M in [1, 2, 4, 8, 16, 32, 64]:
        for stages in _seeds(sc, 64 // M):
            got = sc.score(stages, M)
            if got is not None:
                ratios.append(_lower_bound(sc, stages, 64 // M, M) / got.L_ms)
    assert max(ratios) <= 1.0
    assert max(ratios) == pytest.approx(1.0, abs=1e-6)


def test_a_placement_of_more_than_b_devices_keeps_its_first_b_with_the_rest_freed_or_idle() -> None:
    c = make_cluster(2, 3)
    whole = place(c, (1, 0), 4, "fresh")  # server 1 whole, then device 1 of server 0
    assert whole == ((1, 3, 4, 5), (2, 3))
    assert kept_placements(c, (1, 0), whole, 4) == (whole,)  # m' <= b: as placed
    freed, idle = kept_placements(c, (1, 0), whole, 2)
    assert freed == ((1, 3), (2, 1))  # devices 2, 4 and 5 free for the later stages
    assert idle == ((1, 3), (2, 3))  # devices 4 and 5 left idle: the later stages start at 2
    assert kept_placements(c, (1, 0), whole, 2, idle=False) == (freed,)
