"""Schedule names on ``plan``/``simulate`` and the best plan per schedule (simulated)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from builders import make_cluster, make_profile
from dapple.cli import main
from dapple.core.layer_profile import AffineTime
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.planner.schedule_choice import (
    SCHEDULE_VARIANTS,
    ScheduleChoice,
    best_per_schedule,
    refine_cuts,
)
from dapple.simulate import simulate
from dapple.simulate.plan_variants import unchunked, with_schedule


def _base(reps=(2, 1, 1), cuts=(0, 4, 6), n=8, M=4, gbs=16) -> Plan:
    return straight_plan(
        n, list(cuts), global_batch_size=gbs, num_micro_batches=M, replicas=list(reps)
    )


def test_with_schedule_round_trips_through_interleaving():
    base = _base()
    inter = with_schedule(_base(cuts=(0, 4, 6), M=3, gbs=12), "interleaved", 2)
    assert inter.virtual_stages == 2 and inter.num_stages == 6
    assert [st.layers[1] - st.layers[0] for st in inter.stages] == [2, 1, 1, 2, 1, 1]
    back = with_schedule(inter, "zbh1")
    assert back.schedule == "zbh1" and back.stages == _base(M=3, gbs=12).stages
    assert with_schedule(base, "gpipe").stages == base.stages
    with pytest.raises(ValidationError, match="M=4 to be a multiple of the 3 device groups"):
        with_schedule(base, "interleaved", 2)
    with pytest.raises(ValidationError, match="v=4 chunks do not divide the 2 layers"):
        with_schedule(_base(M=3, gbs=12), "interleaved", 4)
    with pytest.raises(ValidationError, match="virtual_stages=2 needs schedule='interleaved'"):
        with_schedule(base, "zbh1", 2)
    with pytest.raises(ValidationError, match="unknown schedule 'zigzag'"):
        with_schedule(base, "zigzag")


def test_best_per_schedule_simulates_every_variant():
    prof, cluster = make_profile(8), make_cluster()
    choices = best_per_schedule([_base(M=3, gbs=12)], prof, cluster)
    assert [c.label for c in choices] == [
        "gpipe",
        "dapple/A",
        "dapple/B",
        "interleaved v=2",
        "interleaved v=4",
        "zbh1",
        "zbv",
        "dualpipev",
    ]
    assert len(choices) == len(SCHEDULE_VARIANTS)
    by = {c.label: c for c in choices}
    for c in choices:
        if c.plan is None:
            continue
        assert c.result is not None
        assert simulate(c.plan, prof, cluster).step_ms == pytest.approx(c.result.step_ms)
        assert c.result.peak_memory_bytes <= cluster.usable_memory_bytes
    inter = by["interleaved v=2"].plan
    assert inter is not None and inter.num_micro_batches % inter.num_groups == 0
    # 4 + 2 + 2 layers: no group holds a multiple of 4, and moving the cuts to multiples of 4
    # leaves a group empty
    assert by["interleaved v=4"].plan is None and "v=4" in by["interleaved v=4"].note
    zb, one_f_one_b = by["zbh1"].result, by["dapple/A"].result
    assert zb is not None and one_f_one_b is not None
    assert zb.step_ms <= one_f_one_b.step_ms + 1e-9


def test_cli_schedule_names(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    prof = tmp_path / "p.json"
    make_profile(8).save(prof)
    plan_path = tmp_path / "plan.json"
    cluster = tmp_path / "c.json"
    make_cluster().save(cluster)
    common = ["--profile", str(prof), "--cluster", str(cluster), "--global-batch-size", "16"]
    assert main(["plan", *common, "--schedule", "zbh1", "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "simulated only" not in out
    assert json.loads(plan_path.read_text())["schedule"] == "zbh1"
    sim = ["simulate", "--plan", str(plan_path), "--profile", str(prof), "--cluster", str(cluster)]
    assert main(sim) == 0
    assert "ZB-H1" in capsys.readouterr().out
    assert main([*sim, "--schedule", "interleaved", "--virtual-stages", "3"]) != 0
    err = capsys.readouterr().err
    assert err.count("dapple: error:") == 1 and "v=3" in err
    assert main(["plan", *common, "--compare"]) == 0
    out = capsys.readouterr().out
    assert "best plan per schedule" in out and "zbh1" in out


def test_balanced_pipelines_cut_equal_work():
    from dapple.planner.schedule_choice import balanced_pipelines

    cluster = make_cluster(per_server=4)
    plans = balanced_pipelines(make_profile(8), cluster, 16)
    assert [p.replication for p in plans] == ["2:2", "1:1:1:1"]
    assert [p.split_positions for p in plans] == [(4,), (2, 4, 6)]
    assert all(p.devices == (0, 1, 2, 3) for p in plans)
    # more groups than layers are skipped; a skewed chain is cut where the work is
    assert [p.num_stages for p in balanced_pipelines(make_profile(3), cluster, 16)] == [2]
    prof = make_profile(7)
    heavy = dataclasses.replace(
        prof.layers[0],
        forward=AffineTime(fixed_ms=0.0, per_sample_ms=10.0),
        backward=AffineTime(fixed_ms=0.0, per_sample_ms=20.0),
    )
    prof = dataclasses.replace(prof, layers=(heavy, *prof.layers[1:]))
    assert balanced_pipelines(prof, cluster, 16)[0].split_positions == (1,)


def test_api_schedule_names():
    import dapple.api as dp

    prof, cluster = make_profile(8), make_cluster()
    zb = dp.plan(prof, cluster, 16, schedule="zbh1")
    assert zb.schedule == "zbh1" and zb.predicted_step_ms > 0
    sim = dp.simulate(_base(M=3, gbs=12), prof, cluster, schedule="interleaved", virtual_stages=2)
    assert sim.schedule == "interleaved"
    with pytest.raises(ValidationError, match="needs schedule='interleaved'"):
        dp.plan(prof, cluster, 16, virtual_stages=2)
    with pytest.raises(ValidationError, match=r"plan covers layers \[0, 8\) but the model has 5"):
        dp.train(zb, "mlp", steps=1)  # the runtime runs ZB-H1: checked like any plan


def test_best_schedule_is_the_fastest_variant_that_fits(tmp_path, capsys, monkeypatch):
    """``--schedule best`` / ``schedule="best"``: every variant's best plan by simulation, the
    fastest feasible one chosen (the plan the CLI writes and the API returns)."""
    from dapple import api
    from dapple.planner.schedule_choice import best_schedule

    prof, cluster = make_profile(8), make_cluster()
    base = _base(M=4, gbs=16)
    best, choices = best_schedule(base, prof, cluster)
    assert [c.label for c in choices] == [
        "gpipe", "dapple/A", "dapple/B", "interleaved v=2", "interleaved v=4", "zbh1", "zbv",
        "dualpipev",
    ]  # fmt: skip
    fits = [c for c in choices if c.result is not None]
    assert best.result is not None and best.plan is not None
    assert best.result.step_ms == min(c.result.step_ms for c in fits)  # type: ignore[union-attr]
    assert simulate(best.plan, prof, cluster).step_ms == best.result.step_ms
    planned = api.plan(prof, cluster, 16, schedule="best")
    assert planned.schedule in {"gpipe", "dapple", "interleaved", "zbh1", "zbv", "dualpipev"}
    monkeypatch.setenv("COLUMNS", "200")
    prof_path, cl_path, out = tmp_path / "p.json", tmp_path / "c.json", tmp_path / "plan.json"
    prof.save(prof_path)
    cluster.save(cl_path)
    args = ["plan", "--profile", str(prof_path), "--cluster", str(cl_path)]
    assert main([*args, "--global-batch-size", "16", "--schedule", "best", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen:" in text and "best plan per schedule" in text
    assert Plan.load(out) == planned
    tiny = dataclasses.replace(cluster, device_memory_bytes=1)
    with pytest.raises(ValidationError, match="no schedule fits the memory: gpipe: "):
        best_schedule(base, prof, tiny)


def test_refine_cuts_searches_the_partition_under_each_schedule():
    """From a lopsided straight 2-stage cut (1 | 7 layers) hill climbing on the simulated step
    reaches a faster partition under each schedule; interleaved groups keep multiples of v."""
    from dapple.planner.schedule_choice import ScheduleChoice, refine_cuts

    prof, cluster = make_profile(8), make_cluster()
    lopsided = straight_plan(8, [0, 2], global_batch_size=16, num_micro_batches=4)
    for schedule, v in (("dapple", 1), ("zbh1", 1), ("interleaved", 2)):
        plan = with_schedule(lopsided, schedule, v)
        res = simulate(plan, prof, cluster)
        got = refine_cuts(ScheduleChoice(schedule, plan, res), prof, cluster)
        assert got.plan is not None and got.result is not None
        assert got.result.step_ms < res.step_ms, schedule
        assert got.plan.schedule == schedule and got.plan.virtual_stages == v
        assert simulate(got.plan, prof, cluster).step_ms == got.result.step_ms
        sizes = [st.layers[1] - st.layers[0] for st in got.plan.stages]
        assert all(n >= 1 for n in sizes)
        if v > 1:
            groups = with_schedule(got.plan, "dapple").stages
            assert all((st.layers[1] - st.layers[0]) % v == 0 for st in groups)
    none = ScheduleChoice("gpipe", None, None, "no plan")
    assert refine_cuts(none, prof, cluster) is none


def _climb_every_neighbour(choice, prof, cluster):
    """The hill climb of :func:`refine_cuts` with every neighbour simulated, revisits included:
    the reference its skipping of revisits must match."""
    plan, res = choice.plan, choice.result
    base = unchunked(plan)
    while True:
        better = None
        for g in range(base.num_stages - 1):
            for d in (-1, 1):
                lo, mid = base.stages[g].layers
                hi = base.stages[g + 1].layers[1]
                if mid + d - lo < 1 or hi - mid - d < 1:
                    continue
                stages = list(base.stages)
                stages[g] = dataclasses.replace(stages[g], layers=(lo, mid + d))
                stages[g + 1] = dataclasses.replace(stages[g + 1], layers=(mid + d, hi))
                moved = dataclasses.replace(base, stages=tuple(stages))
                cand = with_schedule(moved, plan.schedule, 1, plan.policy)
                r = simulate(cand, prof, cluster)
                if r.step_ms < (res.step_ms if better is None else better[2].step_ms):
                    better = (moved, cand, r)
        if better is None:
            return plan, res
        base, plan, res = better


def test_refine_cuts_simulates_no_partition_twice(monkeypatch):
    """A climb that moves a cut five times (1 | 11 layers to 6 | 6) simulates each partition it
    tries once - the move back to where it came from is known not to be faster - and ends where
    the climb that simulates every neighbour ends, with the same simulated step."""
    import dapple.planner.schedule_choice as sc

    prof, cluster = make_profile(12), make_cluster()
    plan = with_schedule(
        straight_plan(12, [0, 1], global_batch_size=16, num_micro_batches=4), "dapple"
    )
    choice = ScheduleChoice("dapple/A", plan, simulate(plan, prof, cluster))
    want_plan, want = _climb_every_neighbour(choice, prof, cluster)
    tried: list[tuple[tuple[int, int], ...]] = []

    def recording(p, *a, **kw):
        tried.append(tuple(st.layers for st in p.stages))
        return simulate(p, *a, **kw)

    monkeypatch.setattr(sc, "simulate", recording)
    got = refine_cuts(choice, prof, cluster)
    assert got.plan is not None and got.result is not None
    assert [st.layers for st in got.plan.stages] == [(0, 6), (6, 12)]
    assert got.plan.stages == want_plan.stages and got.result.step_ms == want.step_ms
    # 2|10 ... 7|5 and the move back to the start, 1|11, each once; the moves back to 2|10 ...
    # 5|7 are skipped
    assert len(tried) == len(set(tried)) == 7, tried


def test_train_and_verify_take_every_schedule_name(tmp_path):
    """``--schedule`` of ``train``/``verify`` (and the API's ``schedule=``) names every schedule;
    ``interleaved`` cuts each device group into ``--virtual-stages`` chunks."""
    from dapple.api import plan_with, run_inputs
    from dapple.cli import build_parser
    from dapple.cli._train_flags import verify_config_of

    path = tmp_path / "plan.json"
    base = _base(M=3, gbs=12)
    base.save(path)

    def run_plan(schedule, v=1, policy=None):
        argv = ["verify", "--plan", str(path), "-m", "mlp", "--virtual-stages", str(v)]
        argv += [*(["--schedule", schedule] if schedule else []),
                 *(["--policy", policy] if policy else [])]  # fmt: skip
        return run_inputs(verify_config_of(build_parser().parse_args(argv)), cli=True).plan

    inter = run_plan("interleaved", 2)
    assert inter == with_schedule(base, "interleaved", 2) == plan_with(path, "interleaved", None, 2)
    assert inter.virtual_stages == 2 and inter.num_stages == 6
    assert run_plan("zbh1").schedule == "zbh1"
    assert run_plan(None, policy="B") == dataclasses.replace(base, policy="B")
    with pytest.raises(ValidationError, match="--virtual-stages 2 needs --schedule interleaved"):
        run_plan(None, 2)
    with pytest.raises(ValidationError, match="virtual_stages=2 needs schedule='interleaved'"):
        plan_with(path, None, None, 2)

    parser = build_parser()
    for cmd in ("train", "verify"):
        ns = parser.parse_args([cmd, "--plan", str(path), "-m", "mlp", "--schedule",
                                "interleaved", "--virtual-stages", "2"])  # fmt: skip
        assert (ns.schedule, ns.virtual_stages) == ("interleaved", 2)


def test_v_schedules_take_an_odd_layer_count_and_refuse_in_their_own_name():
    """A V over P groups needs 2P chunks, not v | N: 9 layers on 3 groups (3 each, cut 2 + 1) run
    as ZB-V and DualPipeV while interleaving refuses the odd count; a group of one layer is
    refused by each V schedule under its own name, naming the stage and its layers."""
    prof, cluster = make_profile(9), make_cluster()
    choices = {c.label: c for c in best_per_schedule([_base((1, 1, 1), (0, 3, 6), 9, 6, 12)],
                                                     prof, cluster)}  # fmt: skip
    assert "the 9 layers are not a multiple of v=2" in choices["interleaved v=2"].note
    for label in ("zbv", "dualpipev"):
        plan = choices[label].plan
        assert plan is not None and plan.schedule == label and plan.num_layers == 9
        assert [st.layers[1] - st.layers[0] for st in plan.stages] == [2, 2, 2, 1, 1, 1]
    short = best_per_schedule([_base((1, 1, 1), (0, 1, 3), 5, 6, 12)], prof, cluster)
    notes = {c.label: c.note for c in short}
    for label, title in (("zbv", "ZB-V"), ("dualpipev", "DualPipeV")):
        assert notes[label] == (
            f"{title} cuts each device group into 2 chunks (a V over 3 groups: 6 chunks of at "
            "least one layer), but stage 0 (devices [0]) has 1 layer(s) [0, 1]"
        )


def test_refining_a_v_plan_moves_its_cuts_one_layer_at_a_time():
    """The cut search of a V schedule moves a boundary by one layer (each group keeping two):
    from 6 + 2 + 2 layers on a uniform chain it reaches an odd group (3 + 4 + 3 or the like),
    which moves of v = 2 could not."""
    prof, cluster = make_profile(10), make_cluster()
    base = _base((1, 1, 1), (0, 6, 8), 10, 6, 12)
    for schedule in ("zbv", "dualpipev"):
        plan = with_schedule(base, schedule)
        start = ScheduleChoice(schedule, plan, simulate(plan, prof, cluster))
        got = refine_cuts(start, prof, cluster)
        assert got.plan is not None and got.result is not None
        assert got.result.step_ms < start.result.step_ms
        counts = [st.layers[1] - st.layers[0] for st in unchunked(got.plan).stages]
        assert sum(counts) == 10 and min(counts) >= 2 and any(n % 2 for n in counts), counts
