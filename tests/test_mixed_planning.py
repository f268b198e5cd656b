"""Planning on a mixed cluster (issue #43): shares by speed, the cost model's slowest replica,
memory per device kind, and the plan against the slowest-kind and even-split plans."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.plan import Plan, split_sizes
from dapple.cost.compute import compute_ms
from dapple.cost.replica_shares import at_speeds
from dapple.cost.schedule_step import schedule_latency
from dapple.cost.terms import stage_terms
from dapple.planner import dapple_search, make_plan
from dapple.planner.scorer import Scorer
from dapple.planner.shares import search_cluster, stage_shares
from dapple.planner.zero_modes import UNSHARDED
from dapple.profiler.paper_models import load_paper_profile
from dapple.simulate.engine import simulate

MIXED = load_cluster(str(Path(__file__).resolve().parents[1] / "examples" / "mixed.json"))
BERT = load_paper_profile("bert48")


def _even(plan: Plan) -> Plan:
    return dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, shares=None) for s in plan.stages)
    )


@pytest.fixture(scope="module")
def mixed_plan() -> Plan:
    return make_plan(BERT, MIXED, 64)


def test_plan_gives_faster_replicas_larger_shares(mixed_plan: Plan) -> None:
    b = mixed_plan.micro_batch_size
    shared = [s for s in mixed_plan.stages if s.shares is not None]
    assert shared, "no stage took unequal shares"
    for st in mixed_plan.stages:
        sizes = st.slice_sizes(b)
        assert sum(sizes) == b and min(sizes) >= 1
        by_speed = sorted(zip((MIXED.speed_of(d) for d in st.replica_devices), sizes, strict=True))
        assert [n for _, n in by_speed] == sorted(n for _, n in by_speed)  # faster, more


def test_predicted_is_the_cost_model_and_the_simulator(mixed_plan: Plan) -> None:
    L = mixed_plan.predicted_step_ms
    assert pytest.approx(schedule_latency(mixed_plan, BERT, MIXED), rel=1e-12) == L
    assert simulate(mixed_plan, BERT, MIXED).step_ms == pytest.approx(L, rel=1e-9)
    searched = dapple_search(BERT, search_cluster(MIXED), 64)  # the scorer's own L
    assert searched.predicted_step_ms == pytest.approx(L, rel=1e-9)


def test_beats_the_slowest_kind_and_the_even_split(mixed_plan: Plan) -> None:
    slow = make_plan(BERT, MIXED.slowest_kind(), 64)
    assert schedule_latency(slow, BERT, MIXED) == pytest.approx(slow.predicted_step_ms)
    assert mixed_plan.predicted_step_ms < 0.9 * slow.predicted_step_ms
    assert mixed_plan.predicted_step_ms < 0.9 * schedule_latency(_even(mixed_plan), BERT, MIXED)


def test_stage_time_is_its_slowest_replica(mixed_plan: Plan) -> None:
    plan = mixed_plan
    st0 = plan.stages[0]
    b = plan.micro_batch_size
    terms = stage_terms(plan, BERT, MIXED).stages[0]
    want = max(
        sum(compute_ms(BERT, MIXED, st0.layers, n)) / MIXED.speed_of(d)
        for d, n in zip(st0.replica_devices, st0.slice_sizes(b), strict=True)
    )
    assert terms.terms.forward_ms + terms.terms.backward_ms == pytest.approx(want)
    assert [r.samples for r in terms.replicas] == list(st0.slice_sizes(b))


def test_at_speeds_divides_compute_only() -> None:
    plan = make_plan(BERT, MIXED.slowest_kind(), 64)
    reps = stage_terms(plan, BERT, MIXED.slowest_kind()).stages[0].replicas[:2]
    got = at_speeds(reps, [1.0, 0.5])
    assert got[0] is reps[0]
    assert got[1].forward_ms == 2 * reps[1].forward_ms
    assert got[1].weight_grad_ms == 2 * reps[1].weight_grad_ms
    assert got[1].host == reps[1].host and got[1].samples == reps[1].samples


def test_speeds_above_one_are_searched_as_below(mixed_plan: Plan) -> None:
    fast = dataclasses.replace(
        MIXED, kinds=tuple(dataclasses.replace(k, speed=k.speed * 4) for k in MIXED.kinds)
    )
    view = search_cluster(fast)
    assert max(k.speed for k in view.kinds) == 1.0
    for d in (0, 15):
        assert view.speed_of(d) / view.compute_slowdown == pytest.approx(
            fast.speed_of(d) / fast.compute_slowdown
        )
    plan = make_plan(BERT, fast, 64)
    assert plan.predicted_step_ms == pytest.approx(schedule_latency(plan, BERT, fast))
    assert plan.predicted_step_ms < mixed_plan.predicted_step_ms


def test_even_split_when_speeds_are_equal() -> None:
    assert stage_shares(10, [1.0, 1.0, 1.0], lambda n: n) == split_sizes(10, 3)
    assert stage_shares(2, [1.0, 0.5, 0.5], lambda n: n) == split_sizes(2, 3)
    assert stage_shares(8, [1.0, 1 / 3], lambda n: n) == (6, 2)


def _two_kinds(second_gib: int) -> Cluster:
    kinds = (
        DeviceKind(name="big", servers=1, speed=1.0, device_memory_bytes=16 * GIB),
        DeviceKind(name="small", servers=1, speed=1.0, device_memory_bytes=second_gib * GIB),
    )
    low = min(k.device_memory_bytes for k in kinds)
    return dataclasses.replace(MIXED, device_memory_bytes=low, kinds=kinds)


def test_memory_is_held_per_kind() -> None:
    """A stage over both kinds holds the micro-batches its smaller kind holds; with both kinds
    as large, more."""
    d, M = (6, 7, 8, 9), 16
    small = Scorer(BERT, _two_kinds(4), 64).stage_options(0, 24, d, 4)
    same = Scorer(BERT, _two_kinds(16), 64).stage_options(0, 24, d, 4)
    alone = Scorer(BERT, _two_kinds(4), 64)._options(0, 24, 1, 4, UNSHARDED, M, 4.0 * GIB)
    assert small[0][1].d_nr == alone[0] < same[0][1].d_nr


def test_cost_terms_follow_shares(mixed_plan: Plan) -> None:
    """Split-concat links, host CPU, slice work, memory and F_s read the stage's shares."""
    from dapple.core.plan import transfers
    from dapple.cost.comm import link_loads, overlaps
    from dapple.cost.compute import stage_compute_ms
    from dapple.cost.host import host_extras
    from dapple.cost.peak_memory import plan_stage_bytes
    from dapple.cost.sharing import slice_work

    assert overlaps(8, 2, 3, (6, 2), (1, 3, 4)) == list(transfers(8, 2, 3, (6, 2), (1, 3, 4)))
    even = link_loads(MIXED, (0, 8), (1,), 8)
    uneven = link_loads(MIXED, (0, 8), (1,), 8, (6, 2))
    assert max(x for _, x in uneven) < max(x for _, x in even)  # 2 samples cross servers, not 4
    work = slice_work((0, 8), 8, lambda n: (float(n), 0.0), False, (6, 2))
    assert work == [(0, 6.0), (8, 2.0)]
    host = dataclasses.replace(MIXED, comm_cpu_ms_per_mb=1.0)
    rows = host_extras(BERT, host, [(0, 10, 2), (10, 50, 1)], 8, [(6, 2), None])[0]
    assert rows[0].forward_ms > rows[1].forward_ms
    st = dataclasses.replace(mixed_plan.stages[0], shares=None)
    st = dataclasses.replace(st, devices=(7, 8), shares=(1, 1))
    assert plan_stage_bytes(BERT, dataclasses.replace(st, shares=(3, 1)), 4) == plan_stage_bytes(
        BERT, st, 4, samples=3
    )
    f, b = compute_ms(BERT, MIXED, st.layers, 1)
    v = MIXED.speed_of(8)
    assert stage_compute_ms(BERT, MIXED, st, 2) == pytest.approx((f / v, b / v))


