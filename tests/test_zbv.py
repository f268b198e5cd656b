"""ZB-V (Qi et al., section 6): two chunks per device group in a V, the split backward.

Golden compute order; properties of the order (each action once, F before I before W, the V's
placement, at most 2P chunk-micro-batches held per rank) and of its lowering with uneven
replication (validated: split-concat peers, a deadlock-free dry run); the V cut of a plan and
the one-line refusals; the simulator (uniform chunks: ``6M + P - 1`` units, the step rule, 1F1B's
peak memory) and ``dapple simulate --schedule zbv``. The runtime: ``test_zbv_runtime``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import NO_COMM, make_profile, per_call_profile
from dapple.cli import main
from dapple.cli._plan_show import schedule_stage_table
from dapple.core.plan import Plan, straight_plan
from dapple.cost.compute import stage_compute_ms
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.errors import ValidationError
from dapple.planner.schedule_choice import best_schedule
from dapple.schedule import ActionKind, compute_order, lower, validate, validate_compute_order
from dapple.schedule.forward import lower_forward
from dapple.schedule.registry import check_virtual_stages, schedule_names
from dapple.schedule.text_grid import format_grid
from dapple.schedule.zbv import v_group, v_shape, zbv
from dapple.simulate import simulate
from dapple.simulate.plan_variants import unchunked, with_schedule

K = ActionKind
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOLDEN_P2_M4 = """\
step | rank 0 | rank 1
-----+--------+-------
0    | 0F0    | 1F0
1    | 0F1    | 2F0
2    | 0F2    | 1F1
3    | 3F0    | 2F1
4    | 3I0    | 2I0
5    | 3W0    | 2W0
6    | 3F1    | 1F2
7    | 3I1    | 1I0
8    | 3W1    | 1W0
9    | 0F3    | 2F2
10   | 0I0    | 2I1
11   | 0W0    | 2W1
12   | 3F2    | 1F3
13   | 3I2    | 1I1
14   | 3W2    | 1W1
15   | 0I1    | 2F3
16   | 0W1    | 2I2
17   | 3F3    | 2W2
18   | 3I3    | 1I2
19   | 3W3    | 2I3
20   | 0I2    | 1I3
21   | 0W2    | 1W2
22   | 0I3    | 2W3
23   | 0W3    | 1W3"""


def _straight(groups: int, per_group: int, M: int, reps: list[int] | None = None, b: int = 2):
    return straight_plan(
        groups * per_group,
        [g * per_group for g in range(groups)],
        global_batch_size=M * b,
        num_micro_batches=M,
        replicas=reps,
    )


def test_zbv_is_built_in_and_golden() -> None:
    assert "zbv" in schedule_names()
    assert format_grid(compute_order("zbv", 2, 4, v=2), column_label="rank") == GOLDEN_P2_M4


@FAST
@given(P=st.integers(2, 6), M=st.integers(1, 20))
def test_order_runs_each_action_once_in_the_v_and_holds_at_most_2p(P: int, M: int) -> None:
    order = zbv(P, M)
    validate_compute_order(order, P, M, 2, v_group)  # coverage, order, dependencies: no deadlock
    for g, acts in order.items():
        assert {a.stage for a in acts} == {g, 2 * P - 1 - g}  # the V
        seen: dict[tuple[int, int], list[ActionKind]] = {}
        held = peak = 0
        for a in acts:
            assert a.micro_batch is not None
            seen.setdefault((a.stage, a.micro_batch), []).append(a.kind)
            held += a.kind is K.FORWARD
            held -= a.kind is K.BACKWARD_WEIGHT
            peak = max(peak, held)
        assert all(kinds == [K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT]
                   for kinds in seen.values())  # fmt: skip
        assert len(seen) == 2 * M
        assert peak <= 2 * P  # section 6: 1F1B's stage-0 activations, as half-stage chunks


def test_dropping_micro_batches_keeps_the_padded_order() -> None:
    """M < 2P-1: the order is the full V's without the missing micro-batches' actions."""
    full, short = zbv(3, 5), zbv(3, 2)
    for g in range(3):
        assert short[g] == [a for a in full[g] if a.micro_batch is not None and a.micro_batch < 2]


def test_v_shape_cuts_each_group_in_two_down_and_back_up() -> None:
    plan = straight_plan(7, [0, 3, 5], global_batch_size=8, num_micro_batches=4,
                         replicas=[2, 1, 1])  # fmt: skip
    z = v_shape(plan)
    assert z.schedule == "zbv" and z.virtual_stages == 2 and z.num_groups == 3
    assert [s.layers for s in z.stages] == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert [s.devices for s in z.stages] == [(0, 1), (2,), (3,), (3,), (2,), (0, 1)]
    assert [z.stages_of_group(g) for g in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert z.stages_of_device(1) == (0, 5) and z.replication == "2:1:1"
    back = unchunked(z)
    assert [s.layers for s in back.stages] == [(0, 3), (3, 5), (5, 7)]
    assert Plan.from_dict(z.to_dict()) == z  # the placement is the schedule's, not stored


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: zbv(1, 4), "ZB-V needs P >= 2 device groups"),
        (lambda: zbv(2, 4, 3), "exactly 2 chunks per group (chunk count = 2 x ranks)"),
        (lambda: with_schedule(_straight(1, 4, 2), "zbv"), "at least 2 device groups"),
        (lambda: with_schedule(_straight(2, 1, 2), "zbv"), "stage 0 (devices [0]) has 1 layer"),
        (lambda: with_schedule(_straight(2, 4, 2), "zbv", 3), "got virtual_stages 3"),
        (lambda: check_virtual_stages(4, "zbv", cli=True), "got --virtual-stages 4"),
        (lambda: v_shape(_straight(2, 4, 2), 3), "got v=3"),
    ],
)
def test_plans_it_cannot_express_are_refused_in_one_line(make, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        make()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_chunk_on_the_wrong_group_is_refused() -> None:
    z = with_schedule(_straight(2, 4, 4), "zbv")
    stages = list(z.stages)
    stages[2] = dataclasses.replace(stages[2], devices=(0,))  # the V puts stage 2 on group 1
    with pytest.raises(ValidationError, match="virtual stage 2 must run on the devices of stage 1"):
        dataclasses.replace(z, stages=tuple(stages))


@FAST
@given(
    reps=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    M=st.integers(1, 7),
    b=st.integers(1, 6),
)
def test_lowered_with_uneven_replication_validates(reps: list[int], M: int, b: int) -> None:
    """Split-concat between unevenly replicated chunks, the turn of the V a message each
    replica sends itself, every send paired and the dry run deadlock-free."""
    z = with_schedule(_straight(len(reps), 2, M, reps, b), "zbv")
    sched = lower(z)
    validate(sched, z)
    P = len(reps)
    turn = [a for prog in sched.values() for a in prog if a.kind is K.SEND_F and a.stage == P - 1]
    assert all(a.peer == a.replica for a in turn)  # the same group: each replica to itself
    fwd = lower_forward(z)
    for dev, prog in fwd.items():
        mine = {a.stage for a in prog if a.kind is K.FORWARD}
        assert not prog or mine == set(z.stages_of_device(dev))


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_uniform_chunks_step_is_6m_plus_p_minus_1_with_1f1b_memory(P: int, rounds: int) -> None:
    """Chunks of one layer with F = I = W = 1 (the first chunk's inputs carry no gradient: its
    I is 0 and W 2) and free communication: ``6M + P - 1``, the step rule's exactly; every
    device's peak memory is 1F1B's (DAPPLE policy A) on the same partition; the turn of the V
    costs nothing."""
    M = (2 * P - 1) * rounds
    prof = per_call_profile([1.0] * 2 * P, [2.0] * 2 * P, 8, 1.0)
    base = _straight(P, 2, M)
    z = with_schedule(base, "zbv")
    res = simulate(z, prof, NO_COMM)
    assert res.step_ms == pytest.approx(6 * M + P - 1)
    assert schedule_latency(z, prof, NO_COMM) == pytest.approx(res.step_ms)
    one_f_one_b = simulate(with_schedule(base, "dapple"), prof, NO_COMM)
    assert res.step_ms < one_f_one_b.step_ms
    assert res.peak_memory_bytes == pytest.approx(one_f_one_b.peak_memory_bytes)
    turn = [e for e in res.events if e.action.kind is K.SEND_F and e.action.stage == P - 1]
    assert turn and all(e.peer_device == e.device and e.duration_ms == 0 for e in turn)


@FAST
@given(
    times=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), min_size=2, max_size=8),
    reps=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    M=st.integers(1, 8),
)
def test_uneven_chunks_sim_and_rule_bound_the_busiest_rank(times, reps, M) -> None:
    """Uneven chunks and replication: the simulated and the predicted step are at least the
    busiest device group's work ``M max_g T_g``, and the simulator's peaks are the cost model's
    compute-order replay on every device group."""
    P = len(reps)
    times = (times * 2 * P)[: 2 * P]
    prof = per_call_profile([float(f) for f, _ in times], [float(b) for _, b in times], 8, 1.0)
    z = with_schedule(_straight(P, 2, M, reps), "zbv")
    res = simulate(z, prof, NO_COMM)
    b = z.micro_batch_size
    work = max(
        sum(sum(stage_compute_ms(prof, NO_COMM, z.stages[k], b)) for k in z.stages_of_group(g))
        for g in range(P)
    )
    for t in (res.step_ms, schedule_latency(z, prof, NO_COMM)):
        assert M * work - 1e-6 <= t
    memory = device_memory_by_group(z, prof)
    for g in range(P):
        assert res.device(z.stages[g].devices[0]).peak_memory_bytes == pytest.approx(memory[g])


def test_cli_simulate_draws_the_zbv_gantt(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    prof, cluster, plan = tmp_path / "p.json", tmp_path / "c.json", tmp_path / "plan.json"
    per_call_profile([1.0] * 6, [2.0] * 6, 8, 1.0).save(prof)
    NO_COMM.save(cluster)
    _straight(3, 2, 5, [2, 1, 1]).save(plan)
    gantt = tmp_path / "zbv.png"
    argv = ["simulate", "--plan", str(plan), "--profile", str(prof), "--cluster", str(cluster)]
    assert main([*argv, "--schedule", "zbv", "--gantt", str(gantt), "--other-schedule"]) == 0
    out = capsys.readouterr().out
    assert "ZB-V, 2:1:1, M=5 on no-comm" in out and f"wrote {gantt}" in out
    assert gantt.stat().st_size > 0
    assert main([*argv, "--schedule", "zbv", "--virtual-stages", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("dapple: error: schedule 'zbv' holds 2 chunks per device group "
                   "(chunk count = 2 x ranks), got --virtual-stages 3")  # fmt: skip


def test_the_planner_picks_a_v_schedule_when_the_simulation_says_it_wins() -> None:
    """``--schedule best``: on 4 devices with free links and a uniform 8-layer chain (per-sample
    times) the V schedules simulate fastest of every variant, and the choice is one of them."""
    cluster = dataclasses.replace(NO_COMM, devices_per_server=4)
    prof = make_profile(8, act=1.0, params=8)
    plan = straight_plan(8, [0, 2, 4, 6], global_batch_size=16, num_micro_batches=16)
    best, choices = best_schedule(plan, prof, cluster)
    by = {c.label: c.result.step_ms for c in choices if c.result is not None}
    assert best.plan is not None and best.plan.schedule == "zbv"
    others = [ms for label, ms in by.items() if label not in ("zbv", "dualpipev")]
    assert by["zbv"] < min(others)
    assert simulate(best.plan, prof, cluster).step_ms == pytest.approx(by["zbv"])


def test_plan_table_shows_each_chunk_on_its_group_of_the_v() -> None:
    """``dapple plan``'s step-rule table: stage k's device group is the V's, and so is the
    group memory shown beside it."""
    prof = per_call_profile([1.0] * 6, [2.0] * 6, 8, 1.0)
    z = with_schedule(_straight(3, 2, 5, [2, 1, 1]), "zbv")
    table = schedule_stage_table(z, prof, NO_COMM)
    cols = {c.header: list(c.cells) for c in table.columns}
    assert cols["group"] == ["0", "1", "2", "2", "1", "0"]
    memory = device_memory_by_group(z, prof)
    assert cols["group memory GiB"] == [f"{memory[g] / 2**30:.2f}" for g in (0, 1, 2, 2, 1, 0)]
