"""CPU time to wall time (``Cluster.lone_wall_per_cpu``, ``ModelProfile.clock``,
:mod:`dapple.cost.cpu_clock`): a CPU-time profile on a machine other programs load."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dapple.calibrate.compute_share import _matmul_times, lone_wall_per_cpu
from dapple.calibrate.machine import _fit
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.cpu_clock import on_wall_clock
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.planner.scorer import Scorer
from dapple.simulate import simulate

SIZES = (1 << 10, 1 << 20)


def _profile(clock: str = "cpu", n: int = 2, params: int = 0) -> ModelProfile:
    """Forward 1 ms / sample, backward 2 ms / sample per layer; no bytes move between stages."""
    layer = LayerProfile(
        name="l",
        forward=AffineTime(fixed_ms=0.0, per_sample_ms=1.0),
        backward=AffineTime(fixed_ms=0.0, per_sample_ms=2.0),
        output_bytes_per_sample=0.0,
        parameter_bytes=params,
        kept_activation_bytes_per_sample=100.0,
    )
    return ModelProfile(model_name="t", layers=(layer,) * n, clock=clock)


def _ticking(ms_per_read: float):
    """A clock that advances ``ms_per_read`` at every read after the first."""
    state = {"t": 0.0, "reads": 0}

    def clock() -> float:
        if state["reads"]:
            state["t"] += ms_per_read / 1e3
        state["reads"] += 1
        return state["t"]

    return clock


def _sweep(wall_per_cpu: list[float]) -> tuple[list[float], list[float]]:
    """The calibration matmul timed in both clocks with k = 1 .. len busy workers, each on
    fake clocks: 1 ms of CPU time and ``wall_per_cpu[k - 1]`` ms of wall time per matmul."""
    got = [
        _matmul_times(16.0, n=8, clock=_ticking(w), cpu_clock=_ticking(1.0)) for w in wall_per_cpu
    ]
    return [w for w, _ in got], [c for _, c in got]


def _calibrated(wall: list[float], cpu: list[float], host: tuple[float, ...] = (0, 0, 0)):
    """``_fit`` of 4 workers on 2 cores, links without latency (time proportional to bytes)."""
    links = [s / 1e6 for s in SIZES]
    return _fit(4, SIZES, links, links, 1.0, wall[-1], "gloo", 1 << 30, cores=2.0, sweep=wall,
                host=host, sweep_cpu=cpu).cluster  # fmt: skip


def test_a_loaded_machine_charges_a_cpu_time_profile_its_wall_time():
    # 2 cores, other programs busy: a worker computing alone gets a quarter of a core (4 ms of
    # wall per ms of CPU), 4 busy workers share further (t_k / t_1 = 1, 1, 1.5, 2): 8 ms wall
    # per CPU ms each. The profile holds CPU time, so one data-parallel step of 4 workers of
    # 12 CPU ms each takes 96 ms; a model normalised to a lone worker's rate charged 24.
    wall, cpu = _sweep([4.0, 4.0, 6.0, 8.0])
    assert wall == pytest.approx([4.0, 4.0, 6.0, 8.0]) and cpu == pytest.approx([1.0] * 4)
    cluster = _calibrated(wall, cpu)
    assert cluster.lone_wall_per_cpu == pytest.approx(4.0)
    assert cluster.compute_cores_per_server == pytest.approx(2.0)
    assert cluster.background_load_per_server == pytest.approx(0.0)
    plan = straight_plan(2, [0], global_batch_size=8, num_micro_batches=1, replicas=[4])
    prof = _profile("cpu")  # 2 samples per replica: F 4 + B 8 = 12 CPU ms
    assert pipeline_latency(plan, prof, cluster).L_ms == pytest.approx(96.0)
    assert simulate(plan, prof, cluster).step_ms == pytest.approx(96.0)
    # the same profile measured in wall time under that load already holds the lone stretch
    assert pipeline_latency(plan, _profile("wall"), cluster).L_ms == pytest.approx(24.0)


def test_an_idle_machine_keeps_every_number():
    wall, cpu = _sweep([1.0, 1.0, 1.5, 2.0])
    cluster = _calibrated(wall, cpu)
    assert cluster.lone_wall_per_cpu == 1.0
    assert on_wall_clock(_profile("cpu"), cluster) is cluster
    assert "lone_wall_per_cpu" not in cluster.to_dict()


def test_lone_wall_per_cpu_reads_k_1_and_is_at_least_one():
    assert lone_wall_per_cpu([6.0, 9.0], [1.5, 1.5]) == pytest.approx(4.0)
    assert lone_wall_per_cpu([0.99], [1.0]) == 1.0  # the clocks' resolution
    assert lone_wall_per_cpu([2.0], []) == 1.0  # no CPU times (an older sweep)
    assert lone_wall_per_cpu([2.0], [0.0]) == 1.0


def test_host_terms_are_cpu_time_whatever_the_profile_clock():
    c = dataclasses.replace(
        _calibrated([3.0] * 4, [1.0] * 4, host=(0.5, 2.0, 0.25)), compute_slowdown=1.5
    )
    for clock, slowdown in (("cpu", 4.5), ("wall", 1.5)):
        got = on_wall_clock(_profile(clock), c)
        assert got.compute_slowdown == pytest.approx(slowdown)
        assert (got.action_overhead_ms, got.step_overhead_ms, got.comm_cpu_ms_per_mb) == (
            pytest.approx((1.5, 6.0, 0.75))
        )
        assert got.lone_wall_per_cpu == 1.0
        assert on_wall_clock(_profile(clock), got) is got  # folded once


def test_scorer_and_L_agree_on_a_loaded_machine():
    prof = _profile("cpu", n=4, params=1 << 20)
    cluster = _calibrated([2.5, 2.5, 3.75, 5.0], [1.0] * 4, host=(0.3, 1.0, 0.2))
    assert cluster.lone_wall_per_cpu == pytest.approx(2.5)
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=4, replicas=[2, 2])
    L = pipeline_latency(plan, prof, cluster).L_ms
    stages = [(s.layers[0], s.layers[1], s.devices) for s in plan.stages]
    got = Scorer(prof, cluster, 8).score(stages, 4, schedule="dapple", policies=("A",),
                                         recompute=False)  # fmt: skip
    assert got is not None
    assert got.L_ms == pytest.approx(L, rel=1e-9)
    idle = dataclasses.replace(cluster, lone_wall_per_cpu=1.0)
    assert pipeline_latency(plan, prof, idle).L_ms < L / 2  # W = 2.5 on compute and host CPU


def test_profile_clock_round_trips_and_older_files_read_their_device():
    cpu = _profile("cpu")
    d = json.loads(json.dumps(cpu.to_dict()))
    assert d["clock"] == "cpu" and ModelProfile.from_dict(d) == cpu
    assert "clock" not in _profile("wall").to_dict()
    old = {k: v for k, v in d.items() if k != "clock"}
    assert ModelProfile.from_dict(old).clock == "wall"
    old["device"] = "cpu (CPU time, 4 co-workers)"  # a co-worker profile before the field
    assert ModelProfile.from_dict(old).clock == "cpu"
    with pytest.raises(ValidationError, match=r"clock must be one of wall, cpu, got 'gpu'"):
        _profile("gpu")


def test_cluster_field_round_trips_and_is_validated():
    c = dataclasses.replace(_calibrated([1.0] * 4, [1.0] * 4), lone_wall_per_cpu=5.5)
    back = Cluster.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.lone_wall_per_cpu == 5.5 and back == dataclasses.replace(c, name=back.name)
    with pytest.raises(ValidationError, match=r"lone_wall_per_cpu must be a number >= 1, got 0.5"):
        dataclasses.replace(c, lone_wall_per_cpu=0.5)
