"""The latency kernel (equations 1-3) against brute force and the simulator; the CPU-host pass."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import link_cluster, make_cluster, make_profile, with_in_flight
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.host import HostExtra, apply_host, has_host_terms
from dapple.cost.latency import (
    CYCLE_REACH,
    backward_phases,
    cycle_paced,
    latency,
    steady_periods,
    turn_waits,
)
from dapple.cost.pipeline import pipeline_latency
from dapple.schedule import lower
from dapple.schedule.early_backward import early_backward_order, warmup_counts
from dapple.simulate import simulate

latency_module = sys.modules["dapple.cost.latency"]  # dapple.cost's `latency` is the function


def _brute_force(
    F: list[float], B: list[float], AR: list[float], M: int, K: list[int | None]
) -> tuple[float, int]:
    """L and Q written out term by term: periods from explicit cycle sums, Q by the
    paper's pivot algorithm re-summing the stages between for every candidate not paced by a
    cycle (a cycle-paced one replaces Q on its steady phase alone), and every
    stage's end of the ending phase summed on its own."""
    S = len(F)

    def up(s: int) -> float:  # the gradient sent up before s's forward holds its way out
        inner = s % 2 == 0 and 0 < s < S - 1 and F[s + 1] > 0
        return max(0.0, B[s - 1] - F[s]) if inner else 0.0

    def down(t: int) -> float:  # the activation sent down before t's backward holds it
        inner = t % 2 == 0 and 0 < t < S - 1 and B[t - 1] > 0
        return max(0.0, F[t + 1] - B[t]) if inner else 0.0

    period = []
    for s in range(S):
        rt = sum(F[a] + B[a] for a in range(s, S))
        k = K[s]
        if not k:
            period.append(F[s] + B[s])
            continue
        p = max(F[s] + B[s], (rt + up(s)) / k)
        # the cycles turning at a later stage t: K_s - K_t + 1 micro-batches a lap, for the
        # forwards after the warm-up
        later = [t for t in range(s + 1, S) if K[t]][:CYCLE_REACH]
        for t in later:
            kt = K[t]
            if k <= M - 1 and kt and kt <= k:
                step = k - kt + 1
                laps = (M - 1 - k) // step + 1
                lap = sum(F[a] + B[a] for a in range(s, t + 1)) + up(s) + down(t)
                total = laps * lap + (M - 1 - laps * step) * (F[s] + B[s])
                p = max(p, total / (M - 1))
        period.append(p)
    Q = S - 1
    for s in range(S - 2, -1, -1):
        l1 = (M - 1) * period[s]
        l2 = (M - 1) * period[Q]
        k = K[s]
        if not (k and k < M and period[s] > F[s] + B[s]):  # a cycle-paced stage: no stages between
            l2 += sum(F[a] + B[a] for a in range(s + 1, Q))
        if l1 > l2:
            Q = s
    T_w = sum(F[: Q + 1])
    T_s = (M - 1) * period[Q]
    tail_f, tail_b = sum(F[Q + 1 :]), sum(B[Q + 1 :])
    ends = [tail_b + sum(B[s : Q + 1]) + AR[s] if s <= Q else sum(B[s:]) + AR[s] for s in range(S)]
    T_e = tail_f + max(ends)
    return T_w + T_s + T_e, Q


@st.composite
def _arrays(
    draw: st.DrawFn,
) -> tuple[list[float], list[float], list[float], int, list[int | None]]:
    # integer-valued times: every sum is exact, so both evaluations see the same ties
    S = draw(st.integers(1, 7))
    ms = st.integers(0, 12).map(float)
    F = [draw(ms) for _ in range(S)]
    B = [draw(ms) for _ in range(S)]
    AR = [draw(st.sampled_from([0.0, 0.0, 3.0, 25.0])) for _ in range(S)]
    K = [draw(st.one_of(st.none(), st.integers(1, S))) for _ in range(S)]
    return F, B, AR, draw(st.integers(1, 12)), K


@settings(max_examples=300, deadline=None)
@given(_arrays())
def test_kernel_equals_brute_force_equations(
    arrays: tuple[list[float], list[float], list[float], int, list[int | None]],
) -> None:
    F, B, AR, M, K = arrays
    period = steady_periods(F, B, K, M)
    got = latency(F, B, AR, M, period, cycle_paced(F, B, K, M, period))
    L, Q = _brute_force(F, B, AR, M, K)
    assert got.Q == Q
    assert got.L_ms == pytest.approx(L, rel=1e-12)
    assert got.L_ms == pytest.approx(got.T_w_ms + got.T_s_ms + got.T_e_ms, rel=1e-12)
    # the pivot runs all M micro-batches: L >= M (F_Q + B_Q)
    assert got.L_ms >= M * (F[Q] + B[Q]) * (1 - 1e-12)


