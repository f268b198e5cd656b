"""The torchtitan-style grid baseline (:mod:`dapple.planner.grid`): its enumeration (counted by
hand), its plans (valid, tensor groups inside servers), its best (brute force over the same
points through the full cost model) and dapple's search against it."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import link_cluster, llm_layer, make_profile
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import check_tensor_groups
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.grid import (
    GridPoint,
    factorisations,
    grid_candidates,
    grid_plan,
    grid_points,
    torchtitan_cuts,
)
from dapple.planner.search import dapple_search

GIB = 2**30


def _cluster(servers: int = 2, per_server: int = 4, memory_gib: float = 16.0) -> Cluster:
    return link_cluster("grid-test", servers, per_server, memory_gib)


def _llm(blocks: int = 4, block_gib: float = 0.5, end_gib: float = 0.25) -> ModelProfile:
    """embedding, ``blocks`` shardable blocks, head: the chain ``analytic_profile`` builds."""
    layers = (
        llm_layer("embedding", False, end_gib, fwd=0.5),
        *(llm_layer(f"block{i}", True, block_gib) for i in range(blocks)),
        llm_layer("lm_head", False, end_gib, fwd=1.0),
    )
    return ModelProfile(model_name="tiny-llm", layers=layers)


# -- torchtitan's split ----------------------------------------------------------------------


def test_torchtitan_cuts_give_the_first_stages_the_remainder() -> None:
    """Llama-3 8B: 32 blocks + embedding + head = 34 effective layers on 4 ranks: 9, 9, 8, 8
    (torchtitan: embedding + 8 blocks, 9 blocks, 8 blocks, 7 blocks + norm/output)."""
    assert torchtitan_cuts(34, 4) == [0, 9, 18, 26, 34]
    assert torchtitan_cuts(34, 1) == [0, 34]
    assert torchtitan_cuts(6, 6) == [0, 1, 2, 3, 4, 5, 6]
    assert torchtitan_cuts(82, 16)[:3] == [0, 6, 12] and torchtitan_cuts(82, 16)[-2:] == [77, 82]


def test_torchtitan_cuts_refuse_empty_stages() -> None:
    with pytest.raises(ValidationError, match="1 <= stages <= layers, got 7 stages of 6 layers"):
        torchtitan_cuts(6, 7)


# -- enumeration -----------------------------------------------------------------------------


def test_factorisations_by_hand() -> None:
    """G = 8 on 2 servers of 4, N = 6: tp in 1, 2, 4 (8 is wider than a server); pp | G/tp,
    pp <= 6, so pp = 8 is out."""
    got = factorisations(_llm(4), _cluster())
    assert sorted(got) == sorted(
        [(8, 1, 1), (4, 1, 2), (2, 1, 4), (4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 4, 1), (1, 4, 2)]
    )
    flat = dataclasses.replace(
        _llm(4), layers=tuple(dataclasses.replace(x, tensor_parallel=False) for x in _llm(4).layers)
    )
    assert sorted(factorisations(flat, _cluster())) == [(2, 1, 4), (4, 1, 2), (8, 1, 1)]


def test_grid_points_count_by_hand() -> None:
    """B = 8. Per (dp, tp, pp): zero (0, 3) when dp > 1 x M | 8/dp, plus interleaved v = 2 when
    pp > 1, 2 pp <= 6 and pp | M:
    (8,1,1) 2x1 = 2; (4,1,2) 2x2 + 2x1 = 6; (2,1,4) 2x3 = 6; (4,2,1) 2x2 = 4;
    (2,2,2) 2x3 + 2x2 = 10; (1,2,4) 1x4 = 4; (2,4,1) 2x3 = 6; (1,4,2) 1x4 + 1x3 = 7: 45."""
    points = grid_points(_llm(4), _cluster(), 8)
    assert len(points) == 45
    assert len(set(points)) == 45
    inter = [p for p in points if p.schedule == "interleaved"]
    assert len(inter) == 2 + 4 + 3 and all(p.v == 2 and p.M % p.pp == 0 for p in inter)
    assert all(p.zero_stage == 0 for p in points if p.dp == 1)


def test_a_replica_gets_a_whole_local_batch() -> None:
    """B = 6: dp 4 and dp 8 do not divide it and are skipped; M divides B / dp."""
    points = grid_points(_llm(4), _cluster(), 6)
    assert {p.dp for p in points} == {1, 2}
    assert all((6 // p.dp) % p.M == 0 for p in points)


def test_every_candidate_is_a_valid_plan_with_groups_inside_servers() -> None:
    prof, cluster = _llm(4), _cluster()
    cands = grid_candidates(prof, cluster, 8)
    assert len(cands) == 45
    for c in cands:
        p, plan = c.point, c.plan
        plan.validate_for(prof.num_layers, cluster.num_devices)
        check_tensor_groups(plan, cluster)
        assert sorted(plan.devices) == list(range(cluster.num_devices))
        assert plan.num_groups == p.pp and plan.virtual_stages == p.v
        assert all(s.replicas == p.dp and s.tensor_width == p.tp for s in plan.stages)
        assert all(s.zero_stage == p.zero_stage and not s.recompute for s in plan.stages)
        assert plan.planner == "grid" and plan.num_micro_batches == p.M
        assert (c.fits and plan.predicted_step_ms == c.L_ms) or (
            not c.fits and math.isnan(plan.predicted_step_ms)
        )


def test_bad_batch_sizes_are_refused_before_any_work() -> None:
    with pytest.raises(ValidationError, match="integer >= 1, got 0"):
        grid_candidates(_llm(4), _cluster(), 0)
    with pytest.raises(ValidationError, match="above the largest"):
        grid_plan(_llm(4), _cluster(), 2**60)


def test_a_model_that_fits_nowhere_is_infeasible() -> None:
    with pytest.raises(InfeasibleError, match="grid: no plan of 'tiny-llm'"):
        grid_plan(_llm(4, block_gib=40.0), _cluster(), 8)


# -- the best candidate ----------------------------------------------------------------------


def _idle_tensor_stage(prof: ModelProfile, plan: Plan) -> bool:
    """A stage of width > 1 holding no shardable layer (refused: its ranks would repeat it)."""
    return any(
        s.tensor_width > 1 and not any(x.tensor_parallel for x in prof.layers[slice(*s.layers)])
        for s in plan.stages
    )


def _brute_force(prof: ModelProfile, cluster: Cluster, B: int) -> float:
    """Least L over every grid point and every per-stage regather choice of an FSDP point, each
    plan costed by the full cost model and kept when its peak fits (no scorer involved)."""
    best = math.inf
    for c in grid_candidates(prof, cluster, B):
        if _idle_tensor_stage(prof, c.plan):
            continue
        S = len(c.plan.stages)
        flags = itertools.product((False, True), repeat=S) if c.point.zero_stage == 3 else [()]
        for regather in flags:
            plan = c.plan
            if regather:
                plan = dataclasses.replace(
                    plan,
                    stages=tuple(
                        dataclasses.replace(s, regather=r)
                        for s, r in zip(plan.stages, regather, strict=True)
                    ),
                )
            if max(device_memory_by_group(plan, prof)) <= cluster.usable_memory_bytes:
                best = min(best, schedule_latency(plan, prof, cluster))
    return best


@pytest.mark.parametrize(
    ("blocks", "block_gib", "memory_gib", "B"),
    [(4, 0.5, 16.0, 8), (4, 1.0, 16.0, 16), (6, 0.25, 12.0, 8), (4, 2.0, 16.0, 8)],
)
def test_the_best_is_the_least_L_that_fits(
    blocks: int, block_gib: float, memory_gib: float, B: int
) -> None:
    prof, cluster = _llm(blocks, block_gib), _cluster(memory_gib=memory_gib)
    cands = grid_candidates(prof, cluster, B)
    assert any(not c.fits for c in cands)  # memory binds somewhere
    plan = grid_plan(prof, cluster, B)
    assert plan.predicted_step_ms == pytest.approx(_brute_force(prof, cluster, B), rel=1e-9)
    assert plan.predicted_step_ms == min(c.L_ms for c in cands)
    assert plan.predicted_step_ms == pytest.approx(schedule_latency(plan, prof, cluster))
    assert max(device_memory_by_group(plan, prof)) <= cluster.usable_memory_bytes


@settings(max_examples=15, deadline=None)
@given(
    blocks=st.integers(2, 6),
    block_gib=st.sampled_from([0.1, 0.5, 1.0, 2.0]),
    servers=st.integers(1, 2),
    per_server=st.sampled_from([2, 4]),
    B=st.sampled_from([4, 6, 8, 12]),
)
def test_scored_candidates_agree_with_the_full_cost_model(
    blocks: int, block_gib: float, servers: int, per_server: int, B: int
) -> None:
    """Every candidate that fits has L = schedule_latency and a peak within memory; a 1F1B
    candidate refused for memory is over it in the replayed schedule (unless one of its stages
    of width > 1 holds no shardable layer, which the scorer refuses outright)."""
    prof, cluster = _llm(blocks, block_gib), _cluster(servers, per_server, memory_gib=12.0)
    for c in grid_candidates(prof, cluster, B):
        peak = max(device_memory_by_group(c.plan, prof))
        if c.fits:
            assert c.L_ms == pytest.approx(schedule_latency(c.plan, prof, cluster), rel=1e-9)
            assert peak <= cluster.usable_memory_bytes
        elif c.point.schedule == "dapple" and c.point.zero_stage == 0:
            assert _idle_tensor_stage(prof, c.plan) or peak > cluster.usable_memory_bytes


def test_a_uniform_profile_without_tensor_layers_gets_a_width_one_plan() -> None:
    plan = grid_plan(make_profile(6), _cluster(), 8)
    assert all(s.tensor_width == 1 for s in plan.stages)


# -- dapple's search against the grid --------------------------------------------------------


def _dapple_best_ms(
    prof: ModelProfile, cluster: Cluster, B: int, interleaved: bool = False
) -> float:
    """dapple's plan with every width and DDP or ZeRO-3 allowed (the better of the two)."""
    widths = [t for t in (1, 2, 4, 8) if cluster.devices_per_server % t == 0]
    return min(
        dapple_search(
            prof, cluster, B, tensor_widths=widths, zero_stage=z, interleaved=interleaved
        ).predicted_step_ms
        for z in (0, 3)
    )


