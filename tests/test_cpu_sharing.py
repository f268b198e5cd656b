"""Shared compute (``Cluster.compute_cores_per_server``): processor sharing in the simulator,
its analytic counterpart in the cost model and the fast scorer, the calibration fit."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from builders import make_cluster, make_profile
from dapple.calibrate.machine import _fit, fit_sharing
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.comm import allreduce_ms
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.planner.scorer import Scorer
from dapple.simulate import simulate


def _cluster(per_server: int = 2, servers: int = 1, cores: float | None = None) -> Cluster:
    return dataclasses.replace(
        make_cluster(servers, per_server, gbps=8.0),
        intra_server_latency_ms=0.0,
        inter_server_latency_ms=0.0,
        compute_cores_per_server=cores,
    )


def _free_profile(n: int = 2, params: int = 0) -> ModelProfile:
    """Forward 1 ms / sample, backward 2 ms / sample per layer; no bytes move between stages."""
    return ModelProfile(
        model_name="free",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=1.0),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=2.0),
                output_bytes_per_sample=0.0,
                parameter_bytes=params,
                kept_activation_bytes_per_sample=100.0,
            )
            for i in range(n)
        ),
    )


# -- data model ------------------------------------------------------------------------------


def test_cluster_cores_round_trip_and_old_files():
    c = _cluster(cores=1.5)
    back = Cluster.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.compute_cores_per_server == 1.5 and back == dataclasses.replace(c, name=back.name)
    assert Cluster.from_dict(_cluster().to_dict()).compute_cores_per_server is None
    old = _cluster().to_dict()
    del old["compute_cores_per_server"]  # files written before the field existed
    assert Cluster.from_dict(old).compute_cores_per_server is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "2", True])
def test_cluster_rejects_bad_cores(bad):
    with pytest.raises(ValidationError, match="compute_cores_per_server"):
        _cluster(cores=bad)


# -- simulator -------------------------------------------------------------------------------


def test_two_devices_one_core_hand_computed():
    # 2 stages, M = 2, b = 2: F = 2 ms, B = 4 ms per stage at full speed; transfers are free.
    # DAPPLE K = [2, 1]: dev0 F0 F1 B0 B1, dev1 F0 B0 F1 B1. One core: two at once run at 1/2.
    #   [0, 2]   dev0 F0 alone
    #   [2, 6]   dev0 F1 and dev1 F0 together (2 ms of work each at rate 1/2)
    #   [6, 10]  dev1 B0 alone (dev0 waits for its gradient)
    #   [10, 14] dev0 B0 (2 of 4 ms done) and dev1 F1 (2 ms) together
    #   [14, 18] dev0 B0 (last 2 ms) and dev1 B1 (2 of 4 ms) together
    #   [18, 20] dev1 B1 alone (last 2 ms); [20, 24] dev0 B1 alone          => step 24 ms
    plan = straight_plan(2, [0, 1], global_batch_size=4, num_micro_batches=2)
    r = simulate(plan, _free_profile(), _cluster(cores=1.0))
    assert r.step_ms == pytest.approx(24.0)
    times = {(e.device, str(e.action)): (e.start_ms, e.end_ms) for e in r.events}
    assert times[(0, "0F1")] == pytest.approx((2.0, 6.0))
    assert times[(1, "1F0")] == pytest.approx((2.0, 6.0))
    assert times[(1, "1B0")] == pytest.approx((6.0, 10.0))
    assert times[(0, "0B0")] == pytest.approx((10.0, 18.0))
    assert times[(1, "1F1")] == pytest.approx((10.0, 14.0))
    assert times[(1, "1B1")] == pytest.approx((14.0, 20.0))
    assert times[(0, "0B1")] == pytest.approx((20.0, 24.0))
    # busy = wall time computing (stretched): dev0 2 + 4 + 8 + 4, dev1 4 + 4 + 4 + 6
    assert [d.busy_ms for d in r.devices] == pytest.approx([18.0, 18.0])
    # dedicated devices: the same plan takes 18 ms; 24 = all 24 ms of work on one core
    assert simulate(plan, _free_profile(), _cluster()).step_ms == pytest.approx(18.0)


@pytest.mark.parametrize("cores", [1.0, 1.5, 2.0, 3.0, 4.0, 8.0])
@pytest.mark.parametrize("params", [0, 10**6])
def test_data_parallel_takes_G_over_c_longer(cores, params):
    # 4 replicas of both layers, M = 1, b = 8: each replica computes 2 samples, F + B = 12 ms
    G = 4
    plan = straight_plan(2, [0], global_batch_size=8, num_micro_batches=1, replicas=[G])
    prof = _free_profile(params=params)
    ded = simulate(plan, prof, _cluster(G))
    shared = simulate(plan, prof, _cluster(G, cores=cores))
    ar = allreduce_ms(_cluster(G), 2 * params, tuple(range(G)))
    assert ded.step_ms == pytest.approx(12.0 + ar)
    assert shared.step_ms == pytest.approx(12.0 * max(1.0, G / cores) + ar)
    # the cost model's L agrees exactly for data parallelism
    L = pipeline_latency(plan, prof, _cluster(G, cores=cores)).L_ms
    assert pytest.approx(shared.step_ms) == L


def test_sharing_is_per_server():
    # 2 servers x 2 devices, 1 core each: 2 replicas share each core -> 2x, not 4x
    plan = straight_plan(2, [0], global_batch_size=8, num_micro_batches=1, replicas=[4])
    r = simulate(plan, _free_profile(), _cluster(2, servers=2, cores=1.0))
    assert r.step_ms == pytest.approx(24.0)


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
@pytest.mark.parametrize("S", [2, 3, 4])
def test_alternating_pipeline_never_slows(schedule, S):
    # M = 1: one micro-batch walks forward through the stages and back, one device at a time
    plan = straight_plan(
        S, list(range(S)), global_batch_size=4, num_micro_batches=1, schedule=schedule
    )
    prof = make_profile(S)
    ded = simulate(plan, prof, make_cluster(1, S))
    one_core = dataclasses.replace(make_cluster(1, S), compute_cores_per_server=1.0)
    r = simulate(plan, prof, one_core)
    assert r.step_ms == pytest.approx(ded.step_ms)
    assert pipeline_latency(plan, prof, one_core).L_ms == pytest.approx(
        pipeline_latency(plan, prof, make_cluster(1, S)).L_ms
    )


def _plans() -> st.SearchStrategy[tuple[list[int], list[int], int, str]]:
    """(cut bounds, replicas, M, schedule) of 6-layer plans on at most 4 devices."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[list[int], list[int], int, str]:
        S = draw(st.integers(1, 3))
        inner = sorted(draw(st.sets(st.integers(1, 5), min_size=S - 1, max_size=S - 1)))
        reps = [draw(st.integers(1, 2)) for _ in range(S)]
        M = draw(st.sampled_from([1, 2, 4, 8]))
        return [0, *inner], reps, M, draw(st.sampled_from(["dapple", "gpipe"]))

    return build()


