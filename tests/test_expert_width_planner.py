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
from dapple.core.moe_profile import MoEProfile
from dapple.core.plan import Plan
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedules import device_memory_by_group
from dapple.errors import InfeasibleError
from dapple.planner import make_plan
from dapple.planner.evaluate import Scorer
from dapple.planner.expert_grid import expert_grid_candidates, uniform_expert_grid_plan
from dapple.planner.expert_width import (
    ExpertScorer,
    make_scorer,
    with_and_without_widths,
    without_expert_widths,
)
from dapple.planner.search import dapple_search
from dapple.planner.zero_modes import UNSHARDED, ZeroMode

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

    def infeasible(ep: bool) -> Plan:
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
