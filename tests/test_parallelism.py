"""Parallelism: one stage's replicas, tensor width, ZeRO stage, regather and expert width."""

from __future__ import annotations

import itertools
import json

import pytest

from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan
from dapple.core.stage_plan import StagePlan
from dapple.errors import ValidationError


def _valid() -> list[Parallelism]:
    """Every valid layout with r_s <= 4, t_s <= 4 (regather only with ZeRO-3)."""
    out = []
    for r, t, z, again, e in itertools.product(
        (1, 2, 3, 4), (1, 2, 4), (0, 1, 2, 3), (False, True), (1, 2, 4)
    ):
        if (z == 3 and r == 1) or (again and z != 3) or r % e:
            continue
        out.append(Parallelism(replicas=r, tensor_width=t, zero_stage=z, regather=again,
                               expert_width=e))  # fmt: skip
    return out


@pytest.mark.parametrize("p", _valid(), ids=str)
def test_properties_say_what_the_numbers_mean(p: Parallelism) -> None:
    r, t, z = p.replicas, p.tensor_width, p.zero_stage
    assert p.data_parallel == (r > 1)
    assert p.tensor_parallel == (t > 1)
    assert p.expert_parallel == (p.expert_width > 1)
    # ZeRO shards over the replicas: on one replica nothing is sharded
    assert (p.shards_optimizer, p.shards_params) == (r > 1 and z >= 1, r > 1 and z == 3)
    assert p.meshed == (t > 1 or z == 3)
    assert (p.shards_grads, p.reduces_each_backward) == (r > 1 and z >= 2, r > 1 and z == 2)
    assert p.gradient_reductions(5) == (5 if r > 1 and z == 2 else 1)
    assert p.unsharded() == Parallelism(replicas=r, tensor_width=t, expert_width=p.expert_width)
    for floor in (0, 1, 2, 3):  # the higher ZeRO stage, on replicated stages only
        got = p.floored(floor)
        assert got.zero_stage == (max(z, floor) if r > 1 else z)
        assert (got.replicas, got.tensor_width, got.regather) == (r, t, p.regather)


def test_a_zero_floor_is_one_of_the_zero_stages() -> None:
    with pytest.raises(ValidationError, match=r"^zero floor must be 0, 1, 2 or 3, got 4$"):
        Parallelism(replicas=2).floored(4)


def test_the_named_layouts() -> None:
    fsdp = Parallelism(replicas=2, zero_stage=3, regather=True)
    assert fsdp.shards_params and fsdp.shards_optimizer and fsdp.meshed
    one = Parallelism(zero_stage=2)  # a plan may name 2 on one replica: nothing is sharded
    assert not one.shards_optimizer and not one.shards_params and not one.meshed
    tp = Parallelism(replicas=3, tensor_width=4)
    assert tp.meshed and tp.tensor_parallel and not tp.shards_optimizer


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"replicas": 0}, r"^replicas must be an integer >= 1, got 0$"),
        ({"replicas": 2.0}, r"^replicas must be an integer >= 1, got 2\.0$"),
        ({"zero_stage": 4}, r"^zero_stage must be 0, 1, 2 or 3, got 4$"),
        ({"tensor_width": 3}, r"^tensor_width must be a power of two >= 1, got 3$"),
        ({"tensor_width": True}, r"^tensor_width must be a power of two >= 1, got True$"),
        ({"zero_stage": 3}, r"^zero_stage 3 .* one replica \(replicas=1, tensor_width=1\)$"),
        ({"replicas": 2, "regather": 1}, r"^regather must be a bool, got 1$"),
        ({"replicas": 2, "zero_stage": 2, "regather": True},
         r"^regather applies to zero_stage 3 only, got zero_stage 2$"),
        ({"replicas": 3, "expert_width": 2},
         r"^expert_width must be a divisor >= 1 of its 3 replicas, got 2$"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_in_one_line_naming_them(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        Parallelism(**kw)


def test_a_stage_plan_carries_its_fields_as_one_checked_value() -> None:
    st = StagePlan(layers=(0, 2), devices=tuple(range(8)), tensor_width=2, zero_stage=3,
                   regather=True, expert_width=2)  # fmt: skip
    assert st.parallel == Parallelism(replicas=4, tensor_width=2, zero_stage=3, regather=True,
                                      expert_width=2)  # fmt: skip
    assert st.replicas == 4
    with pytest.raises(ValidationError, match=r"^stage \[0, 2\]: zero_stage 3 .* one replica"):
        StagePlan(layers=(0, 2), devices=(0, 1), tensor_width=2, zero_stage=3)


def test_the_plan_file_is_unchanged_and_old_files_load() -> None:
    """The value is built from the stage's fields: the file keeps its keys, a file without
    them loads with the defaults, and equality and hashing ignore the derived value."""
    old = {"planner": "manual", "global_batch_size": 4, "micro_batch_size": 2,
           "num_micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0, 1]},
           {"layers": [2, 4], "devices": [2, 3, 4, 5], "zero_stage": 3, "tensor_width": 2,
            "regather": True}]}  # fmt: skip
    plan = Plan.from_dict(json.loads(json.dumps(old)))
    assert plan.stages[0].parallel == Parallelism(replicas=2)
    assert plan.stages[1].parallel == Parallelism(replicas=2, tensor_width=2, zero_stage=3,
                                                  regather=True)  # fmt: skip
    d = plan.to_dict()
    assert [sorted(s) for s in d["stages"]] == [
        ["devices", "layers", "recompute"],
        ["devices", "layers", "recompute", "regather", "tensor_width", "zero_stage"],
    ]
    again = Plan.from_dict(d)
    assert again == plan and hash(again.stages[1]) == hash(plan.stages[1])
    assert "parallel" not in repr(plan.stages[1])
