"""Mixed devices at run time (issue #43): the shares the planner gives replicas of different
speeds, run on an emulated two-speed CPU cluster (``DAPPLE_SLOWDOWN``).

``tests/test_shares.py`` verifies hand-written 3:1 and 1:3 shares under gpipe, dapple, ZB-H1 and
interleaved 1F1B with ZeRO-1/2, every rank at full speed; this file verifies every schedule
(gpipe, dapple, ZB-H1, interleaved 1F1B, ZB-V, DualPipeV) on the shares the planner derives from
a cluster with device kinds, with the slow rank really slowed."""

from __future__ import annotations

import dataclasses

import pytest

from builders import make_profile
from dapple import api
from dapple.core.cluster import GIB, Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.plan import Plan, straight_plan
from dapple.planner.shares import with_kind_shares
from dapple.runtime.slowdown import SLOWDOWN_ENV
from dapple.simulate.plan_variants import with_schedule

SLOW = 3.0
"""Rank 1 is 3 times slower than the others, in the cluster and in DAPPLE_SLOWDOWN."""


def two_speed_cluster() -> Cluster:
    """Three one-device servers: rank 0 at speed 1, rank 1 at 1/3, rank 2 at 1."""
    kinds = (
        DeviceKind(name="fast", servers=1, speed=1.0, device_memory_bytes=GIB),
        DeviceKind(name="slow", servers=1, speed=1 / SLOW, device_memory_bytes=GIB),
        DeviceKind(name="fast2", servers=1, speed=1.0, device_memory_bytes=GIB),
    )
    return Cluster(servers=3, devices_per_server=1, device_memory_bytes=GIB,
                   intra_server_bandwidth_gbps=10, inter_server_bandwidth_gbps=10,
                   kinds=kinds)  # fmt: skip


def planned_shares(
    schedule: str, M: int, virtual_stages: int = 1, policy: str | None = None
) -> Plan:
    """A 2-stage plan (stage 0 on ranks 0 and 1, stage 1 on rank 2) under ``schedule`` (with
    ``virtual_stages`` chunks, and ``policy``), stage 0's shares from the planner's balance of
    the two speeds."""
    base = straight_plan(4, [0, 2], global_batch_size=4 * M, num_micro_batches=M,
                         replicas=[2, 1])  # fmt: skip
    shared = with_kind_shares(base, make_profile(4), two_speed_cluster())
    return with_schedule(shared, schedule, virtual_stages, policy)


EVERY_SCHEDULE = [("gpipe", 2, 1, "A"), ("dapple", 2, 1, "A"), ("dapple", 4, 1, "B"),
                  ("zbh1", 2, 1, "A"), ("interleaved", 2, 2, "A"), ("zbv", 2, 1, "A"),
                  ("dualpipev", 4, 1, "A")]  # fmt: skip
"""(schedule, M, chunks per device group, policy) of every built-in schedule and policy."""


def test_planner_gives_the_slow_rank_the_smaller_share() -> None:
    plan = planned_shares("dapple", 2)
    assert plan.stages[0].shares == (3, 1) and plan.stages[1].shares is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_every_schedule_with_planned_shares_on_two_speeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every schedule with stage 0 split 3:1 between a fast and a 3x slower rank: after 2
    AdamW steps every parameter and loss equal one device's."""
    from dapple.schedule.registry import builtin_schedules

    every = sorted((x.name, p) for x in builtin_schedules() for p in x.policies)
    assert sorted((s, p) for s, _, _, p in EVERY_SCHEDULE) == every
    monkeypatch.setenv(SLOWDOWN_ENV, f"1:{SLOW:g}")
    wl = api.load("runtime_workloads:mlp")
    plans = [planned_shares(*x) for x in EVERY_SCHEDULE]
    for p in plans:
        assert any(s.shares == (3, 1) for s in p.stages), p.stages
    reports = api.verify_many([(p, wl) for p in plans], 2, device="cpu", optimizer="adamw",
                              lr=0.02, weight_decay=0.1)  # fmt: skip
    for plan, rep in zip(plans, reports, strict=True):
        assert rep.ok, (plan.schedule, rep.max_abs_diff)
        assert rep.grad_norms_ok, (plan.schedule, rep.grad_norms, rep.reference_grad_norms)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), plan.schedule


def test_emulated_cluster_speeds() -> None:
    c = two_speed_cluster()
    assert [c.speed_of(d) for d in range(3)] == [1.0, 1 / SLOW, 1.0]
    assert dataclasses.replace(c, kinds=()).speed_of(1) == 1.0
