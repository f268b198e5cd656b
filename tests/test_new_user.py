"""What a new user following the README meets (issue 47, item 9): ``--zero-stage auto`` leaves a
stage unsharded where it fits, the zoo transformer's TP plan, elastic and SIGTERM wording,
``generate``'s cut prompts, step ETAs, TP plans drawn per device and the prediction's basis."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from builders import make_cluster, make_profile
from dapple.cli import main
from dapple.core.plan import Plan, StagePlan
from dapple.errors import ValidationError
from dapple.planner.evaluate import ZERO_AUTO
from dapple.planner.search import dapple_search


def _with_update(u: float):
    """The test profile with a measured optimizer update of ``u`` ms per parameter byte, which
    ZeRO divides by r_s: by L alone a sharded stage is then always faster."""
    p = make_profile(params=10**6)
    return dataclasses.replace(p, update_ms_per_parameter_byte=u)


def test_auto_leaves_a_stage_unsharded_where_it_fits() -> None:
    profile, cluster = _with_update(1e-6), make_cluster()
    sharded = dapple_search(profile, cluster, 8, zero_stage=1)
    assert any(st.zero_stage == 1 for st in sharded.stages)  # ZeRO-1's 1/r update is cheaper
    auto = dapple_search(profile, cluster, 8, zero_stage=ZERO_AUTO)
    assert any(st.replicas > 1 for st in auto.stages)
    assert all(st.zero_stage == 0 for st in auto.stages)
    assert sharded.predicted_step_ms < auto.predicted_step_ms  # so L alone would have sharded


def test_auto_still_shards_where_memory_asks() -> None:
    profile = _with_update(1e-6)
    profile = dataclasses.replace(
        profile,
        layers=tuple(dataclasses.replace(x, parameter_bytes=10**8) for x in profile.layers),
    )
    tight = dataclasses.replace(make_cluster(), device_memory_bytes=int(2.15e9))
    plan = dapple_search(profile, tight, 8, max_stages=1, zero_stage=ZERO_AUTO)
    assert plan.stages[0].replicas > 1 and plan.stages[0].zero_stage in (1, 2)


# -- item 2: the zoo transformer's TP plan ----------------------------------------------------
_TINY = ["--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "seq=16",
         "--set", "vocab=64"]  # fmt: skip


def _tp2_plan(path: Path) -> Path:
    plan = Plan(planner="manual", global_batch_size=4, micro_batch_size=2, num_micro_batches=2,
                stages=(StagePlan(layers=(0, 4), devices=(0, 1), tensor_width=2),))  # fmt: skip
    plan.save(path)
    return path


def test_transformer_tp_has_the_zoo_transformers_plan_and_weights() -> None:
    import dapple.api as dp
    from dapple.models.tp_plan import TRANSFORMER_TP_PLAN
    from dapple.runtime.tensor_check import check_tensor_run

    sizes = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64}
    tp, plain = dp.load("transformer-tp", **sizes), dp.load("transformer", **sizes)
    assert dict(tp.tp_plan) == dict(TRANSFORMER_TP_PLAN)
    plan = Plan.from_dict(_tp2_plan_dict())
    check_tensor_run(plan, tp)  # runs
    with pytest.raises(ValidationError, match="no TP plan"):
        check_tensor_run(plan, plain)
    # the same parameter shapes, batches and loss as -m transformer
    a = [tuple(x.shape) for x in tp.build_stage(0, 4, 3).parameters()]
    b = [tuple(x.shape) for x in plain.build_stage(0, 4, 3).parameters()]
    assert sorted(a) == sorted(b)
    x, y = tp.make_batch(2, 5), plain.make_batch(2, 5)
    assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    assert tp.loss_fn is plain.loss_fn


def _tp2_plan_dict() -> dict:
    stages = [StagePlan(layers=(0, 4), devices=(0, 1), tensor_width=2)]
    return Plan(planner="manual", global_batch_size=4, micro_batch_size=2, num_micro_batches=2,
                stages=tuple(stages)).to_dict()  # fmt: skip


@pytest.mark.slow
def test_verify_a_tp2_plan_of_transformer_tp_equals_one_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's claim from the CLI: 2 gloo ranks, one stage cut over a tensor group of 2."""
    plan = _tp2_plan(tmp_path / "tp2.json")
    args = ["verify", "--plan", str(plan), *_TINY, "--steps", "2", "--device", "cpu"]
    assert main([*args, "-m", "transformer"]) == 2  # untraced: refused in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no TP plan" in err[0] and "transformer-tp" in err[0], err
    assert main([*args, "-m", "transformer-tp"]) == 0
    out = capsys.readouterr().out
    assert "OK: largest gradient difference" in out
