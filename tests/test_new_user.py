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
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search


def _with_update(u: float):
    """The test profile with a measured optimizer update of ``u`` ms per parameter byte, which
    ZeRO divides by r_s: by L alone a sharded stage is then always faster."""
    p = make_profile(params=10**6)
    return dataclasses.replace(p, update_ms_per_parameter_byte=u)


def test_auto_leaves_a_stage_unsharded_where_it_fits_and_offers_the_plans_zero_twins() -> None:
    profile, cluster = _with_update(1e-6), make_cluster()
    sharded = dapple_search(profile, cluster, 8, zero_stage=1)
    assert any(st.zero_stage == 1 for st in sharded.stages)  # ZeRO-1's 1/r update is cheaper
    # the scorer's own rule under auto keeps a stage that holds its K_i unsharded ...
    stages = [(*st.layers, st.devices) for st in sharded.stages]
    own = Scorer(profile, cluster, 8, "auto").score(stages, sharded.num_micro_batches)
    assert own is not None and all(z.stage == 0 for z in own.zero_modes)
    assert sharded.predicted_step_ms < own.L_ms  # so L alone would have sharded
    # ... and the search offers each plan it found with every replicated stage at an explicit
    # zero stage (planner.zero_twins), so auto is not slower by L than --zero-stage 1 (README)
    twin = dapple_search(profile, cluster, 8, zero_stage="auto", grid=False)
    assert twin.predicted_step_ms == pytest.approx(sharded.predicted_step_ms, rel=1e-9)
    assert [st.zero_stage for st in twin.stages] == [st.zero_stage for st in sharded.stages]
    # the grid's FSDP point of the same layout updates 1/r per replica too
    auto = dapple_search(profile, cluster, 8, zero_stage="auto")
    assert auto.predicted_step_ms <= sharded.predicted_step_ms * (1 + 1e-9)


def test_auto_still_shards_where_memory_asks() -> None:
    profile = _with_update(1e-6)
    profile = dataclasses.replace(
        profile,
        layers=tuple(dataclasses.replace(x, parameter_bytes=10**8) for x in profile.layers),
    )
    tight = dataclasses.replace(make_cluster(), device_memory_bytes=int(2.15e9))
    plan = dapple_search(profile, tight, 8, max_stages=1, zero_stage="auto")
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
    from dapple.runtime.parallel.tensor_check import check_tensor_run

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


# -- item 6: what a prediction rests on ---------------------------------------------------------
def test_the_prediction_names_its_basis_and_points_to_calibrate(tmp_path: Path) -> None:
    from dapple.cli._prediction_note import OFF_RATIO, prediction_basis
    from dapple.core.cluster_presets import PRESETS

    prof = tmp_path / "p.json"
    dataclasses.replace(make_profile(), device="cpu").save(prof)
    close = prediction_basis(str(prof), "local-cpu", 10.0, 10.0 * OFF_RATIO * 0.99)
    assert "preset cluster 'local-cpu'" in close and "measured on cpu" in close
    assert "dapple calibrate" not in close and len(close.splitlines()) == 1
    off = prediction_basis(str(prof), "local-cpu", 58.4, 8.5).splitlines()
    assert len(off) == 2 and "6.87x" in off[1] and "dapple calibrate" in off[1]
    assert "0.15x" in prediction_basis(str(prof), "local-cpu", 8.5, 58.4)  # too slow a guess too
    calibrated = dataclasses.replace(PRESETS["local-cpu"], name="cal", step_overhead_ms=1.0)
    calibrated.save(tmp_path / "c.json")
    got = prediction_basis(str(prof), str(tmp_path / "c.json"), 209.5, 50.7)
    assert "calibrated host CPU terms" in got and "as it was loaded then" in got
    analytic = dataclasses.replace(make_profile(), device="H100 (analytic)")
    analytic.save(tmp_path / "a.json")
    assert "analytic profile" in prediction_basis(str(tmp_path / "a.json"), "h100-8x", 1.0, 1.0)


def test_a_plan_on_the_local_cpu_preset_says_it_is_not_measured_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = tmp_path / "p.json"
    dataclasses.replace(make_profile(), device="cpu").save(prof)
    base = ["plan", "--profile", str(prof), "--global-batch-size", "8"]
    assert main([*base, "--cluster", "local-cpu"]) == 0
    out = capsys.readouterr().out
    assert "the prediction rests on the preset cluster 'local-cpu'" in out
    assert "dapple calibrate --nproc N -o cluster.json" in out
    assert main([*base, "--cluster", "paper-a"]) == 0  # a datasheet cluster: no such line
    assert "the prediction rests on" not in capsys.readouterr().out


# -- item 4: generate's cut prompt and the demo's continuation ----------------------------------
def test_a_prompt_longer_than_the_context_is_said_to_be_cut() -> None:
    from dapple.cli.generate_cmd import prompt_cut
    from dapple.models.generate import generate_text
    from dapple.models.zoo import load_workload

    wl = load_workload("transformer", layers=1, hidden=16, heads=2, seq=8, vocab=256)
    model = wl.build_model(0)
    short = generate_text(wl, model, "abc", 2)
    assert short.context == 8 and prompt_cut(short) == ""
    long = generate_text(wl, model, "x" * 20, 2)
    assert long.context == 8 and long.prompt_tokens == 20 and long.text.startswith("x" * 20)
    warning = prompt_cut(long)
    assert warning.startswith("dapple: warning:") and "last 8" in warning and "first 12" in warning