@settings(max_examples=40, deadline=None)
@given(_plans(), st.sampled_from([1.0, 1.5, 2.0, 3.0]), st.sampled_from([0.0, 0.0, 1.5]))
@example(spec=([0, 4, 5], [2, 1, 1], 2, "dapple"), cores=3.0, load=0.0)  # a short warm-up phase
def test_shared_properties(spec, cores, load):
    bounds, reps, M, schedule = spec
    G = sum(reps)
    plan = straight_plan(
        6, bounds, global_batch_size=8, num_micro_batches=M, replicas=reps, schedule=schedule
    )
    prof = make_profile(6)
    cl = make_cluster(1, G)
    ded = simulate(plan, prof, cl)
    # enough cores for every device: identical to dedicated devices, event by event
    big = simulate(plan, prof, dataclasses.replace(cl, compute_cores_per_server=float(G)))
    assert big.step_ms == pytest.approx(ded.step_ms)
    flat = [x for e in ded.events for x in (e.start_ms, e.end_ms)]
    assert [x for e in big.events for x in (e.start_ms, e.end_ms)] == pytest.approx(flat)
    shared_cl = dataclasses.replace(
        cl, compute_cores_per_server=cores, background_load_per_server=load
    )
    worst = 1.0 / shared_cl.compute_rate(G)
    r = simulate(plan, prof, shared_cl)
    # never faster than dedicated; never slower than if every device ran at the worst rate
    assert r.step_ms >= ded.step_ms * (1 - 1e-9)
    assert r.step_ms <= ded.step_ms * worst * (1 + 1e-9)
    if load == 0:  # at most min(c, G) devices' worth of work gets done at once
        work = sum(d.busy_ms for d in ded.devices)
        assert r.step_ms >= work / min(cores, G) * (1 - 1e-9)
    # the analytic L: bounded the same way (a phase's concurrency is capped at the server's
    # devices; within 1e-4: equation 3's pivot may move to a stage whose unstretched comm terms
    # then count once more), and the scorer computes the same number
    L0 = pipeline_latency(plan, prof, cl).L_ms
    L = pipeline_latency(plan, prof, shared_cl).L_ms
    assert L0 * (1 - 1e-9) <= L <= L0 * worst * (1 + 1e-4)
    sc = Scorer(prof, shared_cl, 8)
    stages = [(s.layers[0], s.layers[1], s.devices) for s in plan.stages]
    got = sc.score(stages, M, schedule=schedule, policies=("A",), recompute=False)
    assert got is not None
    assert pytest.approx(L, rel=1e-9) == got.L_ms