def test_kernel_paper_case_without_in_flight_bounds() -> None:
    # no bound: period_s = F_s + B_s, the paper's T_s = (M-1)(F_Q + B_Q)
    F, B, AR = [2.0, 1.0, 3.0], [4.0, 1.0, 6.0], [5.0, 0.0, 0.0]
    assert steady_periods(F, B, [None] * 3, 4) == [6.0, 2.0, 9.0]
    r = latency(F, B, AR, 4, [6.0, 2.0, 9.0])
    assert r.Q == 2
    assert (r.T_w_ms, r.T_s_ms) == (6.0, 27.0)
    assert r.T_e_ms == max(6.0 + 1.0 + 4.0 + 5.0, 6.0)  # stage 0's B and AR end last
    # a bound K_s = 1 makes a stage wait for its round trip
    assert steady_periods(F, B, [1, None, 1], 4) == [17.0, 2.0, 9.0]


def _chain(f: list[int], b: list[int]) -> ModelProfile:
    return ModelProfile(
        model_name="chain",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=float(fi)),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=float(bi)),
                output_bytes_per_sample=0.0,
                parameter_bytes=0,
                kept_activation_bytes_per_sample=1.0,
            )
            for i, (fi, bi) in enumerate(zip(f, b, strict=True))
        ),
    )


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda S: st.tuples(
            st.lists(st.integers(1, 6), min_size=S, max_size=S),
            st.lists(st.integers(1, 6), min_size=S, max_size=S),
        )
    ),
    st.integers(1, 8),
    st.sampled_from(["dapple", "gpipe"]),
    st.sampled_from(["A", "B"]),
    st.booleans(),
)
def test_kernel_equals_the_simulator_on_non_decreasing_stages(
    fb: tuple[list[int], list[int]], M: int, schedule: str, policy: str, one_in_flight: bool
) -> None:
    """One device per stage, nothing to send or all-reduce, F_s and B_s non-decreasing along
    the pipeline: the last stage is the pivot and the schedule has no internal bubbles, so L
    is the exact makespan of the simulated step. Also when each stage holds one micro-batch:
    every period is then the stage's round trip and the first stage, the longest, paces."""
    f, b = sorted(fb[0]), sorted(fb[1])
    S = len(f)
    prof = _chain(f, b)
    cluster = make_cluster(1, S)
    plan = straight_plan(
        S,
        list(range(S)),
        global_batch_size=M,
        num_micro_batches=M,
        schedule=schedule,
        policy=policy,
    )
    if one_in_flight and schedule == "dapple":
        plan = dataclasses.replace(
            plan, stages=tuple(dataclasses.replace(s, max_in_flight=1) for s in plan.stages)
        )
    r = pipeline_latency(plan, prof, cluster)
    if plan.stages[0].max_in_flight is None:
        assert r.Q == r.S - 1
    assert r.L_ms == pytest.approx(simulate(plan, prof, cluster).step_ms, rel=1e-12)


def test_dedicated_cluster_is_the_kernel_alone() -> None:
    """Without host terms L is equations 1-3 over the breakdown's own rows."""
    p, c = make_profile(6, act=1e5, params=10**6), make_cluster(servers=2, per_server=2)
    plan = straight_plan(
        6, [0, 2, 4], global_batch_size=16, num_micro_batches=8, replicas=[2, 1, 1], policy="B"
    )
    assert not has_host_terms(c)
    r = pipeline_latency(plan, p, c)
    F = [x.forward_ms for x in r.stages]
    B = [x.backward_ms for x in r.stages]
    AR = [x.allreduce_ms for x in r.stages]
    K = [x.in_flight if x.kind == "compute" else None for x in r.stages]
    assert AR[0] > 0 and F[1] > 0  # an AllReduce and a comm stage take part
    assert tuple(latency(F, B, AR, 8, steady_periods(F, B, K, 8))) == (
        r.L_ms,
        r.T_w_ms,
        r.T_s_ms,
        r.T_e_ms,
        r.Q,
    )
    # the host pass with nothing to add is the identity
    h = apply_host(
        F, B, AR, K, 8, c, [HostExtra(), None, HostExtra(), None, HostExtra()], lambda s: []
    )
    assert (h.F, h.B, h.AR, h.period, h.step) == (F, B, AR, steady_periods(F, B, K, 8), [0.0] * 5)