_INSTANCES = [
    (4, 0.5, 2, 4, 16.0, 8),
    (4, 1.0, 2, 4, 16.0, 16),
    (6, 0.25, 1, 8, 12.0, 8),
    (5, 0.5, 2, 2, 16.0, 12),
    (4, 2.0, 2, 4, 16.0, 8),
]
"""(blocks, GiB per block, servers, devices per server, device GiB, B)."""


@pytest.mark.parametrize(
    ("blocks", "block_gib", "servers", "per_server", "memory_gib", "B"), _INSTANCES
)
def test_dapple_is_never_slower_than_the_grids_1f1b_points(
    blocks: int, block_gib: float, servers: int, per_server: int, memory_gib: float, B: int
) -> None:
    """dapple's space holds every 1F1B grid point (uniform width, DDP or ZeRO-3, any cut)."""
    prof = _llm(blocks, block_gib)
    cluster = _cluster(servers, per_server, memory_gib)
    grid = min(c.L_ms for c in grid_candidates(prof, cluster, B) if c.point.schedule == "dapple")
    assert _dapple_best_ms(prof, cluster, B) <= grid * (1 + 1e-9)


@pytest.mark.parametrize(
    ("blocks", "block_gib", "servers", "per_server", "memory_gib", "B"), _INSTANCES
)
def test_dapple_is_never_slower_than_the_whole_grid(
    blocks: int, block_gib: float, servers: int, per_server: int, memory_gib: float, B: int
) -> None:
    prof = _llm(blocks, block_gib)
    cluster = _cluster(servers, per_server, memory_gib)
    grid = grid_plan(prof, cluster, B).predicted_step_ms
    assert _dapple_best_ms(prof, cluster, B, interleaved=True) <= grid * (1 + 1e-9)


