"""The validator's named steps, each on its own: a rank's actions, its coverage and the
compute order's dry run (:mod:`dapple.schedule.validate_order`); a device's view, the
placement and order of each action, its AllReduces and its optimizer step
(:mod:`dapple.schedule.validate`). ``test_validate`` checks the whole validator."""

from __future__ import annotations

from dapple.core.plan import Plan, StagePlan
from dapple.schedule import lower, parse_action
from dapple.schedule.validate import (
    _allreduce_problems,
    _check_device,
    _device_view,
    _order_problem,
    _peer_maps,
    _placement_problem,
    _scan_actions,
    _step_problems,
    _Where,
    validate,
)
from dapple.schedule.validate_order import (
    _order_deadlock,
    _rank_actions,
    _rank_coverage,
    _run_rank,
)


def _acts(text: str) -> list:
    return [parse_action(t) for t in text.split()]


def _plan_2to1(M: int = 2) -> Plan:
    """Stage 0 on devices 0 and 1 (one sample each), stage 1 on device 2."""
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


def _peers(plan: Plan) -> list[list[dict[int, list[int]]]]:
    return _peer_maps(plan)


def test_peer_maps_of_a_two_to_one_boundary() -> None:
    assert _peer_maps(_plan_2to1()) == [[{}, {0: [0, 1]}], [{0: [0], 1: [0]}, {}]]


# --------------------------------------------------------------------------- compute orders


def test_rank_actions_finds_each_problem_and_where_the_rest_run() -> None:
    problems, seen = _rank_actions(0, _acts("0F0 0F0 0B1 2F0 0F5 0I0 0W0 1F0"), {0}, 2)
    assert [m for m, _ in problems] == [
        "rank 0: 0F0 appears twice",
        "rank 0: 0B1 runs before its F",
        "rank 0 step 3: 2F0 is not a compute action of stages [0]",
        "rank 0 step 4: micro-batch 5 not in [0, 2)",
        "rank 0 step 7: 1F0 is not a compute action of stages [0]",
    ]
    assert [cells for _, cells in problems][:2] == [[(0, 0), (0, 1)], [(0, 2)]]
    assert sorted(seen.values()) == [0, 2, 4, 5, 6]
    assert _rank_actions(0, _acts("0F0 0W0"), {0}, 1)[0][0][0] == "rank 0: 0W0 runs before its I"


def test_rank_coverage_wants_f_and_one_kind_of_backward() -> None:
    _, seen = _rank_actions(1, _acts("1F0 1B0 1I0 1W0 1I1"), {1}, 3)
    assert [m for m, _ in _rank_coverage(1, {1}, seen, 3)] == [
        "rank 1: stage 1 micro-batch 0 runs both B and I/W",
        "rank 1: missing F of stage 1 micro-batch 1",
        "rank 1: missing backward (B, or I and W) of stage 1 micro-batch 1",
        "rank 1: missing F of stage 1 micro-batch 2",
        "rank 1: missing backward (B, or I and W) of stage 1 micro-batch 2",
    ]


def test_run_rank_stops_at_the_first_action_waiting_for_a_neighbour() -> None:
    done: set[tuple[int, bool, int]] = set()
    assert _run_rank(_acts("0F0 0F1 0B0"), 0, done, 2) == 2  # B0 waits for stage 1's B0
    assert done == {(0, True, 0), (0, True, 1)}
    assert _run_rank(_acts("1F0 1B0 1W0"), 0, done, 2) == 3
    assert _run_rank(_acts("0F0 0F1 0B0"), 2, done, 2) == 3


def test_order_deadlock_names_the_waiting_ranks() -> None:
    fine = {0: _acts("0F0 0B0"), 1: _acts("1F0 1B0")}
    assert _order_deadlock(fine, 2) == []
    stuck = {0: _acts("0B0 0F0"), 1: _acts("1F0 1B0")}
    assert _order_deadlock(stuck, 2) == [
        ("deadlock: rank 0 at 0B0, rank 1 at 1F0 wait forever", [(0, 0), (1, 0)])
    ]


# --------------------------------------------------------------------------- lowered schedules


