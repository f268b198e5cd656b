"""The planner's per-stage expert-parallel width e_s (issue 45, :mod:`dapple.planner.expert_width`)
and the uniform EP grid (:mod:`dapple.planner.expert_grid`): the width is chosen where it is
faster or where memory asks for it, the plan's predicted L is the cost model's for the chosen
widths, and a profile without experts plans exactly as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dapple.cli import main
from dapple.core import AffineTime, LayerProfile, ModelProfile
from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.moe_profile import MoEProfile
from dapple.core.plan import Plan, StagePlan
from dapple.cost.peak_memory import plan_stage_bytes
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedule_step import device_memory_by_group
from dapple.cost.terms import stage_terms
from dapple.errors import InfeasibleError
from dapple.planner import make_plan
from dapple.planner.expert_grid import expert_grid_candidates, uniform_expert_grid_plan
from dapple.planner.expert_width import (
    ExpertScorer,
    make_scorer,
    with_and_without_widths,
    without_expert_widths,
    zero_zero_twin,
)
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search
from dapple.planner.stage_options import stage_choice
from dapple.planner.zero_modes import UNSHARDED, ZeroMode
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.analytic_models import TransformerSpec
from dapple.profiler.analytic_moe_models import MOE_SHAPES

# 2 servers of 4 devices, a slow network between them.
CLUSTER = Cluster(name="t", servers=2, devices_per_server=4, device_memory_bytes=64 * GIB,
                  intra_server_bandwidth_gbps=8000, inter_server_bandwidth_gbps=100,
                  intra_server_latency_ms=0.01, inter_server_latency_ms=0.05)  # fmt: skip


def _profile(expert_bytes: int = 4 * 10**9, blocks: int = 4, dense: bool = False) -> ModelProfile:
    """embedding, ``blocks`` MoE blocks (8 experts of ``expert_bytes`` in all, 10 MB dense, a
    small all-to-all), head; 1 ms per sample each way per layer."""
    t = AffineTime(fixed_ms=0.1, per_sample_ms=1.0)
    moe = MoEProfile(experts=8, top_k=2, expert_parameter_bytes=expert_bytes,
                     tokens_per_expert_per_sample=64.0, dispatch_bytes_per_sample=1e5,
                     combine_bytes_per_sample=1e5)  # fmt: skip

    def layer(name: str, pb: int, m: MoEProfile | None) -> LayerProfile:
        return LayerProfile(name=name, forward=t, backward=t, output_bytes_per_sample=1e4,
                            parameter_bytes=pb, kept_activation_bytes_per_sample=1e5,
                            moe=None if dense else m)  # fmt: skip

    layers = [layer("embedding", 10**7, None)]
    layers += [layer(f"block{i}", 10**7 + expert_bytes, moe) for i in range(blocks)]
    layers.append(layer("head", 10**7, None))
    return ModelProfile(model_name="moe", layers=tuple(layers))


def test_zero_modes_keep_their_meaning_at_width_one() -> None:
    assert ZeroMode(0) == UNSHARDED and ZeroMode(0, False, 1) == UNSHARDED
    assert ZeroMode(0, False, 2) != UNSHARDED


def test_only_a_profile_with_experts_gets_the_expert_scorer() -> None:
    assert type(make_scorer(_profile(dense=True), CLUSTER, 16)) is Scorer
    assert type(make_scorer(_profile(), CLUSTER, 16, tensor_width=2)) is Scorer
    assert type(make_scorer(_profile(), CLUSTER, 16)) is ExpertScorer


def test_the_search_shards_experts_where_their_allreduce_costs_more_than_the_all_to_all() -> None:
    prof = _profile()
    plan = make_plan(prof, CLUSTER, 16, tensor_widths=[1])
    widths = [st.expert_width for st in plan.stages]
    assert max(widths) > 1, plan.stages
    for st in plan.stages:  # each width divides the stage's replicas and E = 8
        assert st.replicas % st.expert_width == 0 and 8 % st.expert_width == 0
    assert plan.predicted_step_ms == pytest.approx(pipeline_latency(plan, prof, CLUSTER).L_ms)
    unsharded = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(st, expert_width=1) for st in plan.stages)
    )
    assert pipeline_latency(unsharded, prof, CLUSTER).L_ms > plan.predicted_step_ms


def test_a_model_whose_experts_fit_only_sharded_is_planned_with_a_width() -> None:
    # 6 blocks x 1.6 GB of experts: 16 bytes each per parameter byte whole is ~154 GB; 8 GiB
    # devices hold it only sharded (at e_s = 8 about 20 GB over 8 devices... per stage)
    small = dataclasses.replace(CLUSTER, device_memory_bytes=8 * GIB)
    prof = _profile(expert_bytes=16 * 10**8, blocks=6)
    plan = make_plan(prof, small, 16, tensor_widths=[1])
    assert any(st.expert_width > 1 for st in plan.stages)
    assert max(device_memory_by_group(plan, prof)) <= small.usable_memory_bytes
    no_experts = ExpertScorer(prof, small, 16, widths=(1,))
    stages = [
        (s, e, d) for s, e, d in ((st.layers[0], st.layers[1], st.devices) for st in plan.stages)
    ]
    assert no_experts.score(stages, plan.num_micro_batches) is None  # unsharded, it does not fit


def test_a_profile_without_experts_plans_as_before() -> None:
    prof = _profile(dense=True)
    plan = make_plan(prof, CLUSTER, 16, tensor_widths=[1])
    assert all(st.expert_width == 1 for st in plan.stages)
    assert expert_grid_candidates(prof, CLUSTER, 16) == []


def test_the_uniform_grid_gives_every_moe_stage_one_width() -> None:
    prof = _profile()
    cands = expert_grid_candidates(prof, CLUSTER, 16, micro_batches=[2, 4])
    assert cands
    for c in cands:
        moe_stages = [st for st in c.plan.stages if any(
            x.moe is not None for x in prof.layers[st.layers[0] : st.layers[1]])]  # fmt: skip
        assert {st.expert_width for st in moe_stages} == {c.expert_width}
        assert c.point.dp % c.expert_width == 0
        assert c.L_ms == pytest.approx(pipeline_latency(c.plan, prof, CLUSTER).L_ms)
        assert f"ep{c.expert_width}" in c.label
    plan, label = uniform_expert_grid_plan(prof, CLUSTER, 16)
    assert label.startswith("dp")
    assert plan.predicted_step_ms <= min(c.L_ms for c in cands)
    with pytest.raises(InfeasibleError):
        uniform_expert_grid_plan(prof, dataclasses.replace(CLUSTER, device_memory_bytes=GIB), 16)


def test_plan_prints_and_simulate_shows_the_widths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, cluster = tmp_path / "p.json", tmp_path / "c.json"
    prof.write_text(json.dumps(_profile().to_dict()))
    cluster.write_text(json.dumps(CLUSTER.to_dict()))
    out = tmp_path / "plan.json"
    args = ["--profile", str(prof), "--cluster", str(cluster)]
    assert (
        main(["plan", *args, "--global-batch-size", "16", "--tensor-widths", "1", "-o", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "expert width" in printed and "experts sharded e_s=" in printed
    widths = [st.expert_width for st in Plan.load(out).stages]
    assert max(widths) > 1
    assert main(["simulate", "--plan", str(out), *args]) == 0
    shown = capsys.readouterr().out
    assert "expert widths: stage 0 e_s=" + str(widths[0]) in shown


def test_the_search_keeps_the_better_of_with_and_without_widths() -> None:
    prof = _profile()
    both = dapple_search(prof, CLUSTER, 16, tensor_widths=[1, 2])
    ep = dapple_search(prof, CLUSTER, 16, tensor_widths=[1, 2], experts=True)
    plain = dapple_search(prof, CLUSTER, 16, tensor_widths=[1, 2], experts=False)
    assert all(st.expert_width == 1 for st in plain.stages)
    assert both.predicted_step_ms == min(ep.predicted_step_ms, plain.predicted_step_ms)

    def infeasible(ep: bool, below_ms: float) -> Plan:
        if ep:
            raise InfeasibleError("no plan")
        return plain

    assert with_and_without_widths(infeasible) is plain


def test_what_the_search_interleaves_holds_every_expert() -> None:
    # the runtime runs expert parallelism under one chunk per device group only
    ep = make_plan(_profile(), CLUSTER, 16, tensor_widths=[1])
    assert max(st.expert_width for st in ep.stages) > 1
    whole = without_expert_widths(ep)
    assert [st.expert_width for st in whole.stages] == [1] * len(ep.stages)
    assert [st.layers for st in whole.stages] == [st.layers for st in ep.stages]
    assert without_expert_widths(whole) is whole


def test_expert_modes_follow_the_zero_stage() -> None:
    prof = _profile(blocks=2)

    def modes(z: object) -> list[tuple[int, int]]:
        scorer = ExpertScorer(prof, CLUSTER, 16, zero_stage=z)  # type: ignore[arg-type]
        return [(m.stage, m.expert_width) for m in scorer.expert_modes(0, 4, 8)]

    assert modes(0) == [(0, 2), (0, 4), (0, 8)]
    assert modes(1) == [(1, 2), (1, 4), (1, 8)]
    assert modes(2) == [(2, 2), (2, 4), (2, 8)]
    assert modes("auto") == [(z, w) for w in (2, 4, 8) for z in (0, 1, 2)]
    assert modes(3) == [] and modes(ZeroMode(3, True)) == []
    assert ExpertScorer(prof, CLUSTER, 16, zero_stage=1).expert_modes(0, 4, 1) == []


def _need(prof: ModelProfile, st: StagePlan, b: int) -> float:
    """The bytes one replica of ``st`` needs for one micro-batch (in_flight_limit's first)."""
    sb = plan_stage_bytes(prof, st, b)
    return sb.static + sb.shared + max(sb.first, sb.grads + sb.later, sb.grads - sb.cache)


def test_memory_asks_for_zero_below_the_full_width_and_the_scorer_prices_it_as_the_cost_model(
) -> None:  # fmt: skip
    """One stage of 2 MoE blocks on 8 devices (2 servers), widths 1 and 4 offered: with device
    memory between what EP 4 needs under ZeRO-1 (the experts' state over each shard's 2 copies)
    and without ZeRO, ``auto`` picks EP 4 with ZeRO-1 (or ZeRO-2), ZeRO 0 finds nothing that
    holds one micro-batch; the option's terms are :func:`stage_terms`' of the plan it records."""
    prof = _profile(expert_bytes=8 * 10**9, blocks=2)
    d, b, G = tuple(range(8)), 8, 16
    st = {z: StagePlan(layers=(0, 4), devices=d, expert_width=4, zero_stage=z) for z in (0, 1)}
    lo, hi = _need(prof, st[1], b), _need(prof, st[0], b)
    assert lo < hi
    mem = int((lo + hi) / 2) + CLUSTER.reserved_memory_bytes
    cluster = dataclasses.replace(CLUSTER, device_memory_bytes=mem)
    auto = ExpertScorer(prof, cluster, G, zero_stage="auto", widths=(1, 4))
    opts = auto.stage_options(0, 4, d, b)
    by_mode = dict(opts)
    assert by_mode[ZeroMode(0, False, 4)].d_nr == 0 and by_mode[ZeroMode(1, False, 4)].d_nr >= 1
    got = stage_choice(opts, 1, G // b, True)
    assert got is not None and got[0] in (ZeroMode(1, False, 4), ZeroMode(2, False, 4)), got
    plain = ExpertScorer(prof, cluster, G, zero_stage=0, widths=(1, 4))
    assert all(o.d_nr == 0 and o.d_r == 0 for _, o in plain.stage_options(0, 4, d, b))
    for z in (1, 2):  # the scorer's EP + ZeRO option = the cost model of the plan it records
        mode = ZeroMode(z, False, 4)  # type: ignore[arg-type]
        rec = auto.stage_plan(0, 4, d, mode)
        assert (rec.zero_stage, rec.expert_width) == (z, 4)
        plan = Plan(planner="t", model_name="moe", global_batch_size=G, micro_batch_size=b,
                    num_micro_batches=G // b, stages=(rec,))  # fmt: skip
        want = stage_terms(plan, prof, cluster).stages[0].terms
        have = by_mode[mode].plain
        assert (have.sync_ms, have.update_ms) == pytest.approx((want.sync_ms, want.update_ms))
        assert (have.forward_ms, have.backward_ms) == pytest.approx(
            (want.forward_ms, want.backward_ms)
        )


def test_the_search_under_zero_1_shards_experts_and_predicts_the_cost_model() -> None:
    prof = _profile()
    plan = make_plan(prof, CLUSTER, 16, tensor_widths=[1], zero_stage=1)
    assert any(st.expert_width > 1 for st in plan.stages), plan.stages
    assert all(st.zero_stage == 1 for st in plan.stages if st.replicas > 1)
    assert plan.predicted_step_ms == pytest.approx(pipeline_latency(plan, prof, CLUSTER).L_ms)


def test_the_zero_zero_twin_offers_the_widths_at_zero_0_only() -> None:
    prof = _profile(blocks=2)
    twin = zero_zero_twin(ExpertScorer(prof, CLUSTER, 16, zero_stage="auto", widths=(1, 4)))
    assert twin is not None and twin.zero_stage == "auto" and twin.widths == frozenset({1, 4})
    assert [(m.stage, m.expert_width) for m in twin.expert_modes(0, 4, 8)] == [(0, 4)]
    assert zero_zero_twin(twin) is None  # it has no ZeRO-1/2 widths to leave out
    assert zero_zero_twin(ExpertScorer(prof, CLUSTER, 16, zero_stage=0)) is None
    assert zero_zero_twin(ExpertScorer(prof, CLUSTER, 16, zero_stage=1)) is None
    assert zero_zero_twin(Scorer(prof, CLUSTER, 16, "auto")) is None


def test_the_widths_offered_at_zero_1_and_2_too_do_not_end_at_a_higher_l(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek-V3's shapes with 8 blocks on 32 H100, full re-computation, B 128, ``auto``: the
    search offering the EP widths at ZeRO 0, 1 and 2 ends no higher than the one offering them
    at ZeRO 0 only. Without the width-1 search's ZeRO-0 twin it ended at 2,396.1 against
    2,277.4 ms: its better uniform width-1 plan refined to per-stage tensor widths less well."""
    spec = TransformerSpec(name="deepseek-v3-8", **{**MOE_SHAPES["deepseek-v3"], "layers": 8})
    prof = analytic_profile(spec, "h100", precision="bf16", recompute="full")
    cluster = PRESETS["h100-8x"].with_servers(4)
    wide = dapple_search(prof, cluster, 128, zero_stage="auto", experts=True)
    every = ExpertScorer.expert_modes

    def zero_only(sc: ExpertScorer, s: int, e: int, replicas: int) -> list[ZeroMode]:
        return [m for m in every(sc, s, e, replicas) if m.stage == 0]

    monkeypatch.setattr(ExpertScorer, "expert_modes", zero_only)
    narrow = dapple_search(prof, cluster, 128, zero_stage="auto", experts=True)
    assert any(st.expert_width > 1 for st in narrow.stages), narrow.stages
    assert wide.predicted_step_ms <= narrow.predicted_step_ms


def test_the_search_with_widths_offered_ends_no_higher_than_without() -> None:
    """Mixtral-8x7B's shapes with 8 blocks on 32 H100, B 128, ``auto``: the default search (with
    and without widths, :func:`with_and_without_widths`) ends no higher than the search without
    widths alone. When the second pass's bound (the first's L, 805.1 ms) started its uniform
    searches' incumbent, it pruned the width-1 plan whose per-stage widths reach 793.9 ms."""
    spec = TransformerSpec(name="mixtral-8", **{**MOE_SHAPES["mixtral-8x7b"], "layers": 8})
    prof = analytic_profile(spec, "h100", precision="bf16", recompute="none")
    cluster = PRESETS["h100-8x"].with_servers(4)
    both = dapple_search(prof, cluster, 128, zero_stage="auto")
    plain = dapple_search(prof, cluster, 128, zero_stage="auto", experts=False)
    assert both.predicted_step_ms <= plain.predicted_step_ms