def test_auto_takes_the_grids_fsdp_point_where_its_update_shard_lowers_L() -> None:
    """4 replicas of a 4 MB stage with an optimizer update of 1e-7 ms per byte (0.4 ms): the
    FSDP point updates a quarter of it per replica, 0.3 ms less than its DDP twin, which fits
    as well. ``auto`` takes the sharded plan's L: the FSDP point is offered where it beats its
    DDP twin, and the search's own plan is offered with its stages sharded (its zero twins)."""
    prof = dataclasses.replace(
        make_profile(4, fwd=5.0, bwd=10.0, params=10**6), update_ms_per_parameter_byte=1e-7
    )
    cluster = _cluster(1, 4, 16.0)
    fits = {c.point: c.L_ms for c in grid_candidates(prof, cluster, 8, interleaved=False) if c.fits}
    fsdp = GridPoint(dp=4, tp=1, pp=1, M=1, zero_stage=3)
    assert fits[dataclasses.replace(fsdp, zero_stage=0)] == pytest.approx(fits[fsdp] + 0.3)
    plan = dapple_search(prof, cluster, 8, zero_stage="auto")
    assert plan.predicted_step_ms == pytest.approx(min(fits.values()), rel=1e-9)
    assert plan.predicted_step_ms == pytest.approx(fits[fsdp], rel=1e-9)
    # the ZeRO-1 twin of the search's own plan (planner.zero_twins) moves the same bytes and
    # updates the same 1/4: it ties the FSDP point and comes first
    assert [st.zero_stage for st in plan.stages] in ([1], [3])
    # without a shard's gain (no update term) the DDP point stays: FSDP is offered only below it
    plain = dapple_search(make_profile(4, fwd=5.0, bwd=10.0, params=10**6), cluster, 8,
                          zero_stage="auto")  # fmt: skip
    assert [st.zero_stage for st in plain.stages] == [0] * len(plain.stages)


