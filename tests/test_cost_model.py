"""The cost model's one assembly (:mod:`dapple.cost.terms`): the planner's scorer, L, the
schedules' step times and the simulator read the same terms.

The golden numbers were produced by the cost model as it stood before its terms were assembled
in one place (three copies of the F/B/AR/K arrays in the scorer, ``pipeline_latency`` and
``schedule_latency``; ``tests/cost_dump.py`` compares every number of the paper profiles); they
must stay equal to the last bit.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import pytest

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.cuts import rounded_to_chunks
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost import terms as cost_terms
from dapple.cost.host import has_host_terms
from dapple.cost.pipeline import in_flight_bounds, latency_breakdown, pipeline_latency
from dapple.cost.schedule_step import schedule_latency, schedule_step_ms
from dapple.cost.terms import PipelineTerms, stage_terms
from dapple.planner import make_plan, scorer
from dapple.planner.schedule_choice import balanced_pipelines
from dapple.planner.scorer import Scorer
from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, load_profile
from dapple.schedule import ActionKind
from dapple.simulate import simulate
from dapple.simulate.plan_variants import with_schedule

K = ActionKind

CPU = dataclasses.replace(
    PRESETS["local-cpu"],
    action_overhead_ms=0.124,
    step_overhead_ms=4.71,
    comm_cpu_ms_per_mb=0.163,
    compute_cores_per_server=1.95,
)
"""A CPU host with the runtime's host terms and shared compute cores (the CPU-host pass)."""

# model, cluster, planner, global batch (None: the paper's), replication, M, then the scorer's
# L, pipeline_latency's L, schedule_latency, the simulated step; ZB-H1 on the same plan:
# schedule_latency, simulated step; interleaved v=2 on the 2-group balanced pipeline (M = 8):
# schedule_latency, simulated step. The slices of one micro-batch crossing a cut share their
# ports (``cost.terms._boundary_terms``): the 8:8 cuts across paper-a's servers, whose slices
# each took 1/8 of the network interface's time, take all of it, as the comm stage does; a
# device's sends take turns on its way out (amoebanet36's comm-bound straight pipeline on
# paper-c: the middle devices' activations and gradients, 1,997 -> 2,765 ms against L 2,939).
# bert48 / paper-a takes policy B since L overlaps the tail with the pivot's pending backwards
# (``cost.latency.pivot_waits``): simulated 1,244.3 -> 1,205.6 ms; L equals it
# (``cost.latency.backward_phases``: a stage's own work and its last gradient's way up).
# ZB-H1's and interleaved's schedule_latency replay their compute orders
# (``schedule.replay``): the simulated step on dedicated devices; on the CPU row's shared cores
# the replay does not stretch compute and stays below it. Every rank's OPT runs after the step's
# collective (``AGREE``), all at once: on those shared cores their per-step host CPU shares
# them (DAPPLE 417.35 -> 417.37 ms, interleaved 883.0 -> 920.0 simulated).
GOLDEN = [
    ("bert48", "paper-a", "dapple", None, "8:8", 8, 1205.6235655526955, 1205.623565552695,
     1205.623565552695, 1205.623565552695, 1197.6822847323851, 1197.6822847323851,
     1231.5118508145101, 1231.5118508145101),
    ("xlnet36", "paper-a", "pipedream", None, "16", 8, 3023.3293007211687, 3023.3293007211687,
     3023.3293007211687, 3023.329300721169, 3023.329300721169, 3023.329300721169,
     2536.216503905736, 2536.216503905736),
    ("gnmt16", "h100-8x", "gpipe", None, "1:1:1:1:1:1:1:1", 256, 1807.4217689624911,
     2409.864701135173, 2409.864701135173, 2409.864701135154, 2380.8892289483474,
     2380.8892289483474, 1668.0707850342533, 1668.0707850342533),
    ("resnet50", "paper-b", "dp", None, "16", 1, 558.0678603821657, 558.0678603821656,
     558.0678603821656, 558.0678603821656, 558.0678603821656, 558.0678603821656,
     821.7235083509127, 821.7235083509127),
    ("amoebanet36", "paper-c", "straight", None, "1:1:1:1:1:1:1:1:1:1:1:1:1:1:1:1", 128,
     2938.5385695830146, 2938.5385695830146, 2938.5385695830146, 2765.472063186964,
     3262.2356409228364, 3262.2356409228364, 4917.647216951167, 4917.647216951167),
    ("gnmt16", "cpu", "dapple", 64, "1:1", 16, 417.4803195312755, 417.4803195312755,
     417.4803195312755, 417.3710375257227, 394.10112565817394, 403.45262435570794,
     709.6613032098371, 920.0046477241007),
]  # fmt: skip


def _cluster(name: str) -> Cluster:
    return CPU if name == "cpu" else PRESETS[name]


@cache
def _case(model: str, cname: str, planner: str, gbs: int | None) -> tuple[ModelProfile, Plan]:
    profile = load_profile(f"paper:{model}")
    return profile, make_plan(profile, _cluster(cname), gbs or PAPER_GLOBAL_BATCH[model], planner)


