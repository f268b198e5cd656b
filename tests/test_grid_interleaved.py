"""Interleaved 1F1B in the DAPPLE search (:mod:`dapple.planner.interleaving`): its bounds and
re-cut by hand, its best-first pick against brute force over the same candidates, and the
search never slower by L than any feasible grid point, interleaved ones included."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import link_cluster, llm_layer
from dapple.core.cluster import Cluster
from dapple.core.cuts import with_cuts
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.planner import interleaving
from dapple.planner.batches import MAX_MICRO_BATCH_COUNTS, micro_batch_candidates
from dapple.planner.grid import MAX_INTERLEAVED_ACTIONS, grid_candidates
from dapple.planner.interleaving import (
    SLACK,
    Offer,
    any_cuts_bound_ms,
    balanced_cuts,
    best_interleaved,
    grid_offers,
    group_work_ms,
    leaner_cuts,
    lower_bound_ms,
    memory_floor_bytes,
    own_offers,
    regather_variants,
)
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search

GIB = 2**30


def _cluster(servers: int = 1, per_server: int = 8, memory_gib: float = 12.0) -> Cluster:
    return link_cluster("interleaved-test", servers, per_server, memory_gib)


def _llm(blocks: int = 6, block_gib: float = 0.25, head_fwd: float = 1.0) -> ModelProfile:
    """embedding, ``blocks`` shardable blocks (4 ms per sample forward), an LM head."""
    layers = (
        llm_layer("embedding", False, 0.25, 0.5),
        *(llm_layer(f"block{i}", True, block_gib, 4.0) for i in range(blocks)),
        llm_layer("lm_head", False, 0.25, head_fwd),
    )
    return ModelProfile(model_name="tiny-llm", layers=layers)


def _scorers(prof: ModelProfile, cluster: Cluster, B: int, z: int = 0) -> dict[int, Scorer]:
    widths = [t for t in (1, 2, 4, 8) if cluster.devices_per_server % t == 0]
    return {t: Scorer(prof, cluster, B, z, t) for t in widths}


# -- bounds and re-cut by hand ---------------------------------------------------------------

_PRE = [0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 9.0]
"""Prefix sums of layer costs 1, 1, 1, 1, 4, 1 (ms), the same on both device groups."""


def test_group_work_and_bounds_by_hand() -> None:
    """P = 2, v = 2, torchtitan's cuts of 6 layers in 4 chunks [0, 2, 4, 5, 6]: group 0 holds
    chunks [0, 2) and [4, 5): 2 + 4 = 6; group 1 [2, 4) and [5, 6): 2 + 1 = 3. With M = 4 the
    bound is max(4 x 6, 4 x 3 + 2) = 24 (group 1 starts after group 0's chunk [0, 2)); over any
    cuts 4 x max(9 / 2, 4) = 18 (each less the relative SLACK)."""
    pre = [_PRE, _PRE]
    assert group_work_ms(pre, [0, 2, 4, 5, 6]) == [6.0, 3.0]
    got = lower_bound_ms(pre, [0, 2, 4, 5, 6], v=2, M=4)
    assert got == pytest.approx(24.0 * (1 - SLACK), rel=1e-15)
    assert any_cuts_bound_ms(pre, v=2, M=4) == pytest.approx(18.0 * (1 - SLACK), rel=1e-15)


def test_balanced_cuts_by_hand() -> None:
    """Group 0 must hold layer 4 (cost 4) and a first chunk, so max T_g >= 5; the only cuts
    reaching it are [0, 1, 4, 5, 6] (T = 5, 4): one move of the first cut from 2 to 1."""
    pre = [_PRE, _PRE]
    got = balanced_cuts(pre, [0, 2, 4, 5, 6])
    assert got == [0, 1, 4, 5, 6] and group_work_ms(pre, got) == [5.0, 4.0]
    assert balanced_cuts(pre, got) == got  # a fixed point


def test_balanced_cuts_keep_every_chunk_non_empty() -> None:
    pre = [[0.0, 10.0, 11.0, 12.0, 13.0]] * 2
    got = balanced_cuts(pre, [0, 1, 2, 3, 4])
    assert got == [0, 1, 2, 3, 4]  # four layers in four chunks: nothing can move


def test_leaner_cuts_by_hand() -> None:
    """P = 2, v = 2, six layers of cost 1 (T = 3, 3 at [0, 2, 3, 4, 6]) and a floor that
    counts the first chunk's layers twice: the pair move of boundaries 1 and 3 (a layer each
    way between the groups) lowers it from 5 to 4 with both T_g kept; every single move from
    either cuts raises max T_g. It stops once the floor is within the target, and keeps the
    cuts when no move lowers the floor."""
    pre = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]] * 2

    def floor(cuts: list[int]) -> float:
        return 2.0 * cuts[1] + (cuts[2] - cuts[1])

    assert floor([0, 2, 3, 4, 6]) == 5.0 and group_work_ms(pre, [0, 2, 3, 4, 6]) == [3.0, 3.0]
    got = leaner_cuts(pre, [0, 2, 3, 4, 6], floor, target=0.0)
    assert got == [0, 1, 3, 5, 6] and group_work_ms(pre, got) == [3.0, 3.0] and floor(got) == 4.0
    assert leaner_cuts(pre, [0, 2, 3, 4, 6], floor, target=5.0) == [0, 2, 3, 4, 6]
    assert leaner_cuts(pre, got, floor, target=0.0) == got  # a fixed point


def test_a_balanced_re_cut_over_memory_is_moved_until_it_fits() -> None:
    """8 blocks on 4 devices of 10 GiB, global batch 8: no interleaved grid point fits at its
    own cuts or re-balanced by time (the re-balanced first chunk holds the most micro-batches
    in flight), so the search before :func:`leaner_cuts` had no interleaved plan here. Moved
    towards a lower memory floor at no larger max T_g, one does (L 9,801 ms, P = 2, M = 4)."""
    prof, cluster, B = _llm(8, 0.25, 1.0), _cluster(1, 4, memory_gib=10.0), 8
    scorers = _scorers(prof, cluster, B, 3)
    offers = grid_offers(prof, cluster, B, [1], micro_batch_candidates(B), lambda p: True)
    usable = cluster.usable_memory_bytes
    got = best_interleaved(offers, scorers, prof, cluster, math.inf)
    assert got is not None
    L, _, plan = got
    assert plan.predicted_step_ms == L == pytest.approx(schedule_latency(plan, prof, cluster))
    assert pytest.approx(9801.039, rel=1e-6) == L
    assert max(device_memory_by_group(plan, prof)) <= usable
    o = next(
        o
        for o in offers
        if (o.P, o.M, o.width, o.chunks[0][2:])
        == (plan.num_groups, plan.num_micro_batches, 1, (2, 1))
    )
    pre = [_prefix(scorers[1], -(-o.b // r)) for _, _, r, _ in o.chunks[: o.P]]
    recut = balanced_cuts(pre, o.cuts)
    assert memory_floor_bytes(with_cuts(o.build(), recut), prof) > usable  # the old answer fails
    assert plan.stages[0].layers != (recut[0], recut[1])


def test_regather_variants_of_a_plan_without_zero3_is_the_plan() -> None:
    prof, cluster, B = _llm(), _cluster(), 8
    c = next(c for c in grid_candidates(prof, cluster, B) if c.point.schedule == "interleaved")
    assert c.point.zero_stage == 0 and list(regather_variants(c.plan)) == [c.plan]
    z3 = next(
        c.plan
        for c in grid_candidates(prof, cluster, B)
        if c.point.schedule == "interleaved" and c.point.zero_stage == 3
    )
    flags = [tuple(s.regather for s in p.stages) for p in regather_variants(z3)]
    assert flags == [(False,) * len(z3.stages), (True,) * len(z3.stages)]


# -- best first against brute force ----------------------------------------------------------


def _offers(prof: ModelProfile, cluster: Cluster, B: int, z: int) -> list[Offer]:
    """The grid's interleaved points and the grid's 1F1B plans interleaved as "own" plans."""
    scorers = _scorers(prof, cluster, B, z)
    Ms = micro_batch_candidates(B)
    own = [
        (c.point.tp, c.plan)
        for c in grid_candidates(prof, cluster, B, interleaved=False)
        if c.point.zero_stage == z and c.point.tp in scorers
    ]
    return own_offers(own, prof, list(scorers), Ms) + grid_offers(
        prof, cluster, B, list(scorers), Ms, lambda p: p.zero_stage in (0, z)
    )


def _prefix(sc: Scorer, n: int) -> list[float]:
    acc = [0.0]
    for i in range(sc.N):
        f, b = sc.fb_ms(i, i + 1, n)
        acc.append(acc[-1] + f + b)
    return acc


def _tp_ok(prof: ModelProfile, plan: Plan) -> bool:
    return all(
        s.tensor_width == 1 or any(x.tensor_parallel for x in prof.layers[slice(*s.layers)])
        for s in plan.stages
    )


def _brute_force(
    offers: list[Offer], scorers: dict[int, Scorer], prof: ModelProfile, cluster: Cluster
) -> float:
    """Least L over every offer at its own, its re-balanced and (where the re-balanced plan's
    memory floor is over) its leaner cuts and every regather variant that fits (no bound, no
    order), checking on the way that every bound holds."""
    best = math.inf
    for o in offers:
        pre = [_prefix(scorers[t], -(-o.b // r)) for _, _, r, t in o.chunks[: o.P]]
        recut = balanced_cuts(pre, o.cuts)
        assert any_cuts_bound_ms(pre, o.v, o.M) <= lower_bound_ms(pre, recut, o.v, o.M)
        tried = [o.cuts, recut]
        usable = cluster.usable_memory_bytes

        def floor(cuts: list[int], o: Offer = o) -> float:  # gathering once per step
            return memory_floor_bytes(next(regather_variants(with_cuts(o.build(), cuts))), prof)

        if floor(recut) > usable:  # and moved towards a floor within the devices' memory
            tried.append(leaner_cuts(pre, recut, floor, usable))
            assert any_cuts_bound_ms(pre, o.v, o.M) <= lower_bound_ms(pre, tried[-1], o.v, o.M)
        for cuts in tried:
            plan = o.build()
            plan = dataclasses.replace(
                plan,
                stages=tuple(
                    dataclasses.replace(s, layers=(cuts[k], cuts[k + 1]))
                    for k, s in enumerate(plan.stages)
                ),
            )
            if not _tp_ok(prof, plan):
                continue
            for variant in regather_variants(plan):
                L = schedule_latency(variant, prof, cluster)
                peak = max(device_memory_by_group(variant, prof))
                assert lower_bound_ms(pre, cuts, o.v, o.M) <= L
                assert memory_floor_bytes(variant, prof) <= peak
                if peak <= cluster.usable_memory_bytes:
                    best = min(best, L)
    return best


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(3, 7),
    block_gib=st.sampled_from([0.1, 0.5, 1.0]),
    head_fwd=st.sampled_from([0.5, 4.0, 12.0]),
    servers=st.integers(1, 2),
    per_server=st.sampled_from([2, 4]),
    B=st.sampled_from([4, 8, 12]),
    z=st.sampled_from([0, 3]),
)
def test_best_first_finds_the_brute_force_least_L(
    blocks: int, block_gib: float, head_fwd: float, servers: int, per_server: int, B: int, z: int
) -> None:
    prof = _llm(blocks, block_gib, head_fwd)
    cluster = _cluster(servers, per_server, memory_gib=16.0)  # binds on some, not on most
    scorers = _scorers(prof, cluster, B, z)
    offers = _offers(prof, cluster, B, z)
    want = _brute_force(offers, scorers, prof, cluster)
    got = best_interleaved(offers, scorers, prof, cluster, math.inf)
    if got is None:
        assert want == math.inf
        return
    L, _, plan = got
    assert pytest.approx(want, rel=1e-12) == L
    assert plan.predicted_step_ms == L == pytest.approx(schedule_latency(plan, prof, cluster))
    assert max(device_memory_by_group(plan, prof)) <= cluster.usable_memory_bytes
    assert best_interleaved(offers, scorers, prof, cluster, L) is None  # nothing strictly below


# -- the search against the grid -------------------------------------------------------------


def _grid_least(prof: ModelProfile, cluster: Cluster, B: int, interleaved: bool) -> float:
    return min(
        (
            c.L_ms
            for c in grid_candidates(prof, cluster, B)
            if c.fits and (interleaved or c.point.schedule == "dapple")
        ),
        default=math.inf,
    )


def test_the_search_beats_an_interleaved_grid_best() -> None:
    """6 blocks and a 0.5 ms head on one server of 8: the grid's best is interleaved (dp1 x tp4
    x pp2 DDP M=8). Without interleaving the search is slower than it; with it, faster than
    every grid point."""
    prof, cluster, B = _llm(head_fwd=0.5), _cluster(), 8
    best = min((c for c in grid_candidates(prof, cluster, B) if c.fits), key=lambda c: c.L_ms)
    assert best.point.schedule == "interleaved"
    flat = dapple_search(prof, cluster, B, zero_stage=3)  # 1F1B only, the default
    assert flat.predicted_step_ms > best.L_ms  # the case needs interleaving
    plan = dapple_search(prof, cluster, B, zero_stage=3, interleaved=True)
    assert plan.predicted_step_ms <= best.L_ms * (1 + 1e-9)
    assert plan.schedule == "interleaved" and plan.planner == "dapple"
    assert plan.predicted_step_ms == pytest.approx(schedule_latency(plan, prof, cluster))
    assert max(device_memory_by_group(plan, prof)) <= cluster.usable_memory_bytes


@settings(max_examples=8, deadline=None)
@given(
    blocks=st.integers(3, 6),
    block_gib=st.sampled_from([0.25, 1.0]),
    head_fwd=st.sampled_from([1.0, 8.0]),
    per_server=st.sampled_from([4, 8]),
    B=st.sampled_from([8, 12]),
)
def test_the_search_is_never_slower_than_any_grid_point(
    blocks: int, block_gib: float, head_fwd: float, per_server: int, B: int
) -> None:
    """ZeRO-3 allowed (the grid's DDP and FSDP points are in the search's space) and every
    width searched: L <= the least L of every feasible grid point, 1F1B and interleaved."""
    prof, cluster = _llm(blocks, block_gib, head_fwd), _cluster(1, per_server, memory_gib=8.0)
    grid = _grid_least(prof, cluster, B, interleaved=True)
    if grid == math.inf:
        return
    plan = dapple_search(prof, cluster, B, zero_stage=3, interleaved=True)
    assert plan.predicted_step_ms <= grid * (1 + 1e-9)


def test_max_stages_bounds_the_device_groups_not_the_chunks() -> None:
    """max_stages = 2: interleaved plans on 2 device groups (4 virtual stages) stay allowed."""
    prof, cluster, B = _llm(), _cluster(), 8
    plan = dapple_search(prof, cluster, B, zero_stage=3, max_stages=2, interleaved=True)
    assert plan.num_groups <= 2
    assert plan.virtual_stages == 2 and plan.num_stages == 4
    one = dapple_search(prof, cluster, B, zero_stage=3, max_stages=1, interleaved=True)
    assert one.num_groups == 1 and one.virtual_stages == 1


def test_no_interleaving_on_a_cluster_with_host_terms() -> None:
    prof = _llm(head_fwd=0.5)
    shared = dataclasses.replace(_cluster(), compute_cores_per_server=8)
    assert dapple_search(prof, _cluster(), 8, zero_stage=3, interleaved=True).virtual_stages == 2
    plan = dapple_search(prof, shared, 8, zero_stage=3, interleaved=True)
    assert plan.virtual_stages == 1


# -- bounded work for a huge batch -----------------------------------------------------------


def test_a_huge_batch_offers_and_costs_a_bounded_set_of_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10^12 samples: every interleaved offer has an M among the search's candidates (at most
    MAX_MICRO_BATCH_COUNTS of them) and at most MAX_INTERLEAVED_ACTIONS compute actions, so
    their number and each one's replay do not grow with the batch; so has every plan costed or
    replayed when nothing prunes (no incumbent)."""
    prof, cluster, B = _llm(), _cluster(), 10**12
    offers = _offers(prof, cluster, B, 3)
    Ms = micro_batch_candidates(B)
    structures = {(o.chunks, o.P, o.v, o.width) for o in offers}
    # one offer per structure, M and zero stage (DDP and FSDP: the chunks do not tell)
    assert len(Ms) <= MAX_MICRO_BATCH_COUNTS and len(offers) <= 2 * len(structures) * len(Ms)
    assert all(o.M in Ms and o.M * o.P * o.v <= MAX_INTERLEAVED_ACTIONS for o in offers)
    seen: list[Plan] = []

    def spy(fn: Any) -> Any:
        def wrapped(plan: Plan, *args: Any) -> Any:
            seen.append(plan)
            return fn(plan, *args)

        return wrapped

    for name in ("schedule_latency", "device_memory_by_group", "memory_floor_bytes"):
        monkeypatch.setattr(interleaving, name, spy(getattr(interleaving, name)))
    best_interleaved(offers, _scorers(prof, cluster, B, 3), prof, cluster, math.inf)
    assert seen
    assert all(p.num_micro_batches * p.num_stages <= MAX_INTERLEAVED_ACTIONS for p in seen)
    assert dapple_search(prof, cluster, B, zero_stage=3, interleaved=True).global_batch_size == B


