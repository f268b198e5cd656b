"""``dapple plan --interleave`` (``interleave`` of ``[planning]`` and :func:`dapple.api.plan`):
the switch reaches :func:`dapple.planner.make_plan`, refuses what it cannot mean, and an
interleaved plan - the dapple planner's or the grid planner's - is printed and saved through its
schedule's own step rule and replayed memory, never the paper's L."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dapple import api
from dapple.cli import main
from dapple.cli._plan_show import schedule_stage_table, stage_table
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.planner.plan_config import PlanConfig, dump_plan_config, load_plan_config
from dapple.profiler.paper_models import load_profile
from test_grid_interleaved import _cluster
from test_grid_interleaved import _llm as _grid_llm

B = 8
"""The global batch of the hand-made case: 6 blocks on one server of 8 (tests/
test_grid_interleaved.py) and a head of 0.5 ms per sample, where interleaved 1F1B beats every
1F1B plan by L (130.33 against 136.21 ms, each equal to its simulated step)."""


def _llm() -> ModelProfile:
    """test_grid_interleaved's hand-made LLM with a 0.5 ms head."""
    return _grid_llm(head_fwd=0.5)


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    """The hand-made profile and cluster as files, as ``dapple plan`` reads them."""
    _llm().save(tmp_path / "llm.json")
    _cluster().save(tmp_path / "cluster.json")
    return str(tmp_path / "llm.json"), str(tmp_path / "cluster.json")


def _argv(files: tuple[str, str], *more: str) -> list[str]:
    profile, cluster = files
    return [
        "plan",
        "--profile",
        profile,
        "--cluster",
        cluster,
        "--global-batch-size",
        str(B),
        *more,
    ]


# -- the switch ---------------------------------------------------------------------------------


def test_the_switch_makes_the_plan_interleaved_and_the_default_does_not() -> None:
    prof, cluster = _llm(), _cluster()
    flat = make_plan(prof, cluster, B)
    plan = make_plan(prof, cluster, B, interleave=True)
    assert flat.schedule == "dapple" and flat.virtual_stages == 1
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2
    assert plan.predicted_step_ms < flat.predicted_step_ms
    assert plan.predicted_step_ms == pytest.approx(schedule_latency(plan, prof, cluster))
    assert max(device_memory_by_group(plan, prof)) <= cluster.usable_memory_bytes