def test_compute_rate():
    c = dataclasses.replace(make_cluster(1, 4), compute_cores_per_server=2.0)
    assert [c.compute_rate(k) for k in (0, 1, 2, 3, 4)] == pytest.approx([1, 1, 1, 2 / 3, 0.5])
    assert make_cluster(1, 4).compute_rate(4) == 1.0
    # 2 cores, background load 2: one worker alone already shares (2/3 of a core); 4 -> 1/3
    e = dataclasses.replace(c, background_load_per_server=2.0)
    assert e.compute_rate(4) == pytest.approx(0.5)
    assert e.compute_rate(2) == pytest.approx(0.75)


def test_capacity_bound_on_total_work():
    # 4 devices, balanced 4-stage pipeline, M = 8 on 2 cores: at least half the total work,
    # and the analytic L within 15% of the simulator
    plan = straight_plan(4, [0, 1, 2, 3], global_batch_size=16, num_micro_batches=8)
    prof = _free_profile(4)
    cl = _cluster(4, cores=2.0)
    r = simulate(plan, prof, cl)
    work = sum(d.busy_ms for d in simulate(plan, prof, _cluster(4)).devices)
    assert r.step_ms >= work / 2 * (1 - 1e-9)
    L = pipeline_latency(plan, prof, cl).L_ms
    assert pytest.approx(r.step_ms, rel=0.15) == L


def test_memory_and_in_flight_unchanged_by_sharing():
    plan = straight_plan(2, [0, 1], global_batch_size=8, num_micro_batches=4)
    prof = _free_profile()
    ded = simulate(plan, prof, _cluster())
    r = simulate(plan, prof, _cluster(cores=1.0))
    assert [d.peak_memory_bytes for d in r.devices] == [d.peak_memory_bytes for d in ded.devices]
    assert [d.peak_in_flight for d in r.devices] == [d.peak_in_flight for d in ded.devices]


# -- calibration fit -------------------------------------------------------------------------


def test_fit_with_cores_sets_capacity_and_unit_slowdown():
    sizes = (1 << 10, 1 << 20)
    kw = dict(backend="gloo", memory_bytes=1 << 30)
    # idle 2-core machine, 4 workers: 1, 1, 1.5, 2 x alone -> no background load
    c = _fit(4, sizes, [1.0, 2.0], [1.0, 2.0], alone=1.0, shared=2.0, cores=2.0, **kw).cluster
    sweep = [1.0, 1.0, 1.5, 2.0]
    c = _fit(4, sizes, [1.0, 2.0], [1.0, 2.0], 1.0, 2.0, cores=2.0, sweep=sweep, **kw).cluster
    assert c.compute_slowdown == 1.0 and c.compute_cores_per_server == pytest.approx(2.0)
    assert c.background_load_per_server == pytest.approx(0.0)
    # our session gets about one core's share: every extra busy worker adds its full time
    sweep = [1.0, 2.0, 3.0, 4.0]
    c = _fit(4, sizes, [1.0, 2.0], [1.0, 2.0], 1.0, 4.0, cores=2.0, sweep=sweep, **kw).cluster
    assert c.compute_rate(4) == pytest.approx(0.25)
    # other programs keep 2 threads busy: t_k / t_1 = (k + 2) / 3
    sweep = [(k + 2) / 3 for k in range(1, 5)]
    c = _fit(4, sizes, [1.0, 2.0], [1.0, 2.0], 1.0, 2.0, cores=2.0, sweep=sweep, **kw).cluster
    assert c.compute_rate(4) == pytest.approx(0.5, rel=1e-3)


