"""A plan records the :class:`PlanConfig` it was made with (issue 42, item 1): its options in
``planned_with`` (:func:`options_of`), its G and lengths in its own fields, so that
:func:`config_of` gives back the configuration - every option of it - and ``--print-config``
prints it as ``dapple plan --print-config`` printed the request."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from builders import make_cluster, make_profile
from dapple.api.planning import plan
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.core.planning_options import PlanningOptions
from dapple.errors import ValidationError
from dapple.planner.plan_config import PlanConfig, config_of, dump_plan_config, options_of

INPUTS = {"profile", "cluster", "servers", "output"}
"""What names the inputs and the output file: a plan records no file names."""
OWN = {"global_batch_size", "mean_seq_len", "max_seq_len"}
"""What a plan records in its own fields."""


def test_every_plan_config_field_is_recorded_by_a_plan_or_names_an_input() -> None:
    recorded = {f.name for f in dataclasses.fields(PlanningOptions)}
    asked = {f.name for f in dataclasses.fields(PlanConfig)}
    assert asked == recorded | OWN | INPUTS
    assert not recorded & (OWN | INPUTS)


def test_config_of_gives_back_every_option_the_plan_was_made_with() -> None:
    cfg = PlanConfig(
        profile="p.json", cluster="c.json", servers=2, global_batch_size=8, planner="dapple",
        mean_seq_len=512.0, max_seq_len=1024.0, schedule="interleaved", virtual_stages=2,
        zero_stage=3, tensor_widths=(1, 2), interleave=False, on_nonfinite="off",
        output="plan.json",
    )  # fmt: skip
    made = dataclasses.replace(
        straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2),
        mean_seq_len=512.0, max_seq_len=1024.0, planned_with=options_of(cfg),
    )  # fmt: skip
    read = Plan.from_dict(json.loads(json.dumps(made.to_dict())))  # through a plan file
    assert read.planned_with == options_of(cfg)
    got = config_of(read, profile="p.json", cluster="c.json", servers=2, output="plan.json")
    assert got == cfg
    assert dump_plan_config(got) == dump_plan_config(cfg)
    # the planner's own choice of schedule (and the guard's step point) is left out of the
    # file, as earlier versions wrote it
    searched = dataclasses.replace(cfg, schedule=None, virtual_stages=1, on_nonfinite="stop")
    assert set(options_of(searched).to_dict()) == {"planner", "zero_stage", "tensor_widths",
                                                   "interleave"}  # fmt: skip
    assert config_of(Plan.from_dict(dataclasses.replace(
        made, planned_with=options_of(searched)).to_dict())) == dataclasses.replace(
        searched, profile=None, cluster=None, servers=None, output=None)  # fmt: skip


def test_a_plan_without_recorded_options_has_no_config() -> None:
    with pytest.raises(ValidationError, match="records no planning options"):
        config_of(straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2))


def test_recorded_schedule_options_are_checked() -> None:
    with pytest.raises(ValidationError, match="schedule must be a name or null, got 3"):
        PlanningOptions.from_dict({"schedule": 3})
    with pytest.raises(ValidationError, match="virtual_stages must be an integer >= 1, got 0"):
        PlanningOptions.from_dict({"virtual_stages": 0})


@pytest.mark.parametrize("schedule", ["gpipe", "zbh1", "best"])
def test_the_api_and_the_cli_record_the_schedule_asked_for(tmp_path: Path, schedule: str) -> None:
    """``dapple plan --schedule S -o FILE`` and ``api.plan(..., schedule=S)`` write S into
    ``planned_with`` (an elastic re-plan puts its plan under S again); before, the file
    recorded the search options alone."""
    prof, cl = tmp_path / "p.json", tmp_path / "c.json"
    make_profile(6).save(prof)
    make_cluster(per_server=4).save(cl)
    out = tmp_path / "cli.json"
    argv = ["plan", "--profile", str(prof), "--cluster", str(cl), "--global-batch-size", "8"]
    assert main([*argv, "--schedule", schedule, "-o", str(out)]) == 0
    want = PlanningOptions(schedule=schedule)
    assert Plan.load(out).planned_with == want
    made = plan(str(prof), str(cl), 8, schedule=schedule, output=tmp_path / "api.json")
    assert made.planned_with == want and Plan.load(tmp_path / "api.json").planned_with == want
    cfg = config_of(made, profile=str(prof), cluster=str(cl))
    assert cfg == PlanConfig(profile=str(prof), cluster=str(cl), global_batch_size=8,
                             schedule=schedule)  # fmt: skip
