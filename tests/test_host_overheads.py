"""Host CPU overhead terms: cluster fields, cost.host extras, L and the simulator with them,
the comm-CPU fit and the co-worker profile."""

from __future__ import annotations

import dataclasses

import pytest

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.host import HostExtra, host_extras
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.simulate import simulate

MIB = 1024**2


def _profile(n: int = 2) -> ModelProfile:
    layer = LayerProfile(
        name="l",
        forward=AffineTime(fixed_ms=1.0, per_sample_ms=0.5),
        backward=AffineTime(fixed_ms=2.0, per_sample_ms=1.0),
        output_bytes_per_sample=float(MIB),
        parameter_bytes=MIB,
        kept_activation_bytes_per_sample=1e3,
    )
    return ModelProfile(model_name="t", layers=(layer,) * n)


def _cluster(devices: int = 3, **host: float) -> Cluster:
    return Cluster(
        servers=1,
        devices_per_server=devices,
        device_memory_bytes=2**34,
        intra_server_bandwidth_gbps=100.0,
        inter_server_bandwidth_gbps=100.0,
        **host,
    )


def test_cluster_fields_default_zero_round_trip_and_validate() -> None:
    c = _cluster()
    assert not c.host_overheads
    h = _cluster(action_overhead_ms=0.3, step_overhead_ms=2.0, comm_cpu_ms_per_mb=0.25)
    assert h.host_overheads
    assert Cluster.from_dict(h.to_dict()) == h
    with pytest.raises(ValidationError, match=r"step_overhead_ms must be a number >= 0, got -1"):
        _cluster(step_overhead_ms=-1.0)


def test_host_extras_by_hand() -> None:
    # stage 0: 1 replica sends its 4-sample micro-batch as 2 pieces to stage 1's 2 replicas
    c = _cluster(action_overhead_ms=0.5, step_overhead_ms=1.0, comm_cpu_ms_per_mb=2.0)
    ex = host_extras(_profile(), c, [(0, 1, 1), (1, 2, 2)], 4)
    # a (F + 2 sends) + c * 4 MiB out
    assert ex[0] == [HostExtra(0.5 * 3 + 2.0 * 4, 0.5 * 3 + 2.0 * 4, 1.0)]
    # a (F + 1 receive) + c * 2 MiB in; step: o + c * 2 * 2(r-1)/r * 1 MiB of gradients
    assert ex[1] == [HostExtra(0.5 * 2 + 2.0 * 2, 0.5 * 2 + 2.0 * 2, 1.0 + 2.0 * 2)] * 2
    assert host_extras(_profile(), _cluster(), [(0, 1, 1), (1, 2, 2)], 4) == [
        [HostExtra()],
        [HostExtra()] * 2,
    ]


def test_single_device_L_and_simulator_add_the_host_cpu() -> None:
    """One device, M micro-batches: every F and B pays a, the step pays o once."""
    p = _profile(2)
    plan = straight_plan(2, [0], global_batch_size=8, num_micro_batches=4, replicas=[1])
    base = _cluster(1)
    host = dataclasses.replace(base, action_overhead_ms=0.25, step_overhead_ms=3.0)
    expect = pipeline_latency(plan, p, base).L_ms + 4 * 2 * 0.25 + 3.0
    assert pipeline_latency(plan, p, host).L_ms == pytest.approx(expect)
    assert simulate(plan, p, host).step_ms == pytest.approx(expect)
    # shared cores: the same CPU work, one device alone on two compute units
    shared = dataclasses.replace(host, compute_cores_per_server=2.0)
    assert simulate(plan, p, shared).step_ms == pytest.approx(expect)


def test_host_cpu_competes_for_shared_cores() -> None:
    """4-way DP on 2 compute units: the per-step host CPU is shared like compute, so it
    stretches by 4 / 2 in the simulator and in L."""
    p = _profile(2)
    plan = straight_plan(2, [0], global_batch_size=8, num_micro_batches=1, replicas=[4])
    c = dataclasses.replace(_cluster(4), compute_cores_per_server=2.0)
    with_host = dataclasses.replace(c, step_overhead_ms=5.0)
    d_sim = simulate(plan, p, with_host).step_ms - simulate(plan, p, c).step_ms
    d_L = pipeline_latency(plan, p, with_host).L_ms - pipeline_latency(plan, p, c).L_ms
    assert d_sim == pytest.approx(5.0 * 2)
    assert d_L == pytest.approx(5.0 * 2)