def test_host_pass_by_hand() -> None:
    """One stage on 4 devices of a 2-core server, M = 1: the extras join F and B, the step CPU
    joins AR, and the whole step stretches by 4 / 2."""
    c = Cluster(
        servers=1,
        devices_per_server=4,
        device_memory_bytes=2**30,
        intra_server_bandwidth_gbps=100.0,
        inter_server_bandwidth_gbps=100.0,
        step_overhead_ms=1.0,
        compute_cores_per_server=2.0,
    )
    assert has_host_terms(c)
    extra = HostExtra(forward_ms=0.5, backward_ms=0.5, step_ms=1.0)
    h = apply_host([1.0], [2.0], [0.25], [1], 1, c, [extra], lambda s: [(d, 3.0) for d in range(4)])
    assert (h.F, h.B, h.step, h.AR, h.period) == ([3.0], [5.0], [2.0], [2.25], [8.0])
    assert latency(h.F, h.B, h.AR, 1, h.period).L_ms == 3.0 + 5.0 + 2.25
    # dedicated cores: the extras alone, no stretch
    ded = dataclasses.replace(c, compute_cores_per_server=None)
    h = apply_host([1.0], [2.0], [0.25], [1], 1, ded, [extra], lambda s: [])
    assert (h.F, h.B, h.step, h.AR, h.period) == ([1.5], [2.5], [1.0], [1.25], [4.0])


def _bounded_plan(S: int, M: int, D: list[int | None]) -> Plan:
    """A straight DAPPLE plan (policy A) of S one-layer stages with in-flight bounds D."""
    plan = straight_plan(
        S,
        list(range(S)),
        global_batch_size=M,
        num_micro_batches=M,
        schedule="dapple",
        policy="A",
    )
    return with_in_flight(plan, D)


def _bounded(S: int, M: int, D: list[int | None], prof: ModelProfile) -> tuple[float, float]:
    """L and the simulated step of :func:`_bounded_plan`."""
    plan, cluster = _bounded_plan(S, M, D), make_cluster(1, S)
    return pipeline_latency(plan, prof, cluster).L_ms, simulate(plan, prof, cluster).step_ms


def test_equal_counts_pace_by_the_round_trip_between_them() -> None:
    """8 equal stages (F 1, B 2), M = 32, counts K = [4, 4, 4, 4, 4, 3, 2, 1] (stage 0's D = 4
    kept by every stage until its own count falls below it). Stages 0-4 keep 4 in flight alike:
    B_m at stage 0 -> F_{m+4} down to stage 4 -> B_{m+1} there -> back up is a cycle of
    5 (F + B) = 15 per micro-batch; the first 4 micro-batches start in the warm-up, the other
    28 wait on it. The simulator runs exactly that; Little's law alone (RT_0 / 4 = 6) put L at
    210, 0.46x of it."""
    prof, cluster = _chain([1] * 8, [2] * 8), make_cluster(1, 8)
    ks = [4, 4, 4, 4, 4, 3, 2, 1]
    sim = simulate(
        _bounded_plan(8, 32, [None] * 8),
        prof,
        cluster,
        lower(_bounded_plan(8, 32, [None] * 8), early_backward_order(ks, 32)),
    ).step_ms
    F, B = [1.0, 0.0] * 7 + [1.0], [2.0, 0.0] * 7 + [2.0]
    K: list[int | None] = [x for k in ks for x in (k, None)][:-1]
    period = steady_periods(F, B, K, 32)
    # T_w: F_0; 28 laps of 15 and 3 micro-batches at F + B; T_e: the tail's F and every B
    assert latency(F, B, [0.0] * 15, 32, period).L_ms == 1 + (28 * 15 + 3 * 3) + (7 + 16) == sim


def test_a_binding_d_is_shared_by_the_stages_after_it() -> None:
    """The same pipeline with D_0 = 4 as the schedule makes it: the stages after 0 share its 4
    slots, K = [4, 4, 3, 3, 2, 2, 1, 1], and the step takes 210 (453 with the counts above);
    L equals it."""
    assert warmup_counts(8, 32, "A", [4, *[None] * 7]) == [4, 4, 3, 3, 2, 2, 1, 1]
    L, sim = _bounded(8, 32, [4, *[None] * 7], _chain([1] * 8, [2] * 8))
    assert L == sim == 210.0