def test_llama3_8b_on_64_h100_keeps_the_memory_lean_re_cut() -> None:
    """`plan_space.py`'s Llama-3 8B case (selective, sequence 8192, 8 x 8 H100, global batch
    128, ZeRO-3, every width, interleaved): the 4-stage x 16 plan's re-balanced chunks read
    2,121.1 ms but need 81.9 GiB on group 0; their memory-lean twin (embedding + 3 blocks in the
    first chunk) reads the same and fits. Without :func:`leaner_cuts` the search returned a
    1F1B plan of 2,252.1 ms."""
    from dapple.core.cluster_presets import load_cluster
    from dapple.planner.widths import width_candidates
    from dapple.profiler.analytic import analytic_profile

    prof = analytic_profile(
        "llama3-8b", "h100", precision="bf16", seq_len=8192, recompute="selective"
    )
    cluster = load_cluster("h100-8x", servers=8)
    plan = dapple_search(
        prof, cluster, 128, tensor_widths=width_candidates(prof, cluster), zero_stage=3,
        interleaved=True,
    )  # fmt: skip
    assert plan.schedule == "interleaved" and plan.num_groups == 4
    assert plan.predicted_step_ms == pytest.approx(2121.1, abs=0.1)
    assert max(device_memory_by_group(plan, prof)) <= cluster.usable_memory_bytes