def test_comm_cpu_fit() -> None:
    from dapple.calibrate.overheads import comm_cpu_fit

    sizes = [MIB, 2 * MIB, 4 * MIB]
    both_ends = [0.1 + 0.6 * s / MIB for s in sizes]  # 0.6 ms per MiB for sender + receiver
    assert comm_cpu_fit(sizes, both_ends) == pytest.approx(0.3)
    assert comm_cpu_fit(sizes, [1.0, 0.5, 0.2]) == 0.0  # noise: never negative
    assert comm_cpu_fit([MIB], [1.0]) == 0.0


def test_co_worker_profile_is_cpu_time_under_load() -> None:
    from dapple.models.zoo import mlp
    from dapple.profiler.measure import profile_workload

    wl = mlp(layers=2, in_features=8, hidden=16)
    prof = profile_workload(wl, [1, 2], repeats=2, warmup=1, num_threads=1, co_workers=2)
    assert prof.device == "cpu (CPU time, 2 co-workers)" and prof.clock == "cpu"
    assert all(x.forward.at(2) > 0 for x in prof.layers)
    with pytest.raises(ValidationError, match="co_workers must be an integer >= 1, got 0"):
        profile_workload(wl, [1], co_workers=0)


def test_L_stretches_a_saturated_steady_phase_like_the_simulator() -> None:
    """4 equal stages on 2 shared compute units, M = 16: in the steady phase all 4 devices
    compute, so each runs at half speed; L's steady period must be ~2 (F + B), not the
    whole-step mean stretch (the simulator is exact)."""
    p = _profile(4)
    plan = straight_plan(4, [0, 1, 2, 3], global_batch_size=16, num_micro_batches=16)
    c = dataclasses.replace(_cluster(4), compute_cores_per_server=2.0)
    L = pipeline_latency(plan, p, c)
    sim = simulate(plan, p, c).step_ms
    f, b = 1.0 + 0.5, 2.0 + 1.0  # one sample per micro-batch
    assert L.T_s_ms == pytest.approx(15 * 2 * (f + b), rel=0.02)
    assert L.L_ms == pytest.approx(sim, rel=0.05)


def test_default_batch_sizes_cover_pure_data_parallelism() -> None:
    from dapple.calibrate.local import default_batch_sizes

    assert default_batch_sizes(32, [2, 4]) == [1, 2, 4, 8, 16]
    assert default_batch_sizes(1000, [2]) == [1, 2, 4, 8, 16, 32, 64]
    assert default_batch_sizes(3, [4]) == [1]


@pytest.mark.slow
def test_plan_local_plans_each_process_count_and_keeps_the_fastest() -> None:
    from dapple.calibrate.local import plan_local
    from dapple.models.zoo import mlp

    wl = mlp(layers=3, in_features=8, hidden=16)
    best, cands = plan_local(wl, 8, (2, 3), repeats=2)
    assert [c.processes for c in cands] == [2, 3]
    for c in cands:
        assert len(c.plan.devices) <= c.processes
        assert c.cluster.num_devices == c.processes
        assert c.profile.device == f"cpu (CPU time, {c.processes} co-workers)"
    assert best.predicted_ms == min(c.predicted_ms for c in cands)
    with pytest.raises(ValidationError, match=r"nprocs must be integers >= 2, got \[1\]"):
        plan_local(wl, 8, (1,))


@pytest.mark.slow
def test_plan_local_cli_writes_a_trainable_plan(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from dapple.cli import main
    from dapple.core.plan import Plan

    rc = main(
        ["plan-local", "--model", "mlp", "--global-batch-size", "8", "--nprocs", "2",
         "--repeats", "2", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.global_batch_size == 8 and len(plan.devices) <= 2
    assert ModelProfile.load(tmp_path / "profile.json").device == "cpu (CPU time, 2 co-workers)"
    assert load_cluster(str(tmp_path / "cluster.json")).host_overheads
    assert "chosen: 2 processes" in capsys.readouterr().out.replace("\n", " ")


def test_plan_local_cli_rejects_bad_counts(capsys) -> None:  # type: ignore[no-untyped-def]
    from dapple.cli import main

    assert main(["plan-local", "--model", "mlp", "--global-batch-size", "8", "--nprocs", "1,x",
                 "--out-dir", "/tmp/unused"]) == 2  # fmt: skip
    assert "--nprocs expects integers >= 2 like 2,4, got '1,x'" in capsys.readouterr().err