def test_grid_point_labels() -> None:
    p = GridPoint(dp=2, tp=4, pp=1, M=2, zero_stage=3)
    assert p.label == "dp2 x tp4 x pp1 FSDP M=2 1F1B"
    q = dataclasses.replace(p, zero_stage=0, pp=2, schedule="interleaved", v=2)
    assert q.label == "dp2 x tp4 x pp2 DDP M=2 interleaved v=2"


def test_zero3_re_gathers_per_micro_batch_only_in_fp32() -> None:
    """Under autocast the runtime's ZeRO-3 reduce-scatters once per step, so no plan of a bf16
    profile re-gathers; the same fp32 profile re-gathers where memory needs it."""
    from dapple.planner.zero_modes import ZERO3_REGATHER, ZeroMode, zero3_modes

    fp32, cluster = _llm(6, 2.0), _cluster(memory_gib=12.0)
    bf16 = dataclasses.replace(fp32, precision="bf16")
    once = ZeroMode(3)
    assert zero3_modes(fp32) == (once, ZERO3_REGATHER) and zero3_modes(bf16) == (once,)

    def regathers(prof: ModelProfile) -> bool:
        cands = [c for c in grid_candidates(prof, cluster, 8) if c.fits]
        return any(sp.regather for c in cands for sp in c.plan.stages)

    assert regathers(fp32) and not regathers(bf16)


def test_no_plan_shards_a_stage_holding_a_tied_copy() -> None:
    """The embedding and the head share a tied parameter: no stage holding either gets ZeRO-3
    (its sum over the copies needs it whole), in the search, the grid's 1F1B points or its
    interleaved ones; the blocks' stages still may."""
    base = _llm(6, 1.0)
    ends = (base.layers[0], base.layers[-1])
    tied = dataclasses.replace(
        base,
        layers=(
            dataclasses.replace(
                ends[0], tied_parameter_bytes=ends[0].parameter_bytes, tied_layers=(7,)
            ),
            *base.layers[1:-1],
            dataclasses.replace(
                ends[1], tied_parameter_bytes=ends[1].parameter_bytes, tied_layers=(0,)
            ),
        ),
    )
    cluster = _cluster(memory_gib=12.0)

    def holds_tied(plan: Plan, k: int) -> bool:
        a, b = plan.stages[k].layers
        return any(x.tied_parameter_bytes for x in tied.layers[a:b])

    plans = [c.plan for c in grid_candidates(tied, cluster, 8) if c.fits]
    plans.append(dapple_search(tied, cluster, 8, zero_stage=3, interleaved=True))
    assert any(sp.zero_stage == 3 for p in plans for sp in p.stages)
    for plan in plans:
        for k, sp in enumerate(plan.stages):
            assert not (sp.zero_stage == 3 and holds_tied(plan, k)), (plan.planner, k)