def test_cli_prints_and_saves_the_interleaved_plan(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main([*_argv(files, "--interleave", "-o", str(out))]) == 0
    printed = capsys.readouterr().out
    plan = Plan.load(out)
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2 and plan.planner == "dapple"
    assert plan == make_plan(_llm(), _cluster(), B, interleave=True)
    step_ms = schedule_latency(plan, _llm(), _cluster())
    assert f"predicted step L = {step_ms:.2f} ms (the interleaved 1F1B (v=2) step rule)" in printed
    assert f"on P = {plan.num_groups} device groups (v = 2)" in printed
    assert "group memory GiB" in printed and "pivot Q" not in printed
    assert main(_argv(files)) == 0  # without the switch: the paper's 1F1B plan and its L
    printed = capsys.readouterr().out
    assert "schedule dapple policy" in printed and "pivot Q" in printed


def test_the_api_and_the_config_file_reach_the_same_plan(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile, cluster = files
    out = tmp_path / "cli.json"
    assert main([*_argv(files, "--interleave", "-o", str(out))]) == 0
    ours = api.plan(profile, cluster, B, interleave=True)
    assert ours == Plan.load(out) and ours.schedule == "interleaved"
    toml = tmp_path / "plan.toml"
    toml.write_text(
        f'[planning]\nprofile = "{profile}"\ncluster = "{cluster}"\n'
        f'global_batch_size = {B}\ninterleave = true\noutput = "{tmp_path / "file.json"}"\n'
    )
    assert load_plan_config(toml).interleave is True
    assert main(["plan", "--config", str(toml)]) == 0
    assert Plan.load(tmp_path / "file.json") == ours
    capsys.readouterr()
    assert main(["plan", "--config", str(toml), "--print-config"]) == 0
    assert "interleave = true" in capsys.readouterr().out
    assert "interleave = false" in dump_plan_config(PlanConfig())


# -- what it refuses, before any compute --------------------------------------------------------


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (("--schedule", "zbh1"), "--interleave searches the schedule, --schedule zbh1 fixes it"),
        (("--schedule", "best"), "--interleave searches the schedule, --schedule best fixes it"),
        (("--planner", "straight"), "searched by the dapple planner only, not 'straight'"),
        (("--planner", "grid"), "searched by the dapple planner only, not 'grid'"),
    ],
)
def test_cli_refuses_in_one_line(
    files: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    more: tuple[str, ...],
    message: str,
) -> None:
    assert main([*_argv(files, "--interleave", *more)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_api_refuses_what_the_cli_refuses(tmp_path: Path) -> None:
    prof, cluster = _llm(), _cluster()
    with pytest.raises(ValidationError, match="interleave searches the schedule, schedule dapple"):
        api.plan(prof, cluster, B, schedule="dapple", interleave=True)
    with pytest.raises(ValidationError, match="dapple planner only, not 'gpipe'"):
        api.plan(prof, cluster, B, planner="gpipe", interleave=True)
    shared = dataclasses.replace(cluster, compute_cores_per_server=8)
    with pytest.raises(ValidationError, match="has host terms"):
        make_plan(prof, shared, B, interleave=True)
    with pytest.raises(ValidationError, match="interleave must be true or false, got 'yes'"):
        PlanConfig(interleave="yes")  # type: ignore[arg-type]
    (tmp_path / "bad.toml").write_text('[planning]\ninterleave = "yes"\n')
    with pytest.raises(ValidationError, match="interleave"):
        load_plan_config(tmp_path / "bad.toml")


# -- an interleaved plan printed, compared and re-scheduled --------------------------------------


def test_the_grid_planner_picking_an_interleaved_point_prints_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BERT-48 on paper-a at G = 128: the grid's best is interleaved (it crashed the printout
    when the plan was costed by L, which has no in-flight counts for it)."""
    out = tmp_path / "grid.json"
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a"]
    assert main([*argv, "--global-batch-size", "128", "--planner", "grid", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.load(out)
    assert plan.schedule == "interleaved"
    step_ms = schedule_latency(plan, load_profile("paper:bert48"), load_cluster("paper-a"))
    assert plan.predicted_step_ms == pytest.approx(step_ms)
    assert f"predicted step L = {step_ms:.2f} ms (the interleaved 1F1B" in printed


def test_an_interleaved_plan_under_a_schedule_costed_by_L_joins_its_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--planner grid --schedule dapple``: each device group's chunks become one stage."""
    out = tmp_path / "joined.json"
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--planner", "grid"]
    assert main([*argv, "--global-batch-size", "128", "--schedule", "dapple", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    grid = make_plan(load_profile("paper:bert48"), load_cluster("paper-a"), 128, "grid")
    assert (plan.schedule, plan.virtual_stages, plan.num_stages) == ("dapple", 1, grid.num_groups)
    sizes = [sum(s.layers[1] - s.layers[0] for s in grid.stages[g :: grid.num_groups])
             for g in range(grid.num_groups)]  # fmt: skip
    assert [s.layers[1] - s.layers[0] for s in plan.stages] == sizes
    L = pipeline_latency(plan, load_profile("paper:bert48"), load_cluster("paper-a")).L_ms
    assert plan.predicted_step_ms == L


def test_compare_plans_the_dapple_row_interleaved(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare.json"
    assert main([*_argv(files, "--compare", "--interleave", "-o", str(out))]) == 0
    printed = capsys.readouterr().out
    dapple_row = next(line for line in printed.splitlines() if "│ dapple " in line)
    assert "interleaved/A" in dapple_row
    assert Plan.load(out) == make_plan(_llm(), _cluster(), B, interleave=True)


def test_schedule_stage_table_rows_are_the_schedule_terms() -> None:
    """One row per virtual stage, its device group k mod P, the group's replayed memory; L's
    table refuses the interleaved plan, which is why the step-rule table exists."""
    prof, cluster = _llm(), _cluster()
    plan = make_plan(prof, cluster, B, interleave=True)
    table = schedule_stage_table(plan, prof, cluster)
    cols = {c.header: list(c.cells) for c in table.columns}
    P = plan.num_groups
    assert cols["group"] == [str(k % P) for k in range(plan.num_stages)]
    memory = device_memory_by_group(plan, prof)
    assert cols["group memory GiB"] == [
        f"{memory[k % P] / 2**30:.2f}" for k in range(plan.num_stages)
    ]
    assert cols["comm ms"][-1] == "-"
    with pytest.raises(ValidationError, match="no per-stage in-flight counts"):
        stage_table(plan, prof, cluster)
