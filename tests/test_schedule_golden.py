"""Golden tables: exact GPipe / DAPPLE compute orders and one lowered 2:1 schedule.

Tables are written by hand from the paper (section 4.2 and 6.3): GPipe runs all M forwards then
all M backwards; DAPPLE runs K_i forwards (policy A: K_i = min(S-i, D), B: min(2(S-i)-1, D),
never above M), then alternates one backward and one forward, then drains the backwards.
"""

from __future__ import annotations

import pytest

from dapple.core.plan import Plan, StagePlan
from dapple.schedule import dapple, format_actions, gpipe, lower, warmup_counts
from dapple.schedule.validate import validate, validate_compute_order


def _table(order: dict) -> list[str]:
    return [format_actions(order[s]) for s in sorted(order)]


GPIPE = {
    (2, 1): ["0F0 0B0", "1F0 1B0"],
    (2, 2): ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
    (3, 4): [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    ],
}

DAPPLE = {
    # (S, M, policy): per-stage order
    (2, 1, "A"): ["0F0 0B0", "1F0 1B0"],
    (2, 4, "A"): ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"],
    (2, 4, "B"): ["0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"],
    (3, 5, "A"): [
        "0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0B3 0B4",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1B4",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4",
    ],
    (3, 5, "B"): [
        "0F0 0F1 0F2 0F3 0F4 0B0 0B1 0B2 0B3 0B4",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1B3 1B4",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4",
    ],
    (4, 2, "A"): [
        "0F0 0F1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
        "2F0 2F1 2B0 2B1",
        "3F0 3B0 3F1 3B1",
    ],
    (4, 5, "A"): [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0B2 0B3 0B4",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1B3 1B4",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2B4",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4",
    ],
    (4, 4, "B"): [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2B0 2F3 2B1 2B2 2B3",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3",
    ],
}


@pytest.mark.parametrize(("S", "M"), sorted(GPIPE))
def test_gpipe_golden(S, M):
    order = gpipe(S, M)
    assert _table(order) == GPIPE[(S, M)]
    validate_compute_order(order, S, M)


@pytest.mark.parametrize(("S", "M", "policy"), sorted(DAPPLE))
def test_dapple_golden(S, M, policy):
    order = dapple(S, M, policy)
    assert _table(order) == DAPPLE[(S, M, policy)]
    validate_compute_order(order, S, M)


def test_dapple_memory_bound_d():
    # D = 2 caps K_0 = 3 to 2; K stays non-increasing: [2, 2, 1].
    assert warmup_counts(3, 5, "A", 2) == [2, 2, 1]
    assert _table(dapple(3, 5, "A", 2)) == [
        "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0B4",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1B4",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4",
    ]


def test_lowered_2_to_1_golden():
    # Stage 0 on devices 0, 1 (one sample each of b = 2), stage 1 on device 2 concatenates them.
    plan = Plan(
        planner="manual",
        global_batch_size=4,
        micro_batch_size=2,
        num_micro_batches=2,
        stages=(
            StagePlan(layers=(0, 2), devices=(0, 1)),
            StagePlan(layers=(2, 4), devices=(2,)),
        ),
    )
    sched = lower(plan)
    assert {d: format_actions(p) for d, p in sched.items()} == {
        0: "0F0 0.0SEND_F0@0 0F1 0.0SEND_F1@0 0.0RECV_B0@0 0B0 0.0RECV_B1@0 0B1 0AR 0AGREE 0OPT",
        1: "0.1F0 0.1SEND_F0@0 0.1F1 0.1SEND_F1@0 0.1RECV_B0@0 0.1B0 0.1RECV_B1@0 0.1B1 0.1AR 0.1AGREE 0.1OPT",
        2: "1.0RECV_F0@0 1.0RECV_F0@1 1F0 1B0 1.0SEND_B0@0 1.0SEND_B0@1 "
        "1.0RECV_F1@0 1.0RECV_F1@1 1F1 1B1 1.0SEND_B1@0 1.0SEND_B1@1 1AGREE 1OPT",
    }
    validate(sched, plan)