def test_fits_memory_per_kind(mixed_plan: Plan) -> None:
    """A plan fits when each replica's share fits its own kind, though its largest share would
    not fit the smallest kind."""
    from dapple.cost.peak_memory import stage_peak
    from dapple.cost.pipeline import pipeline_latency

    plan = mixed_plan
    st, b = plan.stages[0], plan.micro_batch_size
    big, small = max(st.slice_sizes(b)), min(st.slice_sizes(b))
    k, M = st.max_in_flight or 1, plan.num_micro_batches
    need = [stage_peak(BERT, st, b, k, M, samples=n).peak for n in (small, big)]
    assert need[0] < need[1]

    def kinds(small_bytes: float) -> Cluster:
        ks = (
            dataclasses.replace(MIXED.kinds[0], device_memory_bytes=80 * GIB),
            dataclasses.replace(MIXED.kinds[1], device_memory_bytes=int(small_bytes)),
        )
        return dataclasses.replace(MIXED, kinds=ks, device_memory_bytes=int(small_bytes))

    assert pipeline_latency(plan, BERT, kinds((need[0] + need[1]) / 2)).fits_memory
    assert not pipeline_latency(plan, BERT, kinds(need[0] * 0.99)).fits_memory


@pytest.mark.parametrize("gbs", [8, 12])
def test_search_is_no_worse_than_the_exhaustive_oracle(gbs: int) -> None:
    """On 2 servers of 2 devices, speeds 1 and 0.4: the DP's L at most the oracle's (which
    scores every partition, replication and placement over all devices with the same scorer)."""
    from builders import make_profile

    prof = make_profile(6, fwd=1.0, bwd=2.0, params=4_000_000)
    kinds = (
        DeviceKind(name="fast", servers=1, speed=1.0, device_memory_bytes=GIB),
        DeviceKind(name="slow", servers=1, speed=0.4, device_memory_bytes=GIB),
    )
    c = Cluster(servers=2, devices_per_server=2, device_memory_bytes=GIB,
                intra_server_bandwidth_gbps=100, inter_server_bandwidth_gbps=10,
                kinds=kinds)  # fmt: skip
    dp, oracle = make_plan(prof, c, gbs), make_plan(prof, c, gbs, "exhaustive")
    assert dp.predicted_step_ms <= oracle.predicted_step_ms * (1 + 1e-9)
    assert oracle.predicted_step_ms == pytest.approx(schedule_latency(oracle, prof, c))


