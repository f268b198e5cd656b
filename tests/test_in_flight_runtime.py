"""DAPPLE plans whose stages keep fewer micro-batches in flight than their schedule count (a
memory bound D) run on the runtime exactly as lowered: the stages after a binding D share its
slots (:func:`dapple.schedule.early_backward.warmup_counts`), and ``verify`` equals one device."""

from __future__ import annotations

import dataclasses

import pytest

from builders import with_in_flight
from dapple import api
from dapple.core.plan import straight_plan
from dapple.schedule.registry import in_flight_counts


@pytest.mark.slow
def test_verify_plans_bounded_below_their_counts() -> None:
    """4 straight stages with D_0 = 2 (counts [2, 2, 1, 1] under policy A, M = 8) and 1:2:1
    with D_0 = 1 under policy B (counts [1, 1, 1]), both equal to one device under AdamW."""
    zoo = api.load("transformer", layers=4, hidden=16, heads=2, seq=8)
    n = zoo.num_layers
    four = with_in_flight(
        straight_plan(n, [0, 2, 3, 4], global_batch_size=16, num_micro_batches=8),
        [2, None, None, None],
    )
    three = with_in_flight(
        dataclasses.replace(
            straight_plan(
                n, [0, 2, 4], global_batch_size=16, num_micro_batches=8, replicas=[1, 2, 1]
            ),
            policy="B",
        ),
        [1, None, None],
    )
    counts = [
        in_flight_counts(
            p.schedule,
            p.num_stages,
            p.num_micro_batches,
            p.policy,
            [st.max_in_flight for st in p.stages],
        )
        for p in (four, three)
    ]
    assert counts == [[2, 2, 1, 1], [1, 1, 1]]
    reports = api.verify_many([(four, zoo), (three, zoo)], 3, device="cpu", optimizer="adamw")
    for rep in reports:
        assert rep.ok, (rep.plan.replication, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)
