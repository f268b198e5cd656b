"""Schedules as plug-ins: the registry's rules, and a toy schedule defined in this file that is
planned, compared, simulated, lowered and run on 2 processes without touching ``src/``.

The toy is GPipe with its backwards in reverse micro-batch order (last in, first out): valid
(every stage reverses alike, so B_m still finds B_m done downstream), distinct from every
built-in order, and costed by the paper's L with K_i = M like GPipe. It joins the registry only
inside the ``lifo`` fixture; a plan under it records this module (``schedule_module``), which is
how the spawned workers of the 2-process run find it: loading the plan imports this module and
registers its ``SCHEDULE``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from builders import make_cluster, make_profile
from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.planner.schedule_choice import (
    SCHEDULE_VARIANTS,
    best_per_schedule,
    best_schedule,
    schedule_variants,
)
from dapple.planner.scorer import Scorer
from dapple.schedule import (
    Action,
    ActionKind,
    ComputeOrder,
    ScheduleSpec,
    Shape,
    builtin_schedules,
    check_virtual_stages,
    compute_order,
    format_actions,
    get_schedule,
    in_flight_counts,
    load_schedule,
    lower,
    plan_compute_order,
    register,
    registered,
    schedule_names,
    unregister,
    validate,
    validate_compute_order,
)
from dapple.simulate import simulate
from dapple.simulate.plan_variants import baseline_first, compared_plan, with_schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
NAME = "gpipe-lifo"


def lifo_order(shape: Shape) -> ComputeOrder:
    """All M forwards, then the M backwards last micro-batch first."""
    return {
        i: [Action(i, F, m) for m in range(shape.M)]
        + [Action(i, B, m) for m in reversed(range(shape.M))]
        for i in range(shape.P)
    }


SCHEDULE = ScheduleSpec(
    name=NAME,
    title="GPipe, backwards last in first out",
    order=lifo_order,
    in_flight=lambda shape: [shape.M] * shape.P,
)
"""The toy; its module (``module``) is this file's, as the generator's."""


@pytest.fixture
def lifo() -> Iterator[ScheduleSpec]:
    with registered(SCHEDULE) as spec:
        yield spec
    assert NAME not in schedule_names()


def _plan(M: int = 4, gbs: int = 8, n: int = 4) -> Plan:
    return straight_plan(n, [0, n // 2], global_batch_size=gbs, num_micro_batches=M)


# --------------------------------------------------------------------------- the registry


def test_builtins_in_order_with_their_needs() -> None:
    assert schedule_names()[:4] == ("gpipe", "dapple", "interleaved", "zbh1")
    needs = {
        s: (
            get_schedule(s).split_backward,
            get_schedule(s).chunks,
            get_schedule(s).uses_pipeline_latency,
        )
        for s in ("gpipe", "dapple", "interleaved", "zbh1")
    }
    assert needs == {
        "gpipe": (False, False, True),
        "dapple": (False, False, True),
        "interleaved": (False, True, False),
        "zbh1": (True, False, False),
    }
    assert schedule_variants() == SCHEDULE_VARIANTS == schedule_variants(builtin_schedules())
    assert get_schedule("dapple").label_of("B", 1) == "dapple/B"
    assert get_schedule("interleaved").title_of(interleave_plan()) == "interleaved 1F1B (v=2)"
    assert get_schedule("gpipe").module == "dapple.schedule.fill_drain"


def interleave_plan() -> Plan:
    return with_schedule(_plan(), "interleaved", 2)


def test_lookup_and_registration_errors() -> None:
    with pytest.raises(ValidationError, match="unknown schedule 'zz'; choose one of gpipe, dap"):
        get_schedule("zz")
    clash = dataclasses.replace(SCHEDULE, name="dapple")
    with pytest.raises(ValidationError, match="'dapple' is already registered by module 'dapp"):
        register(clash)
    with pytest.raises(ValidationError, match="schedule 'gpipe' is built in"):
        unregister("gpipe")
    unregister("never-registered")  # no-op
    with registered(SCHEDULE):
        register(SCHEDULE)  # the same spec again (its module imported anew): fine
        with pytest.raises(ValidationError, match="already registered by module"):
            register(dataclasses.replace(SCHEDULE, module="elsewhere"))
    assert NAME not in schedule_names()
    try:
        assert load_schedule(lifo_order.__module__) is SCHEDULE and NAME in schedule_names()
    finally:
        unregister(NAME)


def test_environment_names_schedule_modules(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dapple.schedule import registry

    monkeypatch.setattr(registry, "_env_loaded", False)
    monkeypatch.setenv(registry.ENV_SCHEDULES, f" {lifo_order.__module__} ,no.such.module")
    try:
        with caplog.at_level("WARNING", logger="dapple.schedule.registry"):
            assert get_schedule(NAME) is SCHEDULE  # loaded on the first lookup
        assert "'no.such.module' cannot be imported: " in caplog.text  # left out, logged
        assert schedule_names()[-1] == NAME
    finally:
        unregister(NAME)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"name": "Bad Name"}, "lower case letters"),
        ({"in_flight": None}, "give in_flight"),
        ({"policies": ("C",)}, "policies must be some of"),
        ({"variants": (("A", 2),)}, r"v > 1 only with chunks"),
        ({"variants": (("B", 1),)}, "needs a policy of"),
        ({"title": "{stage}"}, "may use only"),
    ],
)
def test_spec_refuses_what_no_caller_could_use(kw: dict[str, object], match: str) -> None:
    fields = {"name": NAME, "title": "t", "order": lifo_order, "in_flight": SCHEDULE.in_flight}
    with pytest.raises(ValidationError, match=match):
        ScheduleSpec(**{**fields, **kw})  # type: ignore[arg-type]


def test_one_virtual_stages_rule_two_spellings() -> None:
    check_virtual_stages(1, None)
    check_virtual_stages(4, "interleaved", cli=True)
    with pytest.raises(
        ValidationError,
        match=r"^virtual_stages=2 needs schedule='interleaved', 'zbv' or 'dualpipev'$",
    ):
        check_virtual_stages(2, None)
    with pytest.raises(ValidationError, match=r"^virtual_stages=3 needs schedule='interleaved'$"):
        check_virtual_stages(3, None)  # ZB-V and DualPipeV take exactly 2
    with pytest.raises(
        ValidationError,
        match=r"^--virtual-stages 2 needs --schedule interleaved, zbv or dualpipev, got 'zbh1'$",
    ):
        check_virtual_stages(2, "zbh1", cli=True)
    with pytest.raises(ValidationError, match="unknown schedule 'zz'"):
        check_virtual_stages(2, "zz")
    with pytest.raises(ValidationError, match="plan: virtual_stages=2 needs schedule='interl"):
        dataclasses.replace(_plan(), virtual_stages=2)


def test_in_flight_counts_name_the_schedules_that_have_them(lifo: ScheduleSpec) -> None:
    assert in_flight_counts(NAME, 3, 5) == [5, 5, 5] == in_flight_counts("gpipe", 3, 5)
    with pytest.raises(
        ValidationError,
        match="for schedule 'interleaved'; choose 'dapple', 'gpipe', 'gpipe-lifo' or 'zbh1'",
    ):
        in_flight_counts("interleaved", 2, 4)


# --------------------------------------------------------------------------- plan files


def test_plan_file_records_a_plugin_module_and_loading_it_registers_it(lifo: ScheduleSpec) -> None:
    plan = dataclasses.replace(_plan(), schedule=NAME)
    d = plan.to_dict()
    assert (d["schedule"], d["schedule_module"]) == (NAME, lifo_order.__module__)
    unregister(NAME)
    try:
        assert Plan.from_dict(json.loads(json.dumps(d))) == plan  # imports this module
        assert get_schedule(NAME) is SCHEDULE
    finally:
        unregister(NAME)
    register(SCHEDULE)  # for the fixture's exit
    for bad, match in (
        ("no.such.module", "schedule module 'no.such.module' cannot be imported"),
        ("json", "schedule module 'json' defines no SCHEDULE"),
    ):
        with pytest.raises(ValidationError, match=match):
            Plan.from_dict({**d, "schedule_module": bad})


def test_builtin_plan_files_old_and_new_load_unchanged() -> None:
    old = {  # a plan file as written before the registry: no schedule_module
        "schema_version": 1,
        "planner": "dapple",
        "global_batch_size": 8,
        "num_micro_batches": 4,
        "schedule": "zbh1",
        "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [1]}],
    }
    plan = Plan.from_dict(old)
    assert plan.schedule == "zbh1" and "schedule_module" not in plan.to_dict()
    assert Plan.from_dict(plan.to_dict()) == plan
    inter = interleave_plan()
    assert Plan.from_dict(inter.to_dict()) == inter
    with pytest.raises(ValidationError, match="plan: schedule must be one of gpipe, dapple"):
        Plan.from_dict({**old, "schedule": NAME})  # not registered, no module recorded


# --------------------------------------------------------------------------- the toy, end to end


def test_toy_generates_validates_and_lowers(lifo: ScheduleSpec) -> None:
    order = compute_order(NAME, 2, 3)
    assert {g: format_actions(a) for g, a in order.items()} == {
        0: "0F0 0F1 0F2 0B2 0B1 0B0",
        1: "1F0 1F1 1F2 1B2 1B1 1B0",
    }
    validate_compute_order(order, 2, 3)
    plan = dataclasses.replace(_plan(M=3, gbs=6), schedule=NAME)
    assert plan_compute_order(plan) == order
    sched = lower(plan)
    validate(sched, plan)
    assert format_actions(sched[1]) == (
        "1.0RECV_F0@0 1F0 1.0RECV_F1@0 1F1 1.0RECV_F2@0 1F2 1B2 1.0SEND_B2@0 1B1 1.0SEND_B1@0 "
        "1B0 1.0SEND_B0@0 1AGREE 1OPT"
    )
    with pytest.raises(ValidationError, match="virtual_stages=2 needs schedule='interleaved'"):
        compute_order(NAME, 2, 4, v=2)


def test_toy_is_scored_planned_costed_and_simulated(lifo: ScheduleSpec) -> None:
    prof, cluster = make_profile(8), make_cluster()
    sc = Scorer(prof, cluster, 16)
    stages = [(0, 4, (0,)), (4, 8, (1,))]
    toy = sc.score(stages, 4, schedule=NAME)
    gp = sc.score(stages, 4, schedule="gpipe")
    assert toy is not None and gp is not None
    assert (toy.schedule, toy.L_ms, toy.max_in_flight) == (NAME, gp.L_ms, gp.max_in_flight)
    with pytest.raises(ValidationError, match="'zbh1' has a step rule of its own"):
        sc.score(stages, 4, schedule="zbh1")

    planned = api.plan(prof, cluster, 16, schedule=NAME)
    assert planned.schedule == NAME and planned.predicted_step_ms > 0
    assert simulate(planned, prof, cluster).L_ms == pytest.approx(planned.predicted_step_ms)

    two = dataclasses.replace(_plan(M=4, gbs=16, n=8), schedule=NAME)
    sim = simulate(two, prof, cluster)
    gpipe_sim = simulate(with_schedule(two, "gpipe"), prof, cluster)
    assert sim.schedule == NAME and sim.L_ms == gpipe_sim.L_ms  # L with K_i = M, as GPipe
    assert [str(e.action) for e in sim.events] != [str(e.action) for e in gpipe_sim.events]
    assert compared_plan(two).schedule == "dapple"  # compared with the default schedule
    runs = baseline_first([("toy", sim), ("gpipe", gpipe_sim)])
    assert [name for name, _ in runs] == ["gpipe", "toy"]  # the paper's baseline on top


def test_toy_joins_the_schedule_comparison_and_best(lifo: ScheduleSpec) -> None:
    prof, cluster = make_profile(8), make_cluster()
    base = straight_plan(8, [0, 4, 6], global_batch_size=12, num_micro_batches=3)
    choices = best_per_schedule([base], prof, cluster)
    labels = [c.label for c in choices]
    assert labels[-1] == NAME and len(labels) == len(SCHEDULE_VARIANTS) + 1
    toy = choices[-1]
    assert toy.plan is not None and toy.plan.schedule == NAME and toy.result is not None
    assert toy.result.step_ms == pytest.approx(simulate(toy.plan, prof, cluster).step_ms)
    chosen, every = best_schedule(base, prof, cluster)
    assert NAME in [c.label for c in every] and chosen.plan is not None


def test_cli_offers_and_runs_the_toy(lifo: ScheduleSpec, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    prof, cluster = tmp_path / "p.json", tmp_path / "c.json"
    make_profile(8).save(prof)
    make_cluster().save(cluster)
    out = tmp_path / "plan.json"
    common = ["--profile", str(prof), "--cluster", str(cluster)]
    assert (
        main(["plan", *common, "--global-batch-size", "16", "--schedule", NAME, "-o", str(out)])
        == 0
    )
    assert json.loads(out.read_text())["schedule_module"] == lifo_order.__module__
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out), *common, "--other-schedule"]) == 0
    text = capsys.readouterr().out
    assert "GPipe, backwards last in first out" in text and "DAPPLE (policy A)" in text


@pytest.mark.slow
def test_toy_trains_on_two_processes_like_one(lifo: ScheduleSpec) -> None:
    """Two gloo workers spawned fresh: each loads the plan, whose ``schedule_module`` brings
    the toy into its registry; 3 steps of SGD with momentum equal one process's, parameter
    by parameter."""
    wl = api.load("transformer", layers=2, hidden=16, heads=2, seq=8)
    n = wl.num_layers
    plan = dataclasses.replace(
        straight_plan(n, [0, n // 2], global_batch_size=8, num_micro_batches=4), schedule=NAME
    )
    report = api.verify(plan, wl, 3, device="cpu", momentum=0.9)
    assert report.plan.schedule == NAME
    assert report.ok, report.max_abs_diff
    assert report.grad_norms_ok, (report.grad_norms, report.reference_grad_norms)
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
