"""An elastic re-plan searches the space the first plan came from (its recorded options).

Before, :func:`dapple.runtime.launch.elastic.replan` called the planner with the run's 0-2 ZeRO
floor only: a plan made with ZeRO-3 (or auto), tensor widths, interleaving or lengths was
re-planned under other options after a lost device. On a cluster with device kinds, each with
its own profile, a re-plan keeps the kinds of the servers left and their profiles.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from builders import link_cluster, llm_layer, make_profile
from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan, straight_plan
from dapple.core.planning_options import PlanningOptions
from dapple.core.profile import LengthProfile, ModelProfile
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.profiler.paper_models import load_profile
from dapple.runtime.launch.elastic import (
    ElasticPolicy,
    ElasticStop,
    cluster_of,
    replan,
    servers_left,
)


def _llm_at_lengths(lens: tuple[int, ...] = (256, 1024), blocks: int = 6) -> ModelProfile:
    """embedding, shardable blocks, LM head, measured at ``lens`` (times scale with length)."""

    def chain(L: int) -> tuple:
        k = L / lens[-1]
        return (
            llm_layer("embedding", False, 0.25, 0.5 * k),
            *(llm_layer(f"block{i}", True, 0.25, 4.0 * k) for i in range(blocks)),
            llm_layer("lm_head", False, 0.25, 1.0 * k),
        )

    by_length = tuple(
        LengthProfile(seq_len=L, layers=chain(L), input_bytes_per_sample=8.0 * L) for L in lens
    )
    return ModelProfile(
        model_name="tiny-llm",
        layers=by_length[-1].layers,
        input_bytes_per_sample=by_length[-1].input_bytes_per_sample,
        seq_len=lens[-1],
        by_length=by_length,
    )


def test_a_zero3_interleaved_length_aware_plan_is_replanned_with_its_own_options() -> None:
    prof = _llm_at_lengths()
    cluster = link_cluster("elastic-options", 1, 8, 12.0)
    opts = {"zero_stage": 3, "interleave": True, "tensor_widths": [1, 2, 4], "mean_seq_len": 512,
            "max_seq_len": 1024}  # fmt: skip
    first = make_plan(prof, cluster, 8, **opts)  # type: ignore[arg-type]
    assert first.planned_with == PlanningOptions(
        zero_stage=3, tensor_widths=(1, 2, 4), interleave=True
    )
    assert (first.mean_seq_len, first.max_seq_len) == (512, 1024)
    # the options survive the plan file
    again = Plan.from_dict(first.to_dict())
    assert again.planned_with == first.planned_with

    # one device of 8 lost: the run's ZeRO floor (0) is not what the plan was searched with
    policy = ElasticPolicy(prof, cluster, zero_stage=0)
    new = replan(policy, 7, again)
    left = cluster_of(cluster, 7)  # 7 devices on the server: widths 2 and 4 no longer divide it
    want = make_plan(prof, left, 8, zero_stage=3, interleave=True, tensor_widths=[1],
                     mean_seq_len=512, max_seq_len=1024)  # fmt: skip
    assert new == want and new.predicted_step_ms == want.predicted_step_ms
    assert (new.mean_seq_len, new.max_seq_len) == (512, 1024)
    assert new.planned_with == PlanningOptions(zero_stage=3, tensor_widths=(1,), interleave=True)

    # on 4 devices (widths 2 and 4 divide them) the recorded widths are searched as they were
    four = replan(policy, 4, again)
    want4 = make_plan(prof, cluster_of(cluster, 4), 8, **opts)  # type: ignore[arg-type]
    assert four == want4


def test_a_plan_put_under_a_schedule_is_replanned_under_it(tmp_path: Path) -> None:
    """A ZeRO-3, length-aware plan put under ``gpipe`` (``dapple plan --schedule gpipe``) that
    loses a device is re-planned as :func:`dapple.api.plan` plans it for the devices left, under
    gpipe again; the planner's search alone (no ``plan_again``) leaves it at the planner's."""
    from dapple.api.planning import plan, plan_again

    prof = _llm_at_lengths()
    cluster = link_cluster("elastic-options", 1, 8, 12.0)
    opts = {"zero_stage": 3, "tensor_widths": [1, 2, 4], "mean_seq_len": 512, "max_seq_len": 1024,
            "schedule": "gpipe"}  # fmt: skip
    first = plan(prof, cluster, 8, output=tmp_path / "p.json", **opts)  # type: ignore[arg-type]
    assert first.schedule == "gpipe"
    recorded = Plan.load(tmp_path / "p.json").planned_with
    assert recorded == PlanningOptions(zero_stage=3, tensor_widths=(1, 2, 4), schedule="gpipe")

    new = replan(
        ElasticPolicy(prof, cluster, plan_again=plan_again), 7, Plan.load(tmp_path / "p.json")
    )
    want = plan(prof, cluster_of(cluster, 7), 8, **{**opts, "tensor_widths": [1]})  # type: ignore[arg-type]
    assert new == want and new.schedule == "gpipe"
    assert new.predicted_step_ms == want.predicted_step_ms
    assert new.planned_with == PlanningOptions(zero_stage=3, tensor_widths=(1,), schedule="gpipe")
    searched = replan(ElasticPolicy(prof, cluster), 7, first)
    assert searched.schedule != "gpipe" and searched.planned_with is not None
    assert searched.planned_with.schedule is None


def test_a_plan_without_recorded_options_replans_with_the_policy_floor() -> None:
    prof = _llm_at_lengths()
    cluster = link_cluster("elastic-options", 1, 4, 12.0)
    hand = dataclasses.replace(make_plan(prof, cluster, 8), planned_with=None)
    assert "planned_with" not in hand.to_dict()
    new = replan(ElasticPolicy(prof, cluster, zero_stage=2), 3, hand)
    assert new.planned_with == PlanningOptions(zero_stage=2)
    assert new == make_plan(prof, cluster_of(cluster, 3), 8, zero_stage=2)


def test_an_earlier_plan_file_with_zero_stage_minus_one_reads_and_replans_as_auto(
    tmp_path: Path,
) -> None:
    """Plan files of earlier versions store ``auto`` as -1 in ``planned_with.zero_stage``."""
    prof = load_profile("paper:bert48")
    small = dataclasses.replace(PRESETS["paper-a"], device_memory_bytes=8 * 2**30)
    plan = make_plan(prof, small, 64, zero_stage="auto")
    assert plan.to_dict()["planned_with"]["zero_stage"] == "auto"
    old = plan.to_dict()
    old["planned_with"]["zero_stage"] = -1
    path = tmp_path / "old-plan.json"
    path.write_text(json.dumps(old))

    loaded = Plan.load(path)
    assert loaded == plan and loaded.planned_with == PlanningOptions(zero_stage="auto")
    assert loaded.to_dict()["planned_with"]["zero_stage"] == "auto"
    # one server of two lost: re-planned with auto, which shards where the run's floor of 0
    # would not
    new = replan(ElasticPolicy(prof, small, zero_stage=0), 8, loaded)
    left = cluster_of(small, 8)
    want = make_plan(prof, left, 64, zero_stage="auto")
    assert new == want and new.predicted_step_ms == want.predicted_step_ms
    assert new.planned_with == PlanningOptions(zero_stage="auto")
    assert new != make_plan(prof, left, 64, zero_stage=0)


def test_an_earlier_plan_file_with_interleaved_and_seq_len_reads_as_interleave_and_mean_seq_len(
    tmp_path: Path,
) -> None:
    """Plan files of earlier versions record ``planned_with.interleave`` as ``interleaved``
    and the mean length ``mean_seq_len`` as ``seq_len``; this version writes the new keys."""
    plan = dataclasses.replace(
        straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2),
        mean_seq_len=300.0,
        max_seq_len=1024.0,
        planned_with=PlanningOptions(zero_stage=3, interleave=True),
    )
    new = plan.to_dict()
    assert new["planned_with"]["interleave"] is True and new["mean_seq_len"] == 300.0
    assert "interleaved" not in new["planned_with"] and "seq_len" not in new
    old = json.loads(json.dumps(new))
    old["planned_with"]["interleaved"] = old["planned_with"].pop("interleave")
    old["seq_len"] = old.pop("mean_seq_len")
    path = tmp_path / "old-plan.json"
    path.write_text(json.dumps(old))
    loaded = Plan.load(path)
    assert loaded == plan and loaded.planned_with == plan.planned_with
    assert (loaded.mean_seq_len, loaded.max_seq_len) == (300.0, 1024.0)
    with pytest.raises(TypeError, match=r"make_plan\(\) takes interleave= now, not interleaved="):
        make_plan(_llm_at_lengths(), link_cluster("x", 1, 2, 12.0), 8, interleaved=True)


def test_recorded_options_are_checked() -> None:
    with pytest.raises(ValidationError, match="zero_stage must be 0-3 or auto, got 7"):
        PlanningOptions.from_dict({"zero_stage": 7})
    for bad in (-2, "two", True, 1.0):
        with pytest.raises(ValidationError, match=f"zero_stage must be 0-3 or auto, got {bad!r}"):
            PlanningOptions.from_dict({"zero_stage": bad})
    with pytest.raises(ValidationError, match="tensor_widths must be"):
        PlanningOptions.from_dict({"tensor_widths": "4"})
    with pytest.raises(ValidationError, match="planned_with must be an object"):
        PlanningOptions.from_dict([1])


# -- a cluster with device kinds, each with its own profile (issue #43) ------------------------
def _kinds_cluster() -> tuple[ModelProfile, Cluster]:
    """Two servers of 2: an H kind, and an A kind 4x slower on layers 0-1 of 4 (own profiles)."""
    from dapple.core.device_kinds import DeviceKind
    from dapple.core.kind_profiles import with_kind_profiles

    h, a = make_profile(4), make_profile(4)
    a = dataclasses.replace(a, layers=tuple(
        dataclasses.replace(x, forward=dataclasses.replace(x.forward, per_sample_ms=4 * x.forward.per_sample_ms),
                            backward=dataclasses.replace(x.backward, per_sample_ms=4 * x.backward.per_sample_ms))
        if i < 2 else x for i, x in enumerate(a.layers)))  # fmt: skip
    kinds = (
        DeviceKind(name="H", servers=1, device_memory_bytes=2**30),
        DeviceKind(name="A", servers=1, speed=0.4, device_memory_bytes=2**29),
    )
    c = dataclasses.replace(link_cluster("kinds", 2, 2, 12.0), device_memory_bytes=2**29,
                            kinds=kinds)  # fmt: skip
    return h, with_kind_profiles(c, {"H": h, "A": a})


def test_servers_left_keep_each_kind_and_its_profile() -> None:
    _, c = _kinds_cluster()
    h_only, keep = servers_left(c, 4, [3])
    assert [(k.name, k.servers) for k in h_only.kinds] == [("H", 1)] and keep == [0, 1]
    assert h_only.kinds[0].profile is c.kinds[0].profile and h_only.device_memory_bytes == 2**30
    a_only, keep = servers_left(c, 4, [0])
    assert [(k.name, k.servers) for k in a_only.kinds] == [("A", 1)] and keep == [2, 3]
    assert a_only.kinds[0].profile is c.kinds[1].profile and a_only.device_memory_bytes == 2**29
    assert servers_left(c, 2, [])[1] == [0, 1]  # a run on the H server alone keeps it
    with pytest.raises(ElasticStop, match="no whole server of cluster 'kinds' left"):
        servers_left(c, 4, [1, 2])
    assert [k.name for k in cluster_of(c, 3).kinds] == ["H"]  # by count: the first servers


def test_a_lost_device_replans_on_the_kinds_left_with_their_own_profiles(tmp_path: Path) -> None:
    """Rank 0 (an H device) lost: the re-plan runs on the A server alone, at A's own times, on
    the devices named 2 and 3; the lost H server's other device is left idle."""
    import os

    from dapple.runtime.launch.elastic import train_elastic
    from dapple.runtime.launch.failure import RankFailure
    from dapple.runtime.train_config import TrainConfig

    h, c = _kinds_cluster()
    first = make_plan(h, c, 8)
    assert len(first.devices) == 4
    seen: list[tuple[Plan, str]] = []

    def attempt(plan: Plan, config: TrainConfig) -> None:
        seen.append((plan, os.environ.get("CUDA_VISIBLE_DEVICES", "")))
        if len(seen) == 1:
            raise RankFailure("workers failed", {0: -9, 1: 1, 2: 1, 3: 1})

    os.environ["CUDA_VISIBLE_DEVICES"] = "g0,g1,g2,g3"
    try:
        config = TrainConfig(steps=2, checkpoint_dir=str(tmp_path / "ck"), save_every=1)
        result = train_elastic(first, config, attempt, policy=ElasticPolicy(h, c))
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    (_, _), (second, visible) = seen
    a_only = c.without_servers([0])
    assert second == make_plan(h, a_only, 8) and result.plan == second
    assert visible == ",".join(["g2", "g3"][: len(second.devices)])
    # priced at A's own times: slower than the same plan on H's profile alone
    plain = dataclasses.replace(a_only, kinds=())
    assert second.predicted_step_ms > 1.2 * make_plan(h, plain, 8).predicted_step_ms


def test_torchrun_does_not_replan_a_cluster_of_kinds() -> None:
    from dapple.runtime.launch.elastic import plan_for_world

    h, c = _kinds_cluster()
    plan = make_plan(h, c, 8)
    assert plan_for_world(plan, len(plan.devices), ElasticPolicy(h, c)) is plan
    # the kinds differ in memory, or only in their own profiles
    alike = dataclasses.replace(c, kinds=tuple(
        dataclasses.replace(k, device_memory_bytes=2**29) for k in c.kinds))  # fmt: skip
    for cluster in (c, alike):
        with pytest.raises(ElasticStop, match="torchrun's ranks do not say which servers are"):
            plan_for_world(plan, 2, ElasticPolicy(h, cluster))
