"""Schedule validator: accepts lowered schedules, rejects each kind of broken one with a grid."""

from __future__ import annotations

import pytest

from dapple.core.plan import Plan, StagePlan, straight_plan
from dapple.errors import ValidationError
from dapple.schedule import Action, ActionKind, dapple, lower, parse_action
from dapple.schedule.validate import format_grid, validate, validate_compute_order

K = ActionKind


def _plan_2to1(M: int = 2) -> Plan:
    return Plan(
        planner="manual",
        global_batch_size=2 * M,
        micro_batch_size=2,
        num_micro_batches=M,
        stages=(
            StagePlan(layers=(0, 2), devices=(0, 1)),
            StagePlan(layers=(2, 4), devices=(2,)),
        ),
    )


def _find(prog: list[Action], text: str) -> int:
    return [str(a) for a in prog].index(text)


def test_accepts_lowered_plans():
    for plan in (
        _plan_2to1(3),
        straight_plan(6, [0, 2, 4], global_batch_size=12, num_micro_batches=4),
        straight_plan(6, [0, 1, 3], global_batch_size=9, num_micro_batches=3, replicas=[2, 3, 1]),
        straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=4, schedule="gpipe"),
    ):
        validate(lower(plan), plan)


def test_b_before_f_is_marked_in_grid():
    plan = _plan_2to1()
    sched = lower(plan)
    i, j = _find(sched[2], "1F0"), _find(sched[2], "1B0")
    sched[2][i], sched[2][j] = sched[2][j], sched[2][i]
    with pytest.raises(ValidationError) as e:
        validate(sched, plan)
    msg = str(e.value)
    assert "device 2: 1B0 runs before its forward" in msg
    assert ">>1B0<<" in msg
    # the grid: a header with one column per device, one row per step
    lines = msg.splitlines()
    assert lines[1].split("|")[0].strip() == "step"
    assert [c.strip() for c in lines[1].split("|")[1:]] == ["dev 0", "dev 1", "dev 2"]
    assert any(line.startswith("2 ") and ">>1B0<<" in line for line in lines)


def test_dropped_recv_is_reported():
    plan = _plan_2to1()
    sched = lower(plan)
    del sched[2][_find(sched[2], "1.0RECV_F1@1")]
    with pytest.raises(ValidationError, match=r"1F1 needs RECV_F1@1 \(missing\)") as e:
        validate(sched, plan)
    assert ">>1F1<<" in str(e.value)


def test_unpaired_send_is_reported():
    plan = _plan_2to1()
    sched = lower(plan)
    sched[0].remove(parse_action("0.0SEND_F1@0"))  # device 0 still computes 0F1 but never sends
    with pytest.raises(ValidationError, match=r"0F1 never sends to replica\(s\) \[0\]"):
        validate(sched, plan)


def test_renamed_send_is_reported():
    plan = straight_plan(4, [0, 2], global_batch_size=2, num_micro_batches=2)
    sched = lower(plan)
    k = _find(sched[0], "0.0SEND_F1@0")
    sched[0][k] = parse_action("0.0SEND_F0@0")
    with pytest.raises(ValidationError, match="appears twice"):
        validate(sched, plan)


def test_duplicate_and_missing_micro_batch():
    plan = straight_plan(4, [0, 2], global_batch_size=3, num_micro_batches=3)
    sched = lower(plan)
    sched[0].append(parse_action("0F1"))
    with pytest.raises(ValidationError, match="device 0: 0F1 appears twice"):
        validate(sched, plan)
    sched = lower(plan)
    for text in ("0F2", "0.0SEND_F2@0", "0.0RECV_B2@0", "0B2"):
        sched[0].remove(parse_action(text))
    with pytest.raises(ValidationError, match="missing F of stage 0 micro-batch 2"):
        validate(sched, plan)


def test_deadlock_from_increasing_warmup():
    # K = [1, 2]: stage 0 waits for B0 before sending F1; stage 1 waits for F1 before B0.
    plan = straight_plan(4, [0, 2], global_batch_size=2, num_micro_batches=2)
    F, B = K.FORWARD, K.BACKWARD
    order = {
        0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        1: [Action(1, F, 0), Action(1, F, 1), Action(1, B, 0), Action(1, B, 1)],
    }
    with pytest.raises(ValidationError, match="deadlock: rank 0 at 0B0, rank 1 at 1F1"):
        validate_compute_order(order, 2, 2)
    with pytest.raises(ValidationError) as e:
        validate(lower(plan, order), plan)
    msg = str(e.value)
    assert "deadlock: device 0 at 0.0RECV_B0@0, device 1 at 1.0RECV_F1@0" in msg
    assert ">>0.0RECV_B0@0<<" in msg and ">>1.0RECV_F1@0<<" in msg


def test_recv_hoisted_to_front_deadlocks():
    plan = straight_plan(6, [0, 2, 4], global_batch_size=4, num_micro_batches=4)
    sched = lower(plan)
    sched[0].insert(0, sched[0].pop(_find(sched[0], "0.0RECV_B0@0")))
    with pytest.raises(ValidationError, match=r"deadlock: device 0 at 0\.0RECV_B0@0"):
        validate(sched, plan)


def test_allreduce_rules():
    plan = _plan_2to1()
    sched = lower(plan)
    sched[0].remove(parse_action("0AR"))
    with pytest.raises(ValidationError, match="stage 0 has 2 replicas but no AR"):
        validate(sched, plan)
    sched = lower(plan)
    sched[1].insert(0, sched[1].pop(_find(sched[1], "0.1AR")))
    with pytest.raises(ValidationError, match="AR of stage 0 before its last backward"):
        validate(sched, plan)
    sched = lower(plan)
    sched[2].insert(0, parse_action("1AR"))
    with pytest.raises(ValidationError, match="on a stage with one replica"):
        validate(sched, plan)


def test_wrong_devices_and_foreign_actions():
    plan = _plan_2to1()
    sched = lower(plan)
    del sched[1]
    with pytest.raises(
        ValidationError, match=r"devices \[0, 2\] differ from the plan's \[0, 1, 2\]"
    ):
        validate(sched, plan)
    sched = lower(plan)
    sched[2][2] = parse_action("0F0")
    with pytest.raises(ValidationError, match="device 2 runs stage 1 replica 0 but step 2 is 0F0"):
        validate(sched, plan)


def test_empty_slice_replica_must_not_compute():
    # b = 2 over 3 replicas: replica 2 gets no samples and only joins AR and OPT.
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 3])
    sched = lower(plan)
    assert [str(a) for a in sched[3]] == ["1.2AR", "1.2AGREE", "1.2OPT"]
    validate(sched, plan)
    sched[3].insert(0, parse_action("1.2F0"))
    with pytest.raises(ValidationError, match="slice of a micro-batch is empty"):
        validate(sched, plan)


def test_compute_order_coverage_errors():
    order = dapple(3, 4)
    order[1] = [a for a in order[1] if str(a) != "1B2"]
    with pytest.raises(
        ValidationError,
        match=r"rank 1: missing backward \(B, or I and W\) of stage 1 micro-batch 2",
    ):
        validate_compute_order(order, 3, 4)
    with pytest.raises(ValidationError, match=r"ranks must be 0..3"):
        validate_compute_order(dapple(3, 4), 4, 4)


def test_grid_is_cut_around_marks_for_long_programs():
    progs = {0: [f"0F{m}" for m in range(100)], 1: [f"1F{m}" for m in range(100)]}
    text = format_grid(progs, [(1, 50)])
    assert ">>1F50<<" in text
    assert "0F48" in text and "0F52" in text and "0F10" not in text
    assert text.count("...") == 2