def test_fit_sharing_recovers_known_curves():
    def curve(c: float, e: float) -> list[float]:
        return [max(1.0, (k + e) / c) / max(1.0, (1 + e) / c) for k in range(1, 5)]

    assert fit_sharing(curve(2.0, 0.0), 2.0) == pytest.approx((2.0, 0.0))  # idle machine
    assert fit_sharing(curve(1.3, 0.0), 2.0) == pytest.approx((1.3, 0.0))  # a session's share
    for c, e in ((2.0, 0.5), (2.0, 2.0), (1.5, 3.0)):  # other threads compete
        got = fit_sharing(curve(c, e), 2.0)
        assert curve(*got) == pytest.approx(curve(c, e), rel=1e-3)


# -- the steady phase's bursts (cost.sharing.steady_stretch) ---------------------------------


@pytest.mark.parametrize(("reps", "cut"), [([3, 1], 5), ([1, 3], 4), ([2, 1, 1], None)])
def test_uneven_replication_l_follows_the_simulators_bursts(reps, cut):
    # 4 devices on 2 cores, 10 layers, M = 8: the replicas of one stage compute in bursts that
    # meet the other stages' at random, which the mean concurrency spreads thin (L 15-20% below
    # the simulator); the bursts' fixed point keeps L within 8%
    bounds = [0, cut] if cut else [0, 2, 5]
    plan = straight_plan(10, bounds, global_batch_size=32, num_micro_batches=8, replicas=reps)
    cl = _cluster(4, cores=2.0)
    prof = _free_profile(10)
    L = pipeline_latency(plan, prof, cl).L_ms
    sim = simulate(plan, prof, cl).step_ms
    assert pytest.approx(sim, rel=0.08) == L


def test_a_single_micro_batch_in_flight_never_overlaps_its_stages():
    # K = 1 on the first stage: the one micro-batch is at one stage at a time, so the second
    # stage's device computes alone; only the first stage's two replicas share (2 on 1 core)
    from dapple.cost.sharing import steady_stretch

    cl = _cluster(3, cores=1.0)
    devices = [[(0, 4.0), (1, 4.0)], None, [(2, 6.0)]]
    beta = steady_stretch(lambda x: [8.0 * x[0] + 6.0 * x[2]] * 3, devices, [1, None, 1], cl)
    assert beta == pytest.approx([2.0, 1.0, 1.0])
    # unbounded: the second stage meets the first's burst for the fraction of time it runs
    beta = steady_stretch(lambda x: [max(4.0 * x[0], 6.0 * x[2])] * 3, devices, [8, None, 8], cl)
    assert beta[0] > 2.0 and beta[2] > 1.0


def test_every_device_busy_gives_the_mean_concurrency():
    # a saturated server (DP-like: every device computes the whole period): G / c, as
    # shared_compute_scale's mean concurrency
    from dapple.cost.sharing import steady_stretch

    cl = _cluster(4, cores=2.0)
    devices = [[(0, 5.0), (1, 5.0)], None, [(2, 5.0), (3, 5.0)]]
    beta = steady_stretch(lambda x: [5.0 * max(x[0], x[2])] * 3, devices, [8, None, 8], cl)
    assert beta == pytest.approx([2.0, 1.0, 2.0], rel=1e-3)


