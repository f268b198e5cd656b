"""Issue 47 (battery F, rows 10 and 20): ``dapple plan --schedule zbv|dualpipev`` and the plans
the V cannot cut. The V holds two chunks of at least one layer on each device group; the DAPPLE
planner plans for L, not for the V, and may give a group one layer. Too few layers for any V
are refused before the search; a planner's plan of a one-layer group is planned for on
balanced pipelines instead (:func:`dapple.planner.schedule_choice.best_under_schedule`); a
baseline's plan (the partition asked for) stays refused (``test_battery_47e``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import boom, make_cluster, make_profile, one_error_line
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan

V_SCHEDULES = ["zbv", "dualpipev"]


def _inputs(tmp_path: Path, layers: int, devices: int = 4) -> list[str]:
    prof, cl = tmp_path / "p.json", tmp_path / "c.json"
    make_profile(layers).save(prof)
    make_cluster(per_server=devices).save(cl)
    return ["--profile", str(prof), "--cluster", str(cl), "--global-batch-size", "8"]


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize(("layers", "devices"), [(3, 4), (1, 4), (6, 1)])
def test_too_few_layers_or_devices_for_a_v_is_refused_before_the_search(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    schedule: str,
    layers: int,
    devices: int,
) -> None:
    monkeypatch.setattr("dapple.cli.plan_cmd._plan_with_progress", boom)
    monkeypatch.setattr("dapple.planner.make_plan", boom)
    argv = ["plan", *_inputs(tmp_path, layers, devices), "--schedule", schedule]
    assert main(argv) == 2
    one_error_line(capsys, f"--schedule {schedule} cuts each of at least 2 device groups into 2",
                   "(N >= 4 layers, 2 devices)",
                   f"'toy' has N = {layers} layers and 'test' {devices} device(s)")  # fmt: skip


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_enough_layers_for_a_v_reach_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    """The check lets 4 layers on 4 devices through (the search is what then runs)."""

    class Searched(Exception):
        pass

    def search(*_: object, **__: object) -> Plan:
        raise Searched

    monkeypatch.setattr("dapple.cli.plan_cmd._plan_with_progress", search)
    with pytest.raises(Searched):
        main(["plan", *_inputs(tmp_path, 4), "--schedule", schedule])


def _one_layer_group() -> Plan:
    """The planner's kind of plan the V cannot cut: groups [0, 3), [3, 5), [5, 6), the last of
    one layer (the battery's 1:2:2:8 had [4, 5) alone)."""
    return straight_plan(6, [0, 3, 5], global_batch_size=8, num_micro_batches=4,
                         replicas=[2, 1, 1], model_name="toy", planner="dapple")  # fmt: skip


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_a_plan_the_v_cannot_cut_is_planned_on_balanced_pipelines(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    schedule: str,
) -> None:
    out = tmp_path / "v.json"
    monkeypatch.setattr("dapple.cli.plan_cmd._plan_with_progress",
                        lambda *_: _one_layer_group())  # fmt: skip
    argv = ["plan", *_inputs(tmp_path, 6), "--schedule", schedule, "-o", str(out)]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert f"--schedule {schedule} cannot run the dapple planner's plan (stages [0, 3), [3, 5), " \
        "[5, 6)" in " ".join(said.split())  # fmt: skip
    assert "stage 2 (devices [3]) has 1 layer(s) [5, 6]" in " ".join(said.split())
    assert "planned for it on balanced pipelines of every depth instead" in " ".join(said.split())
    got = Plan.load(out)
    assert got.schedule == schedule and got.virtual_stages == 2
    groups = {st.devices for st in got.stages}
    assert len(groups) >= 2 and len(got.stages) == 2 * len(groups)
    for g in groups:  # every group holds two chunks of at least one layer, six layers in all
        sizes = [st.layers[1] - st.layers[0] for st in got.stages if st.devices == g]
        assert len(sizes) == 2 and min(sizes) >= 1, (g, sizes)
    assert sum(st.layers[1] - st.layers[0] for st in got.stages) == 6


def test_best_under_schedule_cuts_a_v_the_planners_plan_could_not_hold() -> None:
    from dapple.errors import ValidationError
    from dapple.planner.schedule_choice import best_under_schedule
    from dapple.simulate.plan_variants import with_schedule

    prof, cl = make_profile(6), make_cluster(per_server=4)
    with pytest.raises(ValidationError, match="has 1 layer"):
        with_schedule(_one_layer_group(), "zbv")
    choice = best_under_schedule(_one_layer_group(), "zbv", prof, cl)
    assert choice.plan is not None and choice.result is not None, choice.note
    assert choice.label == "zbv" and choice.plan.schedule == "zbv"
    assert choice.result.step_ms > 0 and choice.plan.predicted_step_ms > 0
    with_schedule(choice.plan, "zbv")  # a V again from its own groups: each holds two layers


def test_the_api_refuses_a_v_of_too_few_layers_before_the_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dapple import api
    from dapple.errors import ValidationError
    from dapple.planner.plan_config import PlanConfig

    monkeypatch.setattr("dapple.planner.make_plan", boom)
    cfg = PlanConfig(profile=make_profile(3), cluster=make_cluster(), schedule="zbv",
                     global_batch_size=8)  # fmt: skip
    with pytest.raises(ValidationError, match=r"'toy' has N = 3 layers and 'test' 4 device"):
        api.plan(cfg)


@pytest.mark.parametrize(("planner", "planned"), [("dapple", True), ("straight", False)])
def test_the_api_plans_a_v_the_dapple_planners_plan_cannot_hold(
    monkeypatch: pytest.MonkeyPatch, planner: str, planned: bool
) -> None:
    """The DAPPLE planner's plan goes to balanced pipelines; a baseline's stays refused."""
    import dataclasses

    from dapple import api
    from dapple.errors import ValidationError
    from dapple.planner.plan_config import PlanConfig
    from dapple.planner.registry import PLANNERS

    spec = PLANNERS[planner]
    if not spec.is_search:  # a baseline's rule
        monkeypatch.setitem(PLANNERS, planner, dataclasses.replace(spec, rule=lambda *_: (
            dataclasses.replace(_one_layer_group(), planner=planner))))  # fmt: skip
    monkeypatch.setattr("dapple.planner.dapple_search", lambda *_, **__: _one_layer_group())
    cfg = PlanConfig(profile=make_profile(6), cluster=make_cluster(), schedule="dualpipev",
                     global_batch_size=8, planner=planner)  # fmt: skip
    if not planned:
        with pytest.raises(ValidationError, match="has 1 layer"):
            api.plan(cfg)
        return
    got = api.plan(cfg)
    assert got.schedule == "dualpipev" and got.virtual_stages == 2 and got.predicted_step_ms > 0