def test_cli_plan_prints_the_shares_by_kind(capsys: pytest.CaptureFixture[str]) -> None:
    from dapple.cli import main

    example = str(Path(__file__).resolve().parents[1] / "examples" / "mixed.json")
    assert main(["plan", "--profile", "paper:bert48", "--cluster", example]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "shares by device speed: stage 0: 6 on 8 H100 (speed 1), 2 on 8 A100-40GB" in out


def test_layout_names_each_servers_kind() -> None:
    from dapple.core.cluster_presets import PRESETS
    from dapple.simulate.layout import server_label

    assert server_label(MIXED, 0) == "server 0\nH100 x1"
    assert server_label(MIXED, 1) == "server 1\nA100-40GB x0.32"
    assert server_label(PRESETS["paper-a"], 1) == "server 1"


def test_a_kind_too_small_for_any_stage_is_left_idle() -> None:
    """With 0.5 GiB A100s no BERT-48 stage fits them: the plan runs on the H100s alone."""
    tiny = dataclasses.replace(MIXED.kinds[1], device_memory_bytes=GIB // 2)
    c = dataclasses.replace(MIXED, kinds=(MIXED.kinds[0], tiny), device_memory_bytes=GIB // 2)
    plan = make_plan(BERT, c, 64)
    assert set(plan.devices) <= set(range(8))
    assert pipeline_latency_fits(plan, c)


def pipeline_latency_fits(plan: Plan, c: Cluster) -> bool:
    from dapple.cost.pipeline import pipeline_latency

    return pipeline_latency(plan, BERT, c).fits_memory