def test_a_stage_paced_by_its_cycle_paces_the_pivot() -> None:
    """F = [1, 1, 1], B = [1, 2, 2], stage 0's D = 2 (K = [2, 2, 1]), M = 4. Stage 0's cycle
    through stage 1 (B_m at 0, F_{m+2} at 0 and 1, B_{m+1} at 1 and 0: 5 per micro-batch for
    2 laps, then F + B = 2) paces it at 12 / 3 = 4 per micro-batch, above the last stage's
    F + B = 3. By equation 3 with the stages between added, the last stage stayed the pivot
    (12 is not above 9 + 3) and L was 3 + 9 + 5 = 17; the cycle already runs through stage 1,
    so stage 0 is the pivot: L = 1 + 12 + (2 + 5) = 20. The simulator runs it in 21."""
    L, sim = _bounded(3, 4, [2, None, None], _chain([1, 1, 1], [1, 2, 2]))
    assert L == 20.0 and sim == 21.0


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 7).flatmap(
        lambda S: st.tuples(
            st.lists(st.integers(1, 6), min_size=S, max_size=S),
            st.lists(st.integers(1, 6), min_size=S, max_size=S),
            st.lists(st.one_of(st.none(), st.integers(1, S)), min_size=S, max_size=S),
        )
    ),
    st.integers(1, 28),
)
def test_bounded_stages_l_stays_near_the_simulator(
    fbd: tuple[list[int], list[int], list[int | None]], M: int
) -> None:
    """One device per stage, nothing to send, any per-stage bound D: L within -25% / +40% of
    the simulated step (benchmarks/bounded_latency.md). With the counts of a running minimum
    and Little's law alone, L fell to -53%."""
    f, b, D = fbd
    L, sim = _bounded(len(f), M, D, _chain(f, b))
    assert 0.75 * sim <= L <= 1.40 * sim


def _policy_plan(f: list[int], b: list[int], M: int, policy: str) -> tuple[Plan, ModelProfile]:
    plan = dataclasses.replace(_bounded_plan(len(f), M, [None] * len(f)), policy=policy)
    return plan, _chain(f, b)


