"""``--zero-stage auto`` against each explicit zero stage: a plan's zero twins
(:mod:`dapple.planner.zero_twins`)."""

from __future__ import annotations

import pytest

from dapple.core.cluster_presets import load_cluster
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search
from dapple.planner.zero_twins import TWIN_STAGES, zero_twins
from dapple.profiler.analytic import analytic_profile


@pytest.fixture(scope="module")
def llama8b_on_16() -> tuple:
    """Llama-3 8B (analytic H100, bf16, selective re-computation, 4,096 tokens) on 2 x 8 H100,
    global batch 16."""
    prof = analytic_profile("llama3-8b", "h100", precision="bf16", seq_len=4096,
                            recompute="selective")  # fmt: skip
    return prof, load_cluster("h100-8x", 2), 16


def test_auto_is_not_slower_by_L_than_any_explicit_zero_stage(llama8b_on_16: tuple) -> None:
    """Without the twins auto's 1F1B plan read 556.495 ms: its stages hold their K_i unsharded,
    so auto kept them so, while ZeRO-1 and ZeRO-3 on the same structure update 1/r of the
    parameters per replica (535.604 ms)."""
    prof, cluster, B = llama8b_on_16
    auto = dapple_search(prof, cluster, B, zero_stage="auto")
    explicit = {z: dapple_search(prof, cluster, B, zero_stage=z) for z in TWIN_STAGES}
    best = min(p.predicted_step_ms for p in explicit.values())
    assert auto.predicted_step_ms <= best * (1 + 1e-9)
    assert explicit[0].predicted_step_ms > best * 1.01  # the case is one where sharding pays
    assert any(st.zero_stage > 0 for st in auto.stages if st.replicas > 1)


def test_a_twin_is_its_plan_scored_at_that_zero_stage(llama8b_on_16: tuple) -> None:
    prof, cluster, B = llama8b_on_16
    plan = dapple_search(prof, cluster, B, tensor_widths=[1], zero_stage="auto")
    found = [(plan.predicted_step_ms, 1, plan)]
    twins = zero_twins(found, prof, cluster, B)
    assert twins and all(tw.stages != plan.stages for _, _, tw in twins)
    stages = [(*st.layers, st.devices) for st in plan.stages]
    for L, t, twin in twins:
        assert t == 1 and twin.num_micro_batches == plan.num_micro_batches
        assert [st.layers for st in twin.stages] == [st.layers for st in plan.stages]
        zs = {st.zero_stage for st in twin.stages if st.replicas > 1}
        assert len(zs) == 1  # every replicated stage at one zero stage
        got = Scorer(prof, cluster, B, zs.pop()).score(stages, plan.num_micro_batches)
        assert got is not None and got.L_ms == pytest.approx(L, rel=1e-12)
        assert twin.predicted_step_ms == L


def test_no_plan_found_has_no_twins() -> None:
    from dapple.core.cluster_presets import PRESETS
    from dapple.profiler.paper_models import load_profile

    assert zero_twins([], load_profile("paper:bert48"), PRESETS["paper-a"], 64) == []


def test_405b_on_512_h100_refines_its_width_2_plan_without_zero2_too() -> None:
    """Llama-3.1-405B (analytic H100, fp8, full re-computation) on 64 x 8 H100, global batch
    256, widths 2, 4 and 8. Its width-2 plan (64 two-layer stages, M = 64) picks ZeRO-2 on 8
    stages where ZeRO-1 and re-computation hold the same micro-batches (L 39,117.23 against
    38,966.49 without ZeRO-2); the per-stage widths climbed from it to 34,636.46 (52 stages).
    Refined without ZeRO-2 as well (:class:`~dapple.planner.zero_twins.WithoutZero2`) it ends
    at 26,953.21 (28 stages), the plan the search found before the profile listed each layer's
    ``parameter_sizes`` (ZeRO-2's in-flight buckets then fitted nowhere)."""
    from dapple.cost.pipeline import pipeline_latency

    prof = analytic_profile("llama3.1-405b", "h100", precision="fp8", recompute="full")
    assert all(x.parameter_sizes for x in prof.layers)  # ZeRO-2 buckets by parameters
    cluster = load_cluster("h100-8x", 64)
    plan = dapple_search(prof, cluster, 256, zero_stage="auto", tensor_widths=[2, 4, 8])
    assert plan.predicted_step_ms <= 26_953.21
    got = pipeline_latency(plan, prof, cluster)
    assert got.fits_memory and got.L_ms == pytest.approx(plan.predicted_step_ms, rel=1e-9)
    from dapple.planner.zero_twins import WithoutZero2

    no2 = WithoutZero2(prof, cluster, 256, "auto", 2)
    assert [m.stage for m in no2._modes(0, 2, 4)] == [0, 1, 3]
    assert [m.stage for m in Scorer(prof, cluster, 256, "auto", 2)._modes(0, 2, 4)] == [0, 1, 2, 3]
