"""Interleaved 1F1B and ZB-H1 as data: golden tables, their published bubbles, lowering with
uneven replication, and bad input.

How the golden tables were checked: each table was written out by hand from the schedules'
published rules, then its step time was checked against the published bubble formula by an
independent list-scheduling of the compute order (``_unit_time`` below, not the simulator).

* Interleaved 1F1B, Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC 2021), section 2.2.2 and Figure 4 (bottom: 4 devices,
  2 chunks, 8 micro-batches). Rules (section 2.2.2 and Megatron-LM's interleaved schedule):
  rank g warms up with 2(P-g-1) + (v-1)P forwards, groups of P micro-batches visit the chunks
  depth first, then one forward / one backward. Published bubble: (P-1)(t_f+t_b)/v, i.e.
  with chunk costs F = 1, B = 2 a step of 3Mv + 3(P-1) units.
* ZB-H1, Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 2.1 and Figure 3
  (top). Rules: 1F1B's warm-up (S-i-1 forwards), B (our ``I``) in 1F1B's place, and stage i
  delays its W passes by i micro-batches, so every stage holds at most S micro-batches from F
  to W. Published bubble with T_F = T_B = T_W: (p-1)(T_F+T_B-T_W), a step of 3M + S - 1.

The figures themselves are images that were not re-read cell by cell here: the tables are
checked against the rules in the text and against the bubble sizes the figures illustrate.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime_workloads as rw
from dapple.core.plan import Plan, StagePlan, interleave, straight_plan
from dapple.errors import ValidationError
from dapple.schedule import (
    ActionKind,
    ComputeOrder,
    compute_order,
    format_actions,
    interleaved,
    interleaved_warmup,
    lower,
    parse_action,
    zbh1,
)
from dapple.schedule.validate import validate, validate_compute_order

K = ActionKind
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _table(order: ComputeOrder) -> list[str]:
    return [format_actions(order[g]) for g in sorted(order)]


INTERLEAVED = {
    # (P, M, v): per-rank order; rank g runs stages g, g+P, ...
    (2, 4, 2): [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ],
    (4, 8, 2): [
        # warm-up 10: chunk 0 of micro-batches 0-3, chunk 1 of 0-3, chunk 0 of 4-5
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 "
        "0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
        "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 "
        "1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 "
        "5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",
        "2F0 2F1 2F2 2F3 6F0 6F1 "
        "6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 "
        "6B6 6B7 2B4 2B5 2B6 2B7",
        "3F0 3F1 3F2 3F3 "
        "7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 "
        "7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7",
    ],
}

ZBH1 = {
    (3, 4): [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ],
    (4, 6): [
        "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5",
        "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5",
        "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5",
        "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5",
    ],
}


def _unit_time(order: ComputeOrder, n_stages: int, cost: dict[str, float]) -> float:
    """Step time of a compute order with per-kind costs and free communication, by list
    scheduling: each rank runs its actions in order, F_m on s waits for F_m on s-1 and B_m/I_m
    on s for B_m/I_m on s+1."""
    done: dict[tuple[int, str, int], float] = {}
    t = dict.fromkeys(order, 0.0)
    pc = dict.fromkeys(order, 0)
    progress = True
    while progress:
        progress = False
        for g in order:
            while pc[g] < len(order[g]):
                a = order[g][pc[g]]
                k, s, m = a.kind.value, a.stage, a.micro_batch
                assert m is not None
                grad = k in ("B", "I")
                dep = (s - 1, "F", m) if k == "F" and s > 0 else None
                if grad and s < n_stages - 1:
                    dep = (s + 1, "G", m)
                if dep is not None and dep not in done:
                    break
                start = max(t[g], done[dep] if dep else 0.0)
                t[g] = done[(s, "G" if grad else k, m)] = start + cost[k]
                pc[g] += 1
                progress = True
    assert all(pc[g] == len(order[g]) for g in order)
    return max(t.values())


@pytest.mark.parametrize("key", sorted(INTERLEAVED))
def test_interleaved_golden(key):
    P, M, v = key
    order = interleaved(P, M, v)
    assert _table(order) == INTERLEAVED[key]
    validate_compute_order(order, P, M, v)
    # published bubble: (P-1) (t_f + t_b) / v with chunk costs F=1, B=2 (t_f = v, t_b = 2v)
    assert _unit_time(order, P * v, {"F": 1, "B": 2}) == 3 * M * v + 3 * (P - 1)


@pytest.mark.parametrize("key", sorted(ZBH1))
def test_zbh1_golden(key):
    S, M = key
    order = zbh1(S, M)
    assert _table(order) == ZBH1[key]
    validate_compute_order(order, S, M)
    assert _unit_time(order, S, {"F": 1, "I": 1, "W": 1}) == 3 * M + S - 1


@FAST
@given(P=st.integers(1, 5), rounds=st.integers(1, 3), v=st.integers(1, 4))
def test_interleaved_bubble_is_published_one(P, rounds, v):
    M = P * rounds
    order = interleaved(P, M, v)
    validate_compute_order(order, P, M, v)
    assert _unit_time(order, P * v, {"F": 1, "B": 2}) == 3 * M * v + 3 * (P - 1)
    # one F and one B per (stage, micro-batch); rank g only runs its own chunks
    for g, acts in order.items():
        assert {a.stage for a in acts} == set(range(g, P * v, P))
        assert len(acts) == 2 * M * v


@FAST
@given(S=st.integers(1, 6), M=st.integers(1, 10))
def test_zbh1_bubble_and_in_flight(S, M):
    order = zbh1(S, M)
    validate_compute_order(order, S, M)
    if M >= S:
        assert _unit_time(order, S, {"F": 1, "I": 1, "W": 1}) == 3 * M + S - 1
    # at most min(S, M) micro-batches between F and W on every stage (1F1B's stage-0 peak)
    for acts in order.values():
        live = peak = 0
        for a in acts:
            live += {K.FORWARD: 1, K.BACKWARD_WEIGHT: -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak == min(S, M)
    # ZB-H1 never takes longer than 1F1B (DAPPLE policy A) with the same costs
    one_f_one_b = compute_order("dapple", S, M)
    assert _unit_time(order, S, {"F": 1, "I": 1, "W": 1}) <= _unit_time(
        one_f_one_b, S, {"F": 1, "B": 2}
    )


def test_new_kinds_round_trip():
    for text in ("2I0", "2W7", "1.3I4", "0.1W2"):
        assert str(parse_action(text)) == text
    assert parse_action("3W1").kind is K.BACKWARD_WEIGHT
    assert parse_action("3I1").kind is K.BACKWARD_INPUT
    assert K.BACKWARD_INPUT.is_compute and K.BACKWARD_WEIGHT.is_compute
    assert not K.BACKWARD_WEIGHT.sends_gradient


def _plan(reps: list[int], layers_per_stage: int, M: int, b: int, **kw) -> Plan:
    S = len(reps)
    return straight_plan(
        S * layers_per_stage,
        [s * layers_per_stage for s in range(S)],
        global_batch_size=b * M,
        num_micro_batches=M,
        replicas=reps,
        **kw,
    )


def test_interleave_places_chunks_round_robin():
    plan = interleave(_plan([2, 1], 4, 4, 4), 2)
    assert plan.num_stages == 4 and plan.num_groups == 2 and plan.virtual_stages == 2
    assert [st.layers for st in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [st.devices for st in plan.stages] == [(0, 1), (2,), (0, 1), (2,)]
    assert plan.stages_of_device(1) == (0, 2) and plan.stages_of_device(2) == (1, 3)
    assert plan.devices == (0, 1, 2) and plan.replication == "2:1"
    assert Plan.from_dict(plan.to_dict()) == plan
    plan = dataclasses.replace(_plan([2, 1], 4, 4, 4), mean_seq_len=96, max_seq_len=128)
    sized = interleave(plan, 2)
    assert (sized.mean_seq_len, sized.max_seq_len) == (96, 128)


def test_lowered_interleaved_2_to_1_golden():
    """P=2 groups (2:1), v=2, M=2, b=2: the 2-replica group splits each micro-batch; chunk
    boundaries 1|2 and 2|3 cross back and forth between the groups with split-concat."""
    plan = interleave(_plan([2, 1], 2, 2, 2), 2)
    sched = lower(plan)
    assert format_actions(sched[2]) == (
        "1.0RECV_F0@0 1.0RECV_F0@1 1F0 1.0SEND_F0@0 1.0SEND_F0@1 "
        "1.0RECV_F1@0 1.0RECV_F1@1 1F1 1.0SEND_F1@0 1.0SEND_F1@1 "
        "3.0RECV_F0@0 3.0RECV_F0@1 3F0 3B0 3.0SEND_B0@0 3.0SEND_B0@1 "
        "3.0RECV_F1@0 3.0RECV_F1@1 3F1 3B1 3.0SEND_B1@0 3.0SEND_B1@1 "
        "1.0RECV_B0@0 1.0RECV_B0@1 1B0 1.0SEND_B0@0 1.0SEND_B0@1 "
        "1.0RECV_B1@0 1.0RECV_B1@1 1B1 1.0SEND_B1@0 1.0SEND_B1@1 1AGREE 1OPT"
    )
    assert format_actions(sched[1]).endswith("2.1AR 0.1AR 0.1AGREE 0.1OPT")
    validate(sched, plan)


def test_lowered_zbh1_sends_after_input_gradient():
    plan = _plan([1, 2], 1, 2, 2, schedule="zbh1")
    sched = lower(plan)
    assert format_actions(sched[0]) == (
        "0F0 0.0SEND_F0@0 0.0SEND_F0@1 0F1 0.0SEND_F1@0 0.0SEND_F1@1 "
        "0.0RECV_B0@0 0.0RECV_B0@1 0I0 0W0 0.0RECV_B1@0 0.0RECV_B1@1 0I1 0W1 0AGREE 0OPT"
    )
    assert format_actions(sched[1]) == (
        "1.0RECV_F0@0 1F0 1I0 1.0SEND_B0@0 1.0RECV_F1@0 1F1 1I1 1.0SEND_B1@0 1W0 1W1 1AR 1AGREE 1OPT"
    )
    validate(sched, plan)


@FAST
@given(
    reps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    v=st.integers(1, 3),
    rounds=st.integers(1, 3),
    b=st.integers(1, 5),
)
def test_lowered_interleaved_validates(reps, v, rounds, b):
    M = len(reps) * rounds
    plan = interleave(_plan(reps, v, M, b), v)
    validate(lower(plan), plan)


@FAST
@given(
    reps=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    M=st.integers(1, 6),
    b=st.integers(1, 5),
)
def test_lowered_zbh1_validates(reps, M, b):
    plan = _plan(reps, 1, M, b, schedule="zbh1")
    validate(lower(plan), plan)


def test_validator_catches_broken_new_schedules():
    plan = _plan([1, 1], 1, 2, 1, schedule="zbh1")
    sched = lower(plan)
    sched[1] = [a for a in sched[1] if str(a) != "1W0"]
    with pytest.raises(ValidationError, match="missing W of stage 1 micro-batch 0"):
        validate(sched, plan)
    sched = lower(plan)
    sched[1].remove(parse_action("1W1"))
    sched[1].insert(0, parse_action("1W1"))
    with pytest.raises(ValidationError, match="1W1 runs before its input gradient I"):
        validate(sched, plan)
    order = interleaved(2, 2, 2)
    order[0].insert(0, order[0].pop(order[0].index(parse_action("2F0"))))
    with pytest.raises(ValidationError, match="deadlock: rank 0 at 2F0"):
        validate_compute_order(order, 2, 2, 2)
    order = zbh1(2, 2)
    order[0].append(parse_action("0B0"))
    with pytest.raises(ValidationError, match=r"0B0 appears|runs both B and I/W"):
        validate_compute_order(order, 2, 2)


def test_bad_input_names_values():
    with pytest.raises(
        ValidationError, match=r"v=2 chunks do not divide the 3 layers \[0, 3\] of stage 0"
    ):
        interleave(_plan([1, 1], 3, 2, 1), 2)
    with pytest.raises(ValidationError, match="fewer layers than chunks"):
        interleave(_plan([1, 1], 2, 2, 1), 4)
    with pytest.raises(ValidationError, match="M=3 to be a multiple of the pipeline ranks P=2"):
        interleaved(2, 3, 2)
    with pytest.raises(ValidationError, match="P=0, M=2, v=1"):
        interleaved_warmup(0, 2, 1)
    with pytest.raises(ValidationError, match="S=0, M=1"):
        zbh1(0, 1)
    with pytest.raises(ValidationError, match="virtual_stages=2 needs schedule='interleaved'"):
        compute_order("zbh1", 2, 2, v=2)
    base = _plan([1, 1], 2, 2, 1)
    with pytest.raises(
        ValidationError,
        match="plan: virtual_stages=2 needs schedule='interleaved', 'zbv' or 'dualpipev', got 'dapple'",
    ):
        dataclasses.replace(base, virtual_stages=2)
    with pytest.raises(
        ValidationError, match=r"virtual stage 2 must run on the devices of stage 0 \[0\]"
    ):
        Plan(
            planner="t",
            global_batch_size=2,
            micro_batch_size=1,
            num_micro_batches=2,
            schedule="interleaved",
            virtual_stages=2,
            stages=tuple(
                StagePlan(layers=(i, i + 1), devices=(d,)) for i, d in enumerate((0, 1, 2, 1))
            ),
        )
    with pytest.raises(
        ValidationError,
        match="schedule must be one of gpipe, dapple, interleaved, zbh1, zbv, dualpipev, got",
    ):
        dataclasses.replace(base, schedule="zigzag")


def test_runtime_refuses_interleaved_it_cannot_run(tmp_path, capsys):
    """One device group (nothing to interleave), M not a multiple of the groups: one error
    line before any process starts (sharded state is accepted)."""
    from dapple.cli import main
    from dapple.runtime import validate_run

    one_group = interleave(_plan([2], 4, 4, 2), 2)
    with pytest.raises(ValidationError, match="no pipeline to interleave"):
        validate_run(one_group, rw.mlp(4), 2)
    odd = interleave(_plan([1, 1, 1], 2, 4, 1), 2)
    with pytest.raises(ValidationError, match="M=4 to be a multiple of the pipeline ranks P=3"):
        validate_run(odd, rw.mlp(6), 3)
    chunks = interleave(_plan([1, 1], 2, 2, 1), 2)
    validate_run(chunks, rw.mlp(4), 2)
    validate_run(chunks, rw.mlp(4), 2, zero_stage=1)
    path = tmp_path / "plan.json"
    one_group.save(path)
    assert main(["train", "--plan", str(path), "-m", "mlp", "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert err.count("dapple: error:") == 1 and "no pipeline to interleave" in err