def test_device_view_of_a_replica_and_of_the_stage_it_sends_to() -> None:
    plan = _plan_2to1()
    d1 = _device_view(plan, 1, _peers(plan))
    assert (d1.group, d1.replica, d1.owned, d1.parallel.replicas, d1.M, d1.active) == (
        0,
        1,
        (0,),
        2,
        2,
        True,
    )
    assert (d1.prev_peers, d1.next_peers) == ({0: set()}, {0: {0}})
    d2 = _device_view(plan, 2, _peers(plan))
    assert (d2.prev_peers, d2.next_peers) == ({1: {0, 1}}, {1: set()})


def test_placement_problem_wrong_stage_range_and_repeat() -> None:
    plan = _plan_2to1()
    d = _device_view(plan, 2, _peers(plan))
    where: _Where = {(parse_action("1F0").kind, 1, 0, None): 0}
    assert _placement_problem(d, 1, parse_action("0F0"), where) == (
        "device 2 runs stage 1 replica 0 but step 1 is 0F0",
        [(2, 1)],
    )
    assert _placement_problem(d, 1, parse_action("1F7"), where) == (
        "device 2 step 1: micro-batch 7 not in [0, 2)",
        [(2, 1)],
    )
    assert _placement_problem(d, 3, parse_action("1F0"), where) == (
        "device 2: 1F0 appears twice",
        [(2, 0), (2, 3)],
    )
    assert _placement_problem(d, 1, parse_action("1B0"), where) is None


def test_order_problem_each_rule() -> None:
    plan = _plan_2to1()
    d0, d2 = (_device_view(plan, dev, _peers(plan)) for dev in (0, 2))
    empty: _Where = {}
    cases = [
        (d0, "0.0SEND_F0@1", "device 0: 0.0SEND_F0@1 but replica 1 of stage 1 is no split-"),
        (d2, "1.0RECV_F0@2", "device 2: 1.0RECV_F0@2 but replica 2 of stage 0 is no split-"),
        (d2, "1B0", "device 2: 1B0 runs before its forward"),
        (d0, "0.0SEND_F0@0", "device 0: 0.0SEND_F0@0 sends before its forward"),
        (d2, "1W0", "device 2: 1W0 runs before its input gradient I"),
        (d2, "1.0SEND_B0@0", "device 2: 1.0SEND_B0@0 sends before its backward"),
        (d2, "1AR", "device 2: 1AR on a stage with one replica"),
    ]
    for d, text, want in cases:
        got = _order_problem(d, 4, parse_action(text), empty)
        assert got is not None and got[0].startswith(want) and got[1] == [(d.dev, 4)], text
    assert _order_problem(d0, 0, parse_action("0F0"), empty) is None


def test_scan_allreduce_and_step_of_a_lowered_program() -> None:
    plan = _plan_2to1()
    prog = lower(plan)[0]
    d = _device_view(plan, 0, _peers(plan))
    problems, where = _scan_actions(d, prog)
    assert problems == [] and len(where) == len(prog)
    assert _allreduce_problems(d, where) == [] and _step_problems(d, where) == []
    assert _check_device(plan, 0, prog, _peers(plan)) == []
    late_ar = [a for a in prog if str(a) != "0AR"]
    late_ar.insert(late_ar.index(parse_action("0B0")), parse_action("0AR"))
    _, where = _scan_actions(d, late_ar)
    at = [str(a) for a in late_ar].index("0AR")
    assert _allreduce_problems(d, where) == [
        ("device 0: AR of stage 0 before its last backward", [(0, at)])
    ]
    assert _step_problems(d, where) == []
    no_ar = [a for a in prog if str(a) != "0AR"]
    _, where = _scan_actions(d, no_ar)
    assert _allreduce_problems(d, where) == [("device 0: stage 0 has 2 replicas but no AR", [])]
    _, where = _scan_actions(d, [a for a in prog if str(a) != "0OPT"])
    assert _step_problems(d, where) == [("device 0: no optimizer step (OPT) on stage 0", [])]
    opt_first = [parse_action("0OPT"), *(a for a in prog if str(a) != "0OPT")]
    _, where = _scan_actions(d, opt_first)
    assert _step_problems(d, where) == [
        ("device 0: OPT before the last backward/AR/step point", [(0, 0)])
    ]
    validate(lower(plan), plan)