def _random_shared(seed: int):
    import random

    rng = random.Random(seed)
    S = rng.randint(2, 4)
    n = 2 * S
    prof = ModelProfile(
        model_name="rand",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=rng.uniform(0.5, 3.0)),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=rng.uniform(1.0, 6.0)),
                output_bytes_per_sample=rng.choice([0.0, 2.0e5, 1.0e6]),
                parameter_bytes=rng.choice([0, 10**6]),
                kept_activation_bytes_per_sample=100.0,
            )
            for i in range(n)
        ),
    )
    reps = [rng.choice([1, 1, 2, 3]) for _ in range(S)]
    G = sum(reps)
    M = rng.choice([4, 8, 16])
    plan = straight_plan(
        n,
        list(range(0, n, 2)),
        global_batch_size=M * max(reps),
        num_micro_batches=M,
        replicas=reps,
        schedule=rng.choice(["dapple", "dapple", "gpipe"]),
        policy=rng.choice(["A", "B"]),
    )
    cl = dataclasses.replace(
        _cluster(G, cores=max(1.0, rng.choice([0.5, 0.75]) * G)),
        background_load_per_server=rng.choice([0.0, 0.0, 0.5]),
    )
    return plan, prof, cl


def test_l_rarely_under_estimates_shared_cores():
    # 60 seeded random pipelines on shared cores: L below the simulated step by more than 5%
    # in at most 3 and within 10% in at least 53 (1 and 55 here; the mean concurrency alone:
    # 19 and 49)
    errs = []
    for seed in range(60):
        plan, prof, cl = _random_shared(seed)
        L = pipeline_latency(plan, prof, cl).L_ms
        errs.append(L / simulate(plan, prof, cl).step_ms - 1)
    assert sum(e < -0.05 for e in errs) <= 3, sorted(errs)[:6]
    assert sum(abs(e) <= 0.10 for e in errs) >= 53, sorted(errs, key=abs)[-6:]


@pytest.mark.parametrize("schedule", ["zbh1", "interleaved"])
def test_a_step_rule_on_shared_cores_is_at_least_the_servers_capacity(schedule):
    # a step rule replays each device at full speed; four devices on two cores take at least
    # their work over the two cores, as the simulator's processor sharing does
    from dapple.core.plan import interleave
    from dapple.cost.schedule_step import schedule_latency, shared_capacity_ms
    from dapple.cost.terms import stage_terms

    plan = straight_plan(
        8, [0, 2, 4, 6], global_batch_size=16, num_micro_batches=8, schedule=schedule
    )
    if schedule == "interleaved":
        plan = interleave(plan, 2)
    prof = _free_profile(8)
    cl = _cluster(4, cores=2.0)
    got = schedule_latency(plan, prof, cl)
    sim = simulate(plan, prof, cl).step_ms
    work = sum(d.busy_ms for d in simulate(plan, prof, _cluster(4)).devices)
    assert shared_capacity_ms(stage_terms(plan, prof, cl)) == pytest.approx(work / 2)
    assert got >= work / 2 * (1 - 1e-9)
    assert pytest.approx(sim, rel=0.10) == got
    assert schedule_latency(plan, prof, _cluster(4)) < got  # dedicated: the replay alone


# -- one micro-batch (cost.sharing.own_stretch, all_at_once) -----------------------------------


def test_one_micro_batch_shares_each_stage_with_its_own_replicas_alone():
    # 1:3 on 4 devices and 2 cores, M = 1: stage 0 computes alone at full speed, stage 1's 3
    # replicas at 2/3 each; the step's host CPU (4 ms) meets every device's. The mean
    # concurrency over the step gave L 154.0 against 176.0 simulated
    plan = straight_plan(10, [0, 4], global_batch_size=8, num_micro_batches=1, replicas=[1, 3])
    cl = dataclasses.replace(_cluster(4, cores=2.0), step_overhead_ms=4.0)
    prof = _free_profile(10)
    L = pipeline_latency(plan, prof, cl).L_ms
    assert pytest.approx(simulate(plan, prof, cl).step_ms, rel=0.02) == L


def test_one_micro_batch_l_follows_the_simulator_on_random_plans():
    # the 60 random pipelines above at M = 1 with host CPU terms: all within 3% (the mean
    # concurrency: 28 more than 5% low, down to -18%)
    errs = []
    for seed in range(60):
        plan, prof, cl = _random_shared(seed)
        plan = dataclasses.replace(
            plan, num_micro_batches=1, global_batch_size=plan.micro_batch_size
        )
        cl = dataclasses.replace(cl, step_overhead_ms=4.0, action_overhead_ms=0.05)
        L = pipeline_latency(plan, prof, cl).L_ms
        errs.append(L / simulate(plan, prof, cl).step_ms - 1)
    assert max(map(abs, errs)) <= 0.03, sorted(errs, key=abs)[-3:]
