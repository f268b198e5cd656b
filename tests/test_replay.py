"""The replayed step of interleaved 1F1B, ZB-H1, ZB-V and DualPipeV (``schedule.replay``):
by hand, and equal to the simulator on straight plans with uneven stages and slow links."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import make_cluster, make_profile
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import interleave, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.schedule_step import schedule_latency
from dapple.errors import ValidationError
from dapple.schedule.interleaved import interleaved
from dapple.schedule.ir import Action, ActionKind
from dapple.schedule.registry import get_schedule
from dapple.schedule.replay import replayed_step_ms
from dapple.schedule.spec import LinkTimes, StageTimes, StepTerms
from dapple.simulate import simulate

MB = 10**6


def _terms(P: int, M: int, v: int, link: LinkTimes) -> StepTerms:
    return StepTerms(
        M=M,
        P=P,
        v=v,
        order=interleaved(P, M, v),
        stages=(StageTimes(1.0, 2.0, 1.0, 1.0),) * (P * v),
        links=(link,) * (P * v - 1),
        tails=(0.5,) * P,
    )


def test_interleaved_by_hand_free_links() -> None:
    """Equal chunks, free links: section 2.2.2's ``(M + (P-1)/v) T`` plus the tail. P = 2, v = 2,
    M = 2: T = 2 (F + B) x 3 = 6, (2 + 1/2) x 6 + 0.5 = 15.5."""
    assert replayed_step_ms(_terms(2, 2, 2, LinkTimes(0.0, 0.0, 0.0))) == pytest.approx(15.5)


def test_interleaved_by_hand_slow_links() -> None:
    """P = 2, v = 2, M = 2, F = 1, B = 2, every transfer 1 ms holding its way out. By hand:
    group 0 F0 0-1, 1-2 (sent 1-2, 2-3); group 1 F1 2-3, 3-4 (sent 3-4, 4-5); group 0 F2 4-5,
    5-6 (sent 5-6, 6-7); group 1 F3 6-7, B3 7-9 (sent 9-10), F3 9-10, B3 10-12 (sent 12-13);
    group 0 B2 10-12 (sent 12-13), B2 13-15 (sent 15-16); group 1 B1 13-15 (sent 15-16),
    B1 16-18 (sent 18-19); group 0 B0 16-18, B0 19-21; plus the tail: 21.5 (15.5 with free
    links). Every chunk crossing costs, in the steady state as in fill and drain."""
    got = replayed_step_ms(_terms(2, 2, 2, LinkTimes(1.0, 1.0, 0.0)))
    assert got == pytest.approx(21.5)


def test_a_deadlocked_order_is_refused() -> None:
    """Group 0 waits for stage 1's backward, which group 1 never runs."""
    t = StepTerms(
        M=1,
        P=2,
        v=1,
        order={0: [Action(0, ActionKind.FORWARD, 0), Action(0, ActionKind.BACKWARD, 0)],
               1: [Action(1, ActionKind.FORWARD, 0)]},
        stages=(StageTimes(1.0, 1.0, 1.0, 1.0),) * 2,
        links=(LinkTimes(0.0, 0.0, 0.0),),
        tails=(0.0, 0.0),
    )  # fmt: skip
    with pytest.raises(ValidationError, match="deadlocks at device groups"):
        replayed_step_ms(t)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, int, int, list[tuple[float, float]], float, float]:
    name = draw(st.sampled_from(["interleaved", "zbh1", "zbv", "dualpipev"]))
    P = draw(st.integers(2, 5))
    v = {"interleaved": draw(st.sampled_from([2, 3])), "zbh1": 1}.get(name, 2)
    M = P * draw(st.integers(1, 3)) if name != "dualpipev" else 2 * P * draw(st.integers(1, 2))
    times = draw(
        st.lists(
            st.tuples(st.floats(0.2, 3.0), st.floats(0.4, 6.0)), min_size=P * v, max_size=P * v
        )
    )
    out_mb = draw(st.sampled_from([0.0, 0.5, 4.0]))
    gbps = draw(st.sampled_from([2.0, 80.0]))
    return name, P, M, times, out_mb, gbps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_replay_equals_the_simulator_on_straight_plans(
    case: tuple[str, int, int, list[tuple[float, float]], float, float],
) -> None:
    """One replica per stage, uneven layers and links from free to slow: the replay is the
    simulated step (the published bubbles of these schedules missed it by -65% to +84%,
    ``benchmarks/step_rules.md``)."""
    name, P, M, times, out_mb, gbps = case
    spec = get_schedule(name)
    n = len(times)
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward=AffineTime(fixed_ms=0.0, per_sample_ms=f),
            backward=AffineTime(fixed_ms=0.0, per_sample_ms=b),
            output_bytes_per_sample=out_mb * MB,
            parameter_bytes=10**6,
            kept_activation_bytes_per_sample=MB,
        )
        for i, (f, b) in enumerate(times)
    )
    profile = ModelProfile(model_name="rand", layers=layers)
    cluster = Cluster(
        name="rand",
        servers=1,
        devices_per_server=P,
        device_memory_bytes=2**36,
        intra_server_bandwidth_gbps=gbps,
        inter_server_bandwidth_gbps=gbps,
        intra_server_latency_ms=0.05,
        inter_server_latency_ms=0.05,
    )
    plan = straight_plan(
        n, list(range(0, n, n // P)), global_batch_size=M, num_micro_batches=M, schedule=name
    )
    if plan.num_stages != P:
        return
    v = n // P
    if v > 1:
        plan = (spec.cut or interleave)(plan, v)
    got = schedule_latency(plan, profile, cluster)
    assert got == pytest.approx(simulate(plan, profile, cluster).step_ms, rel=1e-12, abs=1e-9)


def test_a_replay_too_large_is_refused_before_the_order_is_built() -> None:
    """ZB-H1 on 2 stages at M = 2^21: 12.6 million actions (F, I, W) are refused by name; the
    paper's L of the same stages under DAPPLE costs no order and is not refused."""
    profile, cluster = make_profile(2, act=0.0, params=0), make_cluster(per_server=2)
    M = 1 << 21
    plan = straight_plan(2, [0, 1], global_batch_size=M, num_micro_batches=M, schedule="zbh1")
    with pytest.raises(ValidationError, match=r"M = 2,097,152 micro-batches x 2 stages is "):
        schedule_latency(plan, profile, cluster)
    dapple = straight_plan(2, [0, 1], global_batch_size=M, num_micro_batches=M)
    assert schedule_latency(dapple, profile, cluster) == pytest.approx((M + 1) * 3.0)
