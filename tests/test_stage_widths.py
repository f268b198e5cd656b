"""Per-stage tensor widths t_i in the DAPPLE planner (:mod:`dapple.planner.stage_widths`).

Golden numbers are computed by hand below each test: equations 1-3 with free communication
reduce to sums of per-micro-batch stage times.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import check_tensor_groups
from dapple.cost.comm import comm_stage_ms
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedule_step import schedule_latency
from dapple.cost.terms import stage_terms
from dapple.errors import InfeasibleError
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search
from dapple.planner.stage_widths import MixedScorer, refine_stage_widths, regroup, shift_moves
from dapple.simulate.engine import simulate

GBPS = 8.0  # 8 Gbit/s = 1e6 bytes per ms: bytes / 1e6 = ms
LAT = 0.01


def _cluster(
    servers: int = 1, per_server: int = 4, lat: float = 0.0, memory: int = 64 * 1024**3
) -> Cluster:
    return Cluster(
        name="widths-test",
        servers=servers,
        devices_per_server=per_server,
        device_memory_bytes=memory,
        intra_server_bandwidth_gbps=GBPS,
        inter_server_bandwidth_gbps=GBPS,
        intra_server_latency_ms=lat,
        inter_server_latency_ms=lat,
    )


def _layer(
    name: str, f: float, params: int, tp: bool, out: float = 0.0, kept: float = 0.0
) -> LayerProfile:
    """F = f, B = 2f ms per sample."""
    return LayerProfile(
        name=name,
        forward=AffineTime(fixed_ms=0.0, per_sample_ms=f),
        backward=AffineTime(fixed_ms=0.0, per_sample_ms=2 * f),
        output_bytes_per_sample=out,
        parameter_bytes=params,
        kept_activation_bytes_per_sample=kept,
        tensor_parallel=tp,
    )


def _embed_then_blocks() -> ModelProfile:
    """A first layer that does not shard, F = 2 ms per sample and no parameters (an embedding
    lookup's cost without its weights), then two shardable blocks of F = 1 ms per sample and
    1e8 parameter bytes each. No activation bytes: communication and TP all-reduces are free
    (latency 0), only AR(P_s, g_s) of the blocks' parameters costs."""
    return ModelProfile(
        model_name="embed-blocks",
        layers=(
            _layer("embed", 2.0, 0, tp=False),
            _layer("b1", 1.0, 100_000_000, tp=True),
            _layer("b2", 1.0, 100_000_000, tp=True),
        ),
    )


def _stages(plan: Plan) -> list[tuple[tuple[int, int], tuple[int, ...], int]]:
    return [(s.layers, s.devices, s.tensor_width) for s in plan.stages]


# -- the planner: per-stage widths strictly win -----------------------------------------------


def test_golden_per_stage_widths_beat_every_uniform_width() -> None:
    """4 devices in one server, global batch 4. Replicating a block costs AR of 1e8 B (100 ms
    over two devices): blocks are never replicated. Tensor groups split a block's work but not
    the embedding's; replicas split the embedding's samples.

    * per-stage: embed on 2 replicas (0, 1), blocks on one t = 2 group (2, 3); M = 2, b = 2.
      Each stage takes F = 2 ms, B = 4 ms per micro-batch (embed: 1 sample x 2 ms; blocks:
      2 samples x 2 x 1 ms / 2): L = (M + S - 1)(F + B) = 3 x 6 = 18 ms.
    * t = 1: embed on (0, 1), b1 on 2, b2 on 3, each F + B = 6 ms at b = 2:
      L = (M + S - 1) x 6 = 4 x 6 = 24 ms.
    * t = 2: every stage needs a block: [embed, b1] on (0, 1), b2 on (2, 3); M = 4, b = 1:
      F0 + B0 = 2 + 4 + (1 + 2) / 2 = 7.5, F1 + B1 = 1.5: L = M x 7.5 = 30 ms (stage 1's
      1.5 ms round trip of the last micro-batch runs while stage 0 runs its pending backward,
      5 ms: ``cost.latency.pivot_waits``; the simulator agrees).
    * t = 4: one stage, the embedding whole on every rank: (6 + 2 x 3 / 4) x 4 samples = 30 ms.
    """
    prof, cluster = _embed_then_blocks(), _cluster()
    uniform = {t: dapple_search(prof, cluster, 4, tensor_widths=[t]) for t in (1, 2, 4)}
    assert {t: p.predicted_step_ms for t, p in uniform.items()} == {1: 24.0, 2: 30.0, 4: 30.0}
    assert simulate(uniform[2], prof, cluster).step_ms == pytest.approx(30.0)
    plan = dapple_search(prof, cluster, 4)
    assert plan.predicted_step_ms == pytest.approx(18.0)
    assert _stages(plan) == [((0, 1), (0, 1), 1), ((1, 3), (2, 3), 2)]
    assert plan.num_micro_batches == 2
    assert schedule_latency(plan, prof, cluster) == pytest.approx(18.0)
    assert simulate(plan, prof, cluster).step_ms == pytest.approx(18.0)


def test_a_stage_without_shardable_layers_keeps_width_one() -> None:
    """The embedding alone at t = 2 would run twice on the group's two ranks: no candidate."""
    prof, cluster = _embed_then_blocks(), _cluster()
    ms = MixedScorer({t: Scorer(prof, cluster, 4, tensor_width=t) for t in (1, 2)})
    assert ms.score([(0, 1, (0, 1), 2), (1, 3, (2, 3), 2)], 2) is None
    got = ms.score([(0, 1, (0, 1), 1), (1, 3, (2, 3), 2)], 2)
    assert got is not None and got.L_ms == pytest.approx(18.0)


def test_refinement_moves_a_cut_and_narrows_the_stage_it_empties() -> None:
    """From the t = 2 plan [embed, b1] | b2 (31.5 ms): moving the cut to 1 leaves the first
    stage without a block, so it drops to t = 1 on its devices, two replicas: the 18 ms plan."""
    prof, cluster = _embed_then_blocks(), _cluster()
    ms = MixedScorer({t: Scorer(prof, cluster, 4, tensor_width=t) for t in (1, 2)})
    start = [(0, 2, (0, 1), 2), (2, 3, (2, 3), 2)]
    got = refine_stage_widths(ms, start, 4, [1, 2, 4])
    assert got is not None
    stages, M, scored = got
    assert stages == [(0, 1, (0, 1), 1), (1, 3, (2, 3), 2)] and M == 2
    assert scored.L_ms == pytest.approx(18.0)


def test_refinement_merges_two_stages_into_one_tensor_group() -> None:
    """From the t = 1 plan embed | b1 | b2 (24 ms): b1 and b2 on devices 2 and 3 merge into one
    stage on the t = 2 group (2, 3): the 18 ms plan."""
    prof, cluster = _embed_then_blocks(), _cluster()
    ms = MixedScorer({t: Scorer(prof, cluster, 4, tensor_width=t) for t in (1, 2, 4)})
    start = [(0, 1, (0, 1), 1), (1, 2, (2,), 1), (2, 3, (3,), 1)]
    got = refine_stage_widths(ms, start, 2, [1, 2, 4])
    assert got is not None
    assert got[0] == [(0, 1, (0, 1), 1), (1, 3, (2, 3), 2)]
    assert got[2].L_ms == pytest.approx(18.0)


def test_shift_moves_a_middle_stage_by_one_layer_keeping_its_length() -> None:
    """Three stages of two layers: the middle one shifts one layer either way (its neighbours
    give and take a layer); the end stages have no neighbour on both sides and do not shift."""
    prof = ModelProfile(
        model_name="six", layers=tuple(_layer(f"b{i}", 1.0, 1000, tp=False) for i in range(6))
    )
    ms = MixedScorer({1: Scorer(prof, _cluster(per_server=3), 6)})
    stages = [(0, 2, (0,), 1), (2, 4, (1,), 1), (4, 6, (2,), 1)]
    assert shift_moves(ms, stages) == [
        (0, 3, ((0, 1, (0,), 1), (1, 3, (1,), 1), (3, 6, (2,), 1))),
        (0, 3, ((0, 3, (0,), 1), (3, 5, (1,), 1), (5, 6, (2,), 1))),
    ]
    # a neighbour of one layer cannot give it away
    assert shift_moves(ms, [(0, 1, (0,), 1), (1, 5, (1,), 1), (5, 6, (2,), 1)]) == []


def test_a_uniform_plan_scores_as_its_width_scorer() -> None:
    prof = _embed_then_blocks()
    cluster = _cluster(servers=2, per_server=4, lat=LAT)
    scorers = {t: Scorer(prof, cluster, 8, tensor_width=t) for t in (1, 2)}
    ms = MixedScorer(scorers)
    a = scorers[2].score([(0, 2, (0,)), (2, 3, (2, 3))], 4)
    b = ms.score([(0, 2, (0, 1), 2), (2, 3, (4, 5, 6, 7), 2)], 4)
    assert a is not None and a == b


@pytest.mark.parametrize(
    ("devices", "t", "want"),
    [
        ((3, 2, 1, 0), 2, (0, 1, 2, 3)),
        ((4, 5, 6, 7), 4, (4, 5, 6, 7)),
        ((1, 2), 2, None),  # not a group starting at a multiple of 2
        ((0, 1, 2), 2, None),  # not whole groups
        ((2, 3, 6, 7), 4, None),
        ((5,), 1, (5,)),
    ],
)
def test_regroup(devices: tuple[int, ...], t: int, want: tuple[int, ...] | None) -> None:
    assert regroup(devices, t) == want


# -- cost model and simulator on a mixed-width plan --------------------------------------------


def _mixed_plan() -> Plan:
    """Two servers of 4: embed on 2 replicas (0, 1), blocks on 2 replicas x t = 2 (4..7)."""
    return Plan(
        planner="manual",
        global_batch_size=8,
        micro_batch_size=2,
        num_micro_batches=4,
        stages=(
            StagePlan(layers=(0, 1), devices=(0, 1)),
            StagePlan(layers=(1, 3), devices=(4, 5, 6, 7), tensor_width=2),
        ),
    )


def _with_activations(prof: ModelProfile) -> ModelProfile:
    return dataclasses.replace(
        prof,
        layers=tuple(
            dataclasses.replace(
                x, output_bytes_per_sample=1e6, kept_activation_bytes_per_sample=1e6
            )
            for x in prof.layers
        ),
    )


def test_golden_split_concat_between_widths() -> None:
    """b = 2 split over 2 replicas each side: replica j sends its 1 sample (1e6 B) from device
    j to the first device of group j, 4 and 6, in the other server: both cross server 0's and
    server 1's network interface, 2e6 B: 0.01 ms + 2 ms."""
    prof = _with_activations(_embed_then_blocks())
    cluster = _cluster(servers=2, per_server=4, lat=LAT)
    plan = _mixed_plan()
    f, b = comm_stage_ms(prof, cluster, plan.stages[0], plan.stages[1], 2)
    assert f == b == pytest.approx(LAT + 2.0)
    assert stage_terms(plan, prof, cluster).boundaries[0].comm_ms == pytest.approx(LAT + 2.0)


def test_mixed_plan_cost_model_scorer_and_simulator_agree() -> None:
    prof = _with_activations(_embed_then_blocks())
    cluster = _cluster(servers=2, per_server=4, lat=LAT)
    plan = _mixed_plan()
    check_tensor_groups(plan, cluster)
    L = schedule_latency(plan, prof, cluster)
    ms = MixedScorer({t: Scorer(prof, cluster, 8, tensor_width=t) for t in (1, 2)})
    got = ms.score([(0, 1, (0, 1), 1), (1, 3, (4, 5, 6, 7), 2)], 4)
    assert got is not None and got.L_ms == pytest.approx(L)
    built = ms.build_plan("dapple", [(0, 1, (0, 1), 1), (1, 3, (4, 5, 6, 7), 2)], 4, got)
    assert _stages(built) == _stages(plan)
    assert schedule_latency(built, prof, cluster) == pytest.approx(built.predicted_step_ms)
    assert simulate(plan, prof, cluster).step_ms == pytest.approx(L, rel=0.05)


# -- properties ------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=2, max_size=5),
    times=st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=5, max_size=5),
    params=st.lists(st.sampled_from([0, 10**6, 10**8]), min_size=5, max_size=5),
    servers=st.integers(1, 2),
    per_server=st.sampled_from([2, 4]),
    gbs=st.sampled_from([2, 4, 8]),
    lat=st.sampled_from([0.0, LAT, 1.0]),
    memory=st.sampled_from([64 * 1024**3, 1024**3]),
)
@example(  # the width-2 DP's plan above the width-1 L refines (M re-picked) below it
    flags=[False, True, True],
    times=[0.5, 2.0, 4.0, 0.5, 0.5],
    params=[0, 10**6, 10**8, 0, 0],
    servers=2,
    per_server=4,
    gbs=4,
    lat=1.0,
    memory=64 * 1024**3,
)
def test_planner_is_never_worse_than_a_uniform_width(
    flags: list[bool],
    times: list[float],
    params: list[int],
    servers: int,
    per_server: int,
    gbs: int,
    lat: float,
    memory: int,
) -> None:
    """L of the planner <= L of the best uniform-width plan; every tensor group in one server;
    a stage of width > 1 holds a shardable layer; the plan costs what it predicts and fits
    memory (1 GiB: 1e8 parameter bytes take 4e8 with fp32 Adam, some plans must shard)."""
    prof = ModelProfile(
        model_name="random",
        layers=tuple(
            _layer(f"l{i}", times[i], params[i], tp, out=1e5, kept=1e6)
            for i, tp in enumerate(flags)
        ),
    )
    cluster = _cluster(servers, per_server, lat, memory)
    uniform = []
    for t in (1, 2, 4):
        if per_server % t == 0:
            with contextlib.suppress(InfeasibleError):
                uniform.append(
                    dapple_search(prof, cluster, gbs, tensor_widths=[t]).predicted_step_ms
                )
    if not uniform:
        with pytest.raises(InfeasibleError):
            dapple_search(prof, cluster, gbs)
        return
    plan = dapple_search(prof, cluster, gbs)
    assert plan.predicted_step_ms <= min(uniform)
    assert pipeline_latency(plan, prof, cluster).fits_memory
    check_tensor_groups(plan, cluster)
    for s in plan.stages:
        assert s.tensor_width == 1 or any(x.tensor_parallel for x in prof.layers[slice(*s.layers)])
    assert schedule_latency(plan, prof, cluster) == pytest.approx(plan.predicted_step_ms)


