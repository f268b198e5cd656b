"""StagePlan.expert_width (e_s): its groups, its checks and its plan-file round trip."""

from __future__ import annotations

import pytest

from dapple.core.stage_plan import StagePlan
from dapple.errors import ValidationError


def test_expert_groups_and_shards_partition_the_replicas() -> None:
    st = StagePlan(layers=(0, 2), devices=(4, 5, 6, 7, 8, 9), expert_width=3)
    assert [st.expert_group(j) for j in range(6)] == [(0, 1, 2)] * 3 + [(3, 4, 5)] * 3
    assert [st.expert_shard_replicas(j) for j in range(3)] == [(0, 3), (1, 4), (2, 5)]
    one = StagePlan(layers=(0, 2), devices=(0, 1))
    assert one.expert_group(1) == (1,) and one.expert_shard_replicas(1) == (0, 1)


def test_expert_width_round_trips_and_is_written_only_when_set() -> None:
    st = StagePlan(layers=(0, 2), devices=(0, 1, 2, 3), tensor_width=2, expert_width=2)
    assert st.to_dict()["expert_width"] == 2
    assert StagePlan.from_dict(st.to_dict(), 0) == st
    assert "expert_width" not in StagePlan(layers=(0, 2), devices=(0, 1)).to_dict()


@pytest.mark.parametrize("bad", [0, 2, -1, True, 1.0])
def test_expert_width_must_divide_the_replicas(bad: object) -> None:
    with pytest.raises(ValidationError, match=r"stage \[0, 2\]: expert_width must be a divisor"):
        StagePlan(layers=(0, 2), devices=(0, 1, 2), expert_width=bad)  # type: ignore[arg-type]


def test_interleave_keeps_each_stage_setting_but_its_in_flight_bound() -> None:
    from dapple.core.plan import Plan, interleave

    plan = Plan(planner="test", global_batch_size=8, micro_batch_size=4, num_micro_batches=2,
                stages=(StagePlan(layers=(0, 4), devices=(0,), max_in_flight=2),
                        StagePlan(layers=(4, 8), devices=(1, 2), expert_width=2, zero_stage=1,
                                  recompute="full")))  # fmt: skip
    chunks = interleave(plan, 2).stages
    assert [c.layers for c in chunks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [c.expert_width for c in chunks] == [1, 2, 1, 2]
    assert [c.zero_stage for c in chunks] == [0, 1, 0, 1] and chunks[3].recompute
    assert all(c.max_in_flight is None for c in chunks)
