"""The step point as schedule data: ``AGREE`` (the non-finite guard's world collective, which
every rank waits for before its update) or ``POST`` (``on_nonfinite`` off: no rank waits, and
consecutive steps overlap), from the lowering through the validator, the simulator, the step rule
(replay), the planner and the CLI, by hand and against each other.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import NO_COMM, per_call_profile
from dapple.cli import main
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.schedule_step import schedule_latency
from dapple.errors import ValidationError
from dapple.planner.schedule_choice import best_per_schedule
from dapple.schedule import lower, validate
from dapple.schedule.ir import ActionKind, format_actions, parse_action, step_point_kind
from dapple.simulate import simulate
from dapple.simulate.plan_variants import with_schedule

K = ActionKind


def _latency_cluster(devices: int, latency_ms: float) -> Cluster:
    """Links of ``latency_ms`` and no bandwidth limit worth the name: a transfer of bytes costs
    its latency (one of no bytes nothing)."""
    return Cluster(
        name="lat",
        servers=1,
        devices_per_server=devices,
        device_memory_bytes=2**40,
        intra_server_bandwidth_gbps=1e12,
        inter_server_bandwidth_gbps=1e12,
        intra_server_latency_ms=latency_ms,
        inter_server_latency_ms=latency_ms,
    )


def _two_stages(updates_ms: tuple[float, float]) -> tuple[Plan, ModelProfile]:
    """Two one-layer stages, F = 1 and B = 2 per call, zero-byte boundaries (no transfer
    time), optimizer updates U_0, U_1 = ``updates_ms`` (1 ms per 1000 parameter bytes); M = 1
    under DAPPLE's 1F1B."""
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward=AffineTime(fixed_ms=1.0, per_sample_ms=0.0),
            backward=AffineTime(fixed_ms=2.0, per_sample_ms=0.0),
            output_bytes_per_sample=0.0,
            parameter_bytes=int(1000 * u),
            kept_activation_bytes_per_sample=1.0,
        )
        for i, u in enumerate(updates_ms)
    )
    profile = ModelProfile(model_name="two", layers=layers, update_ms_per_parameter_byte=1e-3)
    return straight_plan(2, [0, 1], global_batch_size=1, num_micro_batches=1), profile


# -- lowering and validation ------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "point"), [("stop", "AGREE"), ("skip", "AGREE"), ("off", "POST")])
def test_every_program_ends_ar_step_point_opt(mode: str, point: str) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 1])
    sched = lower(plan, on_nonfinite=mode)
    validate(sched, plan)
    assert format_actions(sched[1]).endswith(f"0.1AR 0.1{point} 0.1OPT")
    assert format_actions(sched[2]).endswith(f"1B1 1.0SEND_B1@0 1.0SEND_B1@1 1{point} 1OPT")
    assert parse_action(f"0.1{point}") == sched[1][-2]


def test_an_unknown_mode_is_refused_by_name() -> None:
    plan = straight_plan(2, [0, 1], global_batch_size=2, num_micro_batches=2)
    with pytest.raises(ValidationError, match="on_nonfinite must be stop, skip or off, got 'x'"):
        lower(plan, on_nonfinite="x")
    with pytest.raises(ValidationError, match="got 'never'"):
        step_point_kind("never")


def test_the_validator_refuses_misplaced_and_mixed_step_points() -> None:
    plan = straight_plan(2, [0, 1], global_batch_size=2, num_micro_batches=1)
    sched = lower(plan)
    mixed = {**sched, 1: [a if a.kind is not K.AGREE else parse_action("1POST") for a in sched[1]]}
    with pytest.raises(ValidationError, match="step points differ: device 0 AGREE, device 1 POST"):
        validate(mixed, plan)
    early = {**sched, 0: [parse_action("0AGREE"), *(a for a in sched[0] if a.kind is not K.AGREE)]}
    with pytest.raises(ValidationError, match="device 0: step point before the last backward"):
        validate(early, plan)
    twice = {**sched, 1: [*sched[1][:-1], parse_action("1POST"), sched[1][-1]]}
    with pytest.raises(ValidationError, match="device 1: 2 step points"):
        validate(twice, plan)
    late_opt = {**sched, 0: [*sched[0][:-2], sched[0][-1], sched[0][-2]]}
    with pytest.raises(ValidationError, match="OPT before the last backward/AR/step point"):
        validate(late_opt, plan)