def test_the_pivots_drain_queues_behind_a_slower_backward_upstream() -> None:
    """F = [1, 4, 1], B = [5, 2, 1], M = 3, policy B: K = [3, 3, 1], pivot stage 1 (F + B = 6).
    Stage 0 runs F 0-3, stage 1 F 1-13 (three forwards of 4), stage 2 F+B 5-7, 9-11, 13-15;
    stage 1 then runs its three backwards 13-19, B_Q = 2 apart, and stage 0, whose backward
    takes 5, queues them: 15-20, 20-25, 25-30. Equations 1-3 charge only the last gradient's
    way up (26); the drain of k - 1 = 2 gradients through B_0 - B_Q = 3 more each gives 30,
    and so does stage 0's backward phase (first gradient at 15, then 3 x 5)."""
    plan, prof = _policy_plan([1, 4, 1], [5, 2, 1], 3, "B")
    cluster = make_cluster(1, 3)
    r = pipeline_latency(plan, prof, cluster)
    assert [x.in_flight for x in r.stages if x.kind == "compute"] == [3, 3, 1]
    assert (r.Q, r.T_w_ms, r.T_s_ms) == (2, 5.0, 12.0)
    assert r.L_ms == simulate(plan, prof, cluster).step_ms == 30.0
    F = [x.forward_ms for x in r.stages]
    B = [x.backward_ms for x in r.stages]
    K = [x.in_flight if x.kind == "compute" else None for x in r.stages]
    assert backward_phases(F, B, [0.0] * 5, K, 3) == 30.0
    # without the counts: the paper's ending phase, one tail after the pivot's last backward
    assert latency(F, B, [0.0] * 5, 3, steady_periods(F, B, K, 3)).L_ms == 5 + 12 + 2 + 2 + 5


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda S: st.tuples(
            st.lists(st.integers(1, 6), min_size=S, max_size=S),
            st.lists(st.integers(1, 6), min_size=S, max_size=S),
        )
    ),
    st.integers(1, 16),
    st.sampled_from(["A", "B"]),
)
def test_backward_phases_never_exceed_the_simulated_step(
    fb: tuple[list[int], list[int]], M: int, policy: str
) -> None:
    """:func:`backward_phases` is a lower bound: every stage's work after its first backward,
    started no sooner than the warm-up's flow of forwards allows, fits in the simulated step;
    and L, which takes it where it is larger, stays at or above it."""
    plan, prof = _policy_plan(*fb, M, policy)
    cluster = make_cluster(1, len(fb[0]))
    r = pipeline_latency(plan, prof, cluster)
    F = [x.forward_ms for x in r.stages]
    B = [x.backward_ms for x in r.stages]
    AR = [x.allreduce_ms + x.host_step_ms for x in r.stages]
    K = [x.in_flight if x.kind == "compute" else None for x in r.stages]
    bound = backward_phases(F, B, AR, K, M)
    assert bound <= simulate(plan, prof, cluster).step_ms * (1 + 1e-12)
    assert r.L_ms >= bound * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 20).flatmap(
        lambda S: st.tuples(
            st.lists(st.floats(0, 5), min_size=2 * S - 1, max_size=2 * S - 1),
            st.lists(st.integers(1, 2 * S), min_size=S, max_size=S),
        )
    ),
    st.integers(1, 40),
)
def test_the_python_and_numpy_cycles_give_the_same_bits(
    fk: tuple[list[float], list[int]], M: int
) -> None:
    """:func:`_longest_laps` in plain Python (small pipelines) and in numpy agree bit for bit."""
    fb, ks = fk
    K: list[int | None] = [x for k in sorted(ks, reverse=True) for x in (k, None)][:-1]
    rt = [0.0] * (len(fb) + 1)
    for s in range(len(fb) - 1, -1, -1):
        rt[s] = rt[s + 1] + fb[s]
    turns = [s for s in range(len(fb)) if K[s]]
    up = [w * (s % 3) for s, w in enumerate(fb)]  # some turning points wait, some not
    down = [w * (s % 2) for s, w in enumerate(reversed(fb))]
    small = latency_module._longest_laps_small(turns, K, rt, fb, M, up, down)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(latency_module, "SMALL_PIPELINE", 0)
        assert latency_module._longest_laps(turns, K, rt, fb, M, up, down) == small


def test_a_cycle_turning_after_a_long_send_waits_for_its_way_out() -> None:
    """3 stages, F = [1, 1, 1], B = [2, 4, 2], D = [None, 1, 1], M = 8, stage 0's output
    taking 3 ms to send and stage 1's 0.5. Stage 1 (K = 1) runs B_m, then F_{m+1}, whose
    activation leaves its device only after B_m's gradient has (3 ms on the same way out,
    against F_1 = 1): its cycle through stage 2 is RT(1..2) = 1 + 4 + 0.5 + 0.5 + 1 + 2 = 9
    plus up_1 = 3 - 1 = 2. The sum of F + B alone put L at 81.0 against the simulated 94.9 (-15%)."""
    F = [1.0, 3.0, 1.0, 0.5, 1.0]
    B = [2.0, 3.0, 4.0, 0.5, 2.0]
    K: list[int | None] = [3, None, 1, None, 1]
    assert turn_waits(F, B) == ([0.0, 0.0, 2.0, 0.0, 0.0], [0.0] * 5)
    assert steady_periods(F, B, K, 8)[2] == 11.0  # 9 + 2; F + B alone: 9
    # end to end, on links of 1e6 bytes per ms and 0.01 ms latency: 1 sample per micro-batch
    prof = _chain([1, 1, 1], [2, 4, 2])
    layers = list(prof.layers)
    for i, nbytes in ((0, 2.99e6), (1, 0.49e6)):
        layers[i] = dataclasses.replace(layers[i], output_bytes_per_sample=nbytes)
    prof = dataclasses.replace(prof, layers=tuple(layers))
    plan, cluster = _bounded_plan(3, 8, [None, 1, 1]), link_cluster("links", 1, 3, 16)
    r = pipeline_latency(plan, prof, cluster)
    assert [x.forward_ms for x in r.stages] == pytest.approx(F)
    assert [x.in_flight for x in r.stages if x.kind == "compute"] == [3, 1, 1]
    assert r.L_ms == pytest.approx(simulate(plan, prof, cluster).step_ms, rel=0.02)
