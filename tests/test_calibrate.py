"""Calibration: the fit recovers known link parameters; a real 2-process run writes a valid cluster."""

from __future__ import annotations

import pytest

from dapple.calibrate.machine import _fit, calibrate
from dapple.core.cluster import Cluster
from dapple.errors import ValidationError


def test_fit_recovers_synthetic_link():
    sizes = (1 << 10, 1 << 16, 1 << 20, 1 << 22)
    bw_bytes_per_ms = 10e9 / 8 / 1e3  # 10 Gbps
    lat = 0.05
    p2p = [lat + s / bw_bytes_per_ms for s in sizes]
    n = 4
    ar = [2 * (n - 1) * lat + 2 * (n - 1) / n * s / bw_bytes_per_ms for s in sizes]
    res = _fit(n, sizes, p2p, ar, alone=1.0, shared=2.5, backend="gloo", memory_bytes=1 << 30)
    c = res.cluster
    assert c.intra_server_bandwidth_gbps == pytest.approx(10.0, rel=1e-6)
    assert c.intra_server_latency_ms == pytest.approx(lat, rel=1e-6)
    assert c.compute_slowdown == pytest.approx(2.5)
    assert c.num_devices == 4


def test_calibrate_rejects_one_process():
    with pytest.raises(ValidationError, match="--nproc >= 2"):
        calibrate(1)


@pytest.mark.slow
def test_calibrate_two_processes(tmp_path):
    res = calibrate(2, sizes=(1 << 12, 1 << 18, 1 << 20), repeats=2)
    assert all(t > 0 for t in res.p2p_ms) and all(t > 0 for t in res.allreduce_ms)
    res.cluster.save(tmp_path / "c.json")
    from dapple.core.cluster_presets import load_cluster

    c = load_cluster(str(tmp_path / "c.json"))
    assert isinstance(c, Cluster) and c.num_devices == 2 and c.intra_server_bandwidth_gbps > 0
    # the runtime's host CPU, measured by running it: every step costs some CPU, and the
    # values survive the cluster file
    assert c.step_overhead_ms + 2 * c.action_overhead_ms > 0
    assert c.comm_cpu_ms_per_mb >= 0
    assert (c.action_overhead_ms, c.step_overhead_ms, c.comm_cpu_ms_per_mb) == (
        res.cluster.action_overhead_ms,
        res.cluster.step_overhead_ms,
        res.cluster.comm_cpu_ms_per_mb,
    )
    assert any("runtime host CPU" in n for n in res.notes)


def test_fit_survives_noisy_small_messages():
    # the smallest message was slowest (warm-up noise): slope would be negative
    sizes = (1 << 10, 1 << 20)
    res = _fit(
        2,
        sizes,
        [5.0, 1.0],
        [5.0, 1.0],
        alone=1.0,
        shared=1.0,
        backend="gloo",
        memory_bytes=1 << 30,
    )
    bw = res.cluster.intra_server_bandwidth_gbps
    assert bw == pytest.approx((1 << 20) / 1.0 * 8e3 / 1e9)


def test_host_cpu_terms_are_measured_on_one_intra_op_thread(monkeypatch):
    # Idle intra-op workers spin between the runtime's small ops and count as process CPU time
    # (2 threads per rank: 22.9 ms per step against 1.1 ms on one; benchmarks/
    # overhead_threads.md). The ping-pong's CPU and the runtime overheads run on one thread;
    # the compute sweep keeps the runtime's thread count.
    import torch
    import torch.distributed as dist

    from dapple.calibrate import machine

    seen: dict[str, int] = {}

    def record(name, value):
        def f(*args, **kwargs):
            seen[name] = torch.get_num_threads()
            return value

        return f

    monkeypatch.setattr(machine, "_point_to_point", record("p2p", ([], 0.0)))
    monkeypatch.setattr(machine, "runtime_overheads", record("overheads", (0.0, 0.0)))
    monkeypatch.setattr(machine, "busy_sweep_clocks", record("sweep", ([1.0], [1.0])))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        machine._measure(0, 2, (), 1)
        assert seen == {"p2p": 1, "overheads": 1, "sweep": 2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


def _fake_clock(ms_per_matmul):
    """A clock read once before the stretch and once after each matmul; each read after the
    first advances it by ``ms_per_matmul(now_ms)``."""
    state = {"t": 0.0, "reads": 0}

    def clock() -> float:
        if state["reads"]:
            state["t"] += ms_per_matmul(state["t"] * 1e3) / 1e3
        state["reads"] += 1
        return state["t"]

    return clock, state


def test_matmul_timing_runs_a_window_and_times_its_middle():
    from dapple.calibrate.machine import _matmul_ms

    # a worker alone for its first 30 ms (its peers started late), then sharing a core (2 ms a
    # matmul): timed over the middle half of its 160 ms window, it reads the shared speed
    clock, state = _fake_clock(lambda now: 1.0 if now < 30 else 2.0)
    assert _matmul_ms(160.0, n=8, clock=clock) == pytest.approx(2.0)
    assert 160.0 <= state["t"] * 1e3 < 163.0  # it ran for the window, not for a count
    # matmuls longer than a quarter of the window: the whole stretch
    clock, _ = _fake_clock(lambda now: 50.0)
    assert _matmul_ms(100.0, n=8, clock=clock) == pytest.approx(50.0)