# -- the simulator and the step rule, by hand ----------------------------------------------------
def test_a_guarded_and_an_off_step_by_hand() -> None:
    """1F1B on two stages, M = 1, boundaries of no bytes (no transfer time), U_0 = 1,
    U_1 = 3. Both modes: F_0 0-1, F_1 1-2, B_1 2-4, B_0 4-6.
    Guarded: stage 1 waits in the collective from 4, stage 0 joins at 6; both leave it at 6
    (its own time is not charged), then update: the step ends at 6 + max(1, 3) = 9, where
    each stage updating as it ends would give max(6 + 1, 4 + 3) = 7.
    Off: nobody waits; stage 0 ends at 6 + 1 = 7 and starts its next step there, stage 1
    ends at 4 + 3 = 7 and its next F_1 comes at 7 + 1: every step takes 7. (The rows of a
    step are in by 6, before the next step posts its own.)"""
    plan, profile = _two_stages((1.0, 3.0))
    cluster = _latency_cluster(2, 0.5)
    guarded = simulate(plan, profile, cluster)
    off = simulate(plan, profile, cluster, on_nonfinite="off")
    assert guarded.step_ms == pytest.approx(9.0) and guarded.span_ms == pytest.approx(9.0)
    assert off.step_ms == pytest.approx(7.0) and off.span_ms == pytest.approx(7.0)
    agree = [e for e in guarded.events if e.action.kind is K.AGREE]
    got = [x for e in sorted(agree, key=lambda e: e.device) for x in (e.start_ms, e.end_ms)]
    assert got == pytest.approx([6.0, 6.0, 4.0, 6.0])
    assert [e.duration_ms for e in off.events if e.action.kind is K.POST] == [0.0, 0.0]


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2])
def test_zbv_staircase_is_paid_only_with_the_guard(P: int, rounds: int) -> None:
    """ZB-V with F = I = W = 1 per chunk and free links: rank g's last action ends at 6M + g,
    so the guarded step is ``6M + P - 1``; without the guard rank 0 starts its next step at
    6M while rank P-1 ends the previous one, and every rank's period is its own work, ``6M``.
    The replayed step rule says the same in both modes. DualPipeV's rank 0 spans its whole
    step (``6M + P - 1`` either way): nothing to gain."""
    M = (2 * P - 1) * rounds
    prof = per_call_profile([1.0] * 2 * P, [2.0] * 2 * P, 8, 1.0)
    base = straight_plan(2 * P, [2 * g for g in range(P)], global_batch_size=2 * M,
                         num_micro_batches=M)  # fmt: skip
    zbv = with_schedule(base, "zbv")
    for mode, want in (("stop", 6 * M + P - 1), ("off", 6 * M)):
        assert simulate(zbv, prof, NO_COMM, on_nonfinite=mode).step_ms == pytest.approx(want)
        assert schedule_latency(zbv, prof, NO_COMM, on_nonfinite=mode) == pytest.approx(want)
    if M >= 2 * P and M % 2 == 0:
        dual = with_schedule(base, "dualpipev")
        for mode in ("stop", "off"):
            got = simulate(dual, prof, NO_COMM, on_nonfinite=mode).step_ms
            assert got == pytest.approx(6 * M + P - 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["zbv", "dualpipev", "zbh1", "interleaved"]),
    P=st.integers(2, 4),
    times=st.lists(st.tuples(st.floats(0.2, 3.0), st.floats(0.4, 6.0)), min_size=8, max_size=8),
    update=st.floats(0.0, 2.0),
    latency=st.sampled_from([0.0, 0.05]),
)
def test_replay_equals_the_simulator_in_both_modes(
    name: str, P: int, times: list[tuple[float, float]], update: float, latency: float
) -> None:
    """Straight plans of 2P one-layer chunks with uneven times, updates and link latencies:
    the replayed step is the simulated one with the guard (every update after the last
    group's synchronisation) and without (the steady period)."""
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward=AffineTime(fixed_ms=f, per_sample_ms=0.0),
            backward=AffineTime(fixed_ms=b, per_sample_ms=0.0),
            output_bytes_per_sample=1e3,
            parameter_bytes=int(1000 * (1 + i)),
            kept_activation_bytes_per_sample=1.0,
        )
        for i, (f, b) in enumerate(times[: 2 * P])
    )
    profile = ModelProfile(model_name="r", layers=layers, update_ms_per_parameter_byte=update / 1e3)
    cluster = dataclasses.replace(_latency_cluster(P, latency), intra_server_bandwidth_gbps=8.0)
    M = 2 * P
    base = straight_plan(2 * P, [2 * g for g in range(P)], global_batch_size=M,
                         num_micro_batches=M)  # fmt: skip
    plan = with_schedule(base, name, 1 if name == "zbh1" else 2)
    for mode in ("stop", "off"):
        simulated = simulate(plan, profile, cluster, on_nonfinite=mode).step_ms
        replayed = schedule_latency(plan, profile, cluster, on_nonfinite=mode)
        assert replayed == pytest.approx(simulated, rel=1e-9, abs=1e-9)


