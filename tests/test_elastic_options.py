"""An elastic re-plan searches the space the first plan came from (its recorded options).

Before, :func:`dapple.runtime.launch.elastic.replan` called the planner with the run's 0-2 ZeRO
floor only: a plan made with ZeRO-3 (or auto), tensor widths, interleaving or lengths was
re-planned under other options after a lost device.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from builders import link_cluster, llm_layer
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan
from dapple.core.planning_options import PlanningOptions
from dapple.core.profile import LengthProfile, ModelProfile
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.profiler.paper_models import load_profile
from dapple.runtime.launch.elastic import ElasticPolicy, cluster_of, replan


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
    opts = {"zero_stage": 3, "interleaved": True, "tensor_widths": [1, 2, 4], "seq_len": 512,
            "max_seq_len": 1024}  # fmt: skip
    first = make_plan(prof, cluster, 8, **opts)  # type: ignore[arg-type]
    assert first.planned_with == PlanningOptions(
        zero_stage=3, tensor_widths=(1, 2, 4), interleaved=True
    )
    assert (first.seq_len, first.max_seq_len) == (512, 1024)
    # the options survive the plan file
    again = Plan.from_dict(first.to_dict())
    assert again.planned_with == first.planned_with

    # one device of 8 lost: the run's ZeRO floor (0) is not what the plan was searched with
    policy = ElasticPolicy(prof, cluster, zero_stage=0)
    new = replan(policy, 7, again)
    left = cluster_of(cluster, 7)  # 7 devices on the server: widths 2 and 4 no longer divide it
    want = make_plan(prof, left, 8, zero_stage=3, interleaved=True, tensor_widths=[1],
                     seq_len=512, max_seq_len=1024)  # fmt: skip
    assert new == want and new.predicted_step_ms == want.predicted_step_ms
    assert (new.seq_len, new.max_seq_len) == (512, 1024)
    assert new.planned_with == PlanningOptions(zero_stage=3, tensor_widths=(1,), interleaved=True)

    # on 4 devices (widths 2 and 4 divide them) the recorded widths are searched as they were
    four = replan(policy, 4, again)
    want4 = make_plan(prof, cluster_of(cluster, 4), 8, **opts)  # type: ignore[arg-type]
    assert four == want4


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