def _scored_ms(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    sc = Scorer(profile, cluster, plan.global_batch_size)
    stages = [(*st.layers, st.devices) for st in plan.stages]
    got = sc.score(stages, plan.num_micro_batches, schedule=plan.schedule)
    assert got is not None
    return got.L_ms


@pytest.mark.parametrize("row", GOLDEN, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_scorer_latency_schedules_and_simulator_keep_their_numbers(row: tuple[Any, ...]) -> None:
    model, cname, planner, gbs, replication, M, *want = row
    cluster = _cluster(cname)
    profile, plan = _case(model, cname, planner, gbs)
    assert (plan.replication, plan.num_micro_batches) == (replication, M)
    got = [
        _scored_ms(plan, profile, cluster),
        pipeline_latency(plan, profile, cluster).L_ms,
        schedule_latency(plan, profile, cluster),
        simulate(plan, profile, cluster).step_ms,
    ]
    zb = with_schedule(plan, "zbh1")
    got += [schedule_latency(zb, profile, cluster), simulate(zb, profile, cluster).step_ms]
    gbs = plan.global_batch_size
    two = balanced_pipelines(profile, cluster, gbs)[0]
    base = rounded_to_chunks(
        dataclasses.replace(two, micro_batch_size=gbs // 8, num_micro_batches=8), 2
    )
    assert base is not None
    inter = with_schedule(base, "interleaved", 2)
    got += [schedule_latency(inter, profile, cluster), simulate(inter, profile, cluster).step_ms]
    assert got == want  # bit for bit


@pytest.mark.parametrize("row", GOLDEN[:3] + GOLDEN[-1:], ids=lambda r: f"{r[0]}-{r[1]}")
def test_latency_and_simulator_read_the_plans_terms(row: tuple[Any, ...]) -> None:
    model, cname, planner, gbs = row[:4]
    cluster = _cluster(cname)
    profile, plan = _case(model, cname, planner, gbs)
    terms = stage_terms(plan, profile, cluster)
    got = terms.pipeline(in_flight_bounds(plan)[1]).latency().L_ms
    assert got == latency_breakdown(terms).L_ms == pipeline_latency(plan, profile, cluster).L_ms
    res = simulate(plan, profile, cluster)
    assert res.L_ms == schedule_step_ms(terms) == got
    if cluster.compute_cores_per_server is not None:
        return  # shared cores stretch compute: durations are not the nominal terms
    for e in res.events:
        a = e.action
        if a.kind in (K.FORWARD, K.BACKWARD):
            r = terms.stages[a.stage].replicas[a.replica]
            nominal = r.forward_ms if a.kind is K.FORWARD else r.backward_ms
            assert e.duration_ms == pytest.approx(nominal, rel=1e-12, abs=1e-9)
        elif a.kind is K.ALLREDUCE:
            assert e.end_ms - e.start_ms >= terms.stages[a.stage].terms.sync_ms * (1 - 1e-12)


@pytest.mark.parametrize("row", [GOLDEN[0], GOLDEN[1], GOLDEN[-1]], ids=lambda r: r[0] + r[1])
def test_scorer_assembles_through_pipeline_terms(
    row: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scorer evaluates L through :func:`pipeline_terms` with StageTerms from its prefix
    sums: the plan's terms up to rounding (F, B) or exactly (AR, U, comm stages); the plan's
    own terms through the same assembly give ``pipeline_latency`` exactly."""
    model, cname, planner, gbs = row[:4]
    cluster = _cluster(cname)
    profile, plan = _case(model, cname, planner, gbs)
    calls: list[tuple[Any, ...]] = []

    def spy(*args: Any) -> PipelineTerms:
        calls.append(args)
        return cost_terms.pipeline_terms(*args)

    monkeypatch.setattr(scorer, "pipeline_terms", spy)
    scored = _scored_ms(plan, profile, cluster)
    terms = stage_terms(plan, profile, cluster)
    bounds = in_flight_bounds(plan)[1]
    mine = [c for c in calls if list(c[2]) == bounds]  # the call of the plan's policy
    assert mine
    stages, comm, _, m, cl, host = mine[0]
    assert m == plan.num_micro_batches and cl is cluster
    assert (host is None) == (not has_host_terms(cluster))
    assert list(comm) == [x.comm_ms for x in terms.boundaries]
    want = [st.terms for st in terms.stages]
    for a, b in zip(stages, want, strict=True):
        assert (a.sync_ms, a.update_ms) == (b.sync_ms, b.update_ms)
        assert (a.forward_ms, a.backward_ms) == pytest.approx((b.forward_ms, b.backward_ms))
    got = cost_terms.pipeline_terms(want, comm, bounds, m, cl, host).latency().L_ms
    assert got == pipeline_latency(plan, profile, cluster).L_ms
    assert got == pytest.approx(scored, rel=1e-12)