# -- the planner, the API and the CLI ----------------------------------------------------------
def test_the_planner_simulates_the_mode_it_is_given() -> None:
    """The unit-time case at M = 6 on 2 groups: with the guard ZB-V and DualPipeV tie at
    ``6M + P - 1`` = 37; without it ZB-V's step is ``6M`` = 36 and only ZB-V's: its plan is
    predicted and simulated at 36, DualPipeV's at 37."""
    prof = per_call_profile([1.0] * 4, [2.0] * 4, 8, 1.0)
    cluster = dataclasses.replace(NO_COMM, devices_per_server=2)
    base = straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=6)
    for mode, want in (
        ("stop", {"zbv": 37.0, "dualpipev": 37.0}),
        ("off", {"zbv": 36.0, "dualpipev": 37.0}),
    ):
        choices = best_per_schedule([base], prof, cluster, [6], on_nonfinite=mode)
        got = {c.label: c for c in choices if c.label in want}
        for label, ms in want.items():
            plan, res = got[label].plan, got[label].result
            assert plan is not None and res is not None
            assert (res.step_ms, plan.predicted_step_ms) == pytest.approx((ms, ms)), (mode, label)


def test_cli_simulate_takes_the_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=6, schedule="zbv")
    plan = with_schedule(plan, "zbv")
    prof = per_call_profile([1.0] * 4, [2.0] * 4, 8, 1.0)
    files = {"plan": tmp_path / "p.json", "profile": tmp_path / "prof.json"}
    plan.save(files["plan"])
    prof.save(files["profile"])
    cluster = tmp_path / "c.json"
    dataclasses.replace(NO_COMM, devices_per_server=2).save(cluster)
    argv = ["simulate", f"--plan={files['plan']}", f"--profile={files['profile']}",
            f"--cluster={cluster}"]  # fmt: skip
    assert main([*argv, "--on-nonfinite", "off"]) == 0
    out = capsys.readouterr().out
    assert "step time 36.000 ms, planner L 36.000 ms" in out
    assert "one step from a common start takes 37.000 ms" in out
    assert main(argv) == 0
    assert "step time 37.000 ms" in capsys.readouterr().out