def test_the_demo_shows_a_repeated_byte_as_a_run() -> None:
    from dapple.cli._demo_generate import is_run, runs

    assert is_run(" " * 140) and runs(" " * 140) == "' ' x 140"
    assert not is_run("ab ") and runs("a\\nb") == repr("a\\nb")
    assert not is_run("")
    # a run after some text, as the demo's greedy continuation ends (was 63 spaces in a repr)
    assert runs(", in):\n" + " " * 142) == "', in):\\n' + ' ' x 142"
    assert runs("x" + "z" * 9 + "tail") == "'x' + 'z' x 9 + 'tail'"
    assert runs("ab" * 60) == repr("ab" * 40) + "..."


def test_the_demo_prints_sampled_bytes_terminal_safe() -> None:
    from dapple.cli._demo_generate import _decoded

    assert _decoded([ord("a"), 0x1B, ord("["), ord("2"), ord("J"), 10]) == "a\\x1b[2J\n"


# -- item 3: elastic and stop wording -------------------------------------------------------------
def test_the_stop_line_names_the_last_step_and_checkpoint(tmp_path: Path) -> None:
    import json

    from dapple.runtime.launch.stop_line import last_logged_step, stop_line

    m = tmp_path / "m.jsonl"
    m.write_text("\n".join([json.dumps({"step": 0}), json.dumps({"step": 1}),
                            json.dumps({"event": "replan", "step": 9}), '{"step": 2, "lo']))  # fmt: skip
    assert last_logged_step(str(m)) == 1 and last_logged_step(None) is None
    assert stop_line("SIGTERM", str(m), None) == (
        "dapple: stopped by SIGTERM after step 1; nothing saved (no --checkpoint-dir)"
    )
    empty = tmp_path / "ck"
    empty.mkdir()
    assert stop_line("SIGINT", None, str(empty)) == (
        f"dapple: stopped by SIGINT; no complete checkpoint in {empty}"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigtermed_run_ends_with_a_closing_line(tmp_path: Path) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from dapple.core.plan import straight_plan

    straight_plan(5, [0], global_batch_size=4, num_micro_batches=1).save(tmp_path / "p.json")
    cmd = [sys.executable, "-m", "dapple", "train", "--plan", "p.json", "-m", "mlp",
           "--steps", "100000", "--checkpoint-dir", "ck", "--save-every", "2",
           "--metrics", "m.jsonl", "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        m = tmp_path / "m.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            lines = m.read_text().splitlines() if m.is_file() else []
            if sum('"step"' in x for x in lines) >= 4:
                break
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    steps = [json.loads(x)["step"] for x in m.read_text().splitlines() if '"step"' in x]
    assert last.startswith(f"dapple: stopped by SIGTERM after step {steps[-1]}; last checkpoint: "
                           "step "), err[-2000:]  # fmt: skip
    assert last.endswith("resume with --resume")


# -- item 5: wording ------------------------------------------------------------------------------
def test_the_bars_eta_moves_with_the_clock_between_steps() -> None:
    import io

    from rich.console import Console

    from dapple.cli._console import StepProgress

    now = [0.0]
    con = Console(file=io.StringIO(), force_terminal=True, width=100)
    with StepProgress("train", 4, console=con, heartbeat=False, clock=lambda: now[0]) as p:
        now[0] = 2.0
        p(1)  # 2 s a step so far: 3 left, 6 s
        assert p._bar is not None and p._bar.tasks[0].fields["eta"] == "6.0 s"
        now[0] = 5.0
        p._show()  # no step ended: the mean per step grew with the clock
        assert p._bar.tasks[0].fields["eta"] == "15.0 s"
        now[0] = 6.0
        p(3)
        assert p._bar.tasks[0].fields["eta"] == "2.0 s"


def test_a_tensor_parallel_stage_announces_its_build_once() -> None:
    from dapple.runtime.startup import announces_build

    plan = Plan(planner="manual", global_batch_size=4, micro_batch_size=2, num_micro_batches=2,
                stages=(StagePlan(layers=(0, 2), devices=(0, 1, 2, 3), tensor_width=2),
                        StagePlan(layers=(2, 4), devices=(4, 5))))  # fmt: skip
    assert [r for r in range(6) if announces_build(plan, r)] == [0, 4]


def test_a_tensor_group_is_one_row_named_by_all_its_devices(tmp_path: Path) -> None:
    from dapple.simulate import simulate
    from dapple.simulate.plots import _devs, plot_gantt
    from test_tensor_plan import _blocks, _cluster

    plan = Plan(planner="manual", global_batch_size=4, micro_batch_size=2, num_micro_batches=2,
                stages=(StagePlan(layers=(0, 1), devices=(0, 1, 2, 3), tensor_width=2),
                        StagePlan(layers=(1, 2), devices=(4, 5))))  # fmt: skip
    r = simulate(plan, _blocks(2), _cluster())
    rows = [(_devs(d), d.stage, d.replica) for d in r.devices]
    assert rows == [("devs 0-1 (TP2)", 0, 0), ("devs 2-3 (TP2)", 0, 1), ("dev 4", 1, 0),
                    ("dev 5", 1, 1)]  # fmt: skip
    assert [d.devices_text for d in r.devices] == ["0-1", "2-3", "4", "5"]
    plot_gantt([("tp", r)], tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0