def test_a_scorer_that_has_searched_scores_every_candidate_as_a_fresh_one() -> None:
    """The scorers remember each stage's options and each comm stage (a local search's
    candidates share most stages): after a search, every candidate of its moves, at every M,
    scores exactly as it does on scorers that remember nothing yet."""
    from dapple.planner.stage_widths import applied, moves_of

    prof = ModelProfile(
        model_name="mixed",
        layers=tuple(
            _layer(f"l{i}", 0.5 + 0.25 * (i % 3), 50_000_000 * (i > 0), tp=i > 0, out=4e5, kept=2e6)
            for i in range(6)
        ),
    )
    cluster = _cluster(servers=2, per_server=4, lat=LAT, memory=2 * 1024**3)

    def fresh() -> MixedScorer:
        return MixedScorer({t: Scorer(prof, cluster, 16, "auto", t) for t in (1, 2, 4)})

    warm = fresh()
    start = [(0, 2, (0, 1), 1), (2, 4, (2, 3), 2), (4, 6, (4, 5, 6, 7), 4)]
    Ms = [1, 2, 4, 8, 16]
    got = refine_stage_widths(warm, start, 4, Ms)
    assert got is not None
    plans = [start, got[0]]
    for stages in (start, got[0]):
        plans += [applied(stages, m) for m in moves_of(warm, list(stages))]
    assert len(plans) > 10
    for stages in plans:
        for M in Ms:
            assert warm.score(stages, M) == fresh().score(stages, M), (stages, M)


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~35 CPU s; minutes of wall time on a loaded machine
def test_405b_on_16384_h100_reaches_below_the_24_stage_plan() -> None:
    """Llama-3.1-405B (analytic H100, fp8, full re-computation) on 2,048 servers of 8 H100,
    global batch 256, as ``dapple plan --zero-stage auto --tensor-widths auto --interleave``
    searches it. A plan of 24 stages at widths 2-8, M = 2, has L = simulated = 8,624.74 ms
    (``benchmarks/planning_time.md``); the search refining only its widths' best uniform plans
    ended at 8,727.26 (20 stages), a local optimum its merges reach from there. From each
    width's plan of most stages (128 one-layer stages at width 1) it ends lower."""
    from dapple.core.cluster_presets import load_cluster
    from dapple.profiler.analytic import analytic_profile

    prof = analytic_profile("llama3.1-405b", "h100", precision="fp8", recompute="full")
    cluster = load_cluster("h100-8x", 2048)
    plan = dapple_search(prof, cluster, 256, zero_stage="auto", interleaved=True)
    assert plan.predicted_step_ms <= 8_624.74
    assert simulate(plan, prof, cluster).step_ms == pytest.approx(plan.predicted_step_ms, rel=0.05)
