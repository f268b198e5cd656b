"""Discrete-event simulator: hand-computed step times, memory, AllReduce, trace, pictures, CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from builders import make_cluster, make_profile
from dapple.cli import main
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, StagePlan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.comm import allreduce_ms, shared_samples
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.schedule import lower, parse_action
from dapple.simulate import simulate
from dapple.simulate.trace import to_chrome_trace

MB = 10**6


def _cluster(devices: int = 2) -> Cluster:
    # 8 Gbps = 1e6 bytes/ms, 0.5 ms per message: 1 MB takes 1.5 ms.
    return Cluster(
        name="hand",
        servers=1,
        devices_per_server=devices,
        device_memory_bytes=2**34,
        intra_server_bandwidth_gbps=8.0,
        inter_server_bandwidth_gbps=8.0,
        intra_server_latency_ms=0.5,
        inter_server_latency_ms=0.5,
    )


def _profile(n: int = 2, params: int = 0) -> ModelProfile:
    # per layer: forward 1 ms/sample, backward 2 ms/sample, 0.5 MB output and kept per sample
    return ModelProfile(
        model_name="hand",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=1.0),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=2.0),
                output_bytes_per_sample=0.5 * MB,
                parameter_bytes=params,
                kept_activation_bytes_per_sample=0.5 * MB,
            )
            for i in range(n)
        ),
    )


def _two_stage(schedule: str) -> Plan:
    return straight_plan(2, [0, 1], global_batch_size=4, num_micro_batches=2, schedule=schedule)


def test_two_stage_two_micro_batch_hand_computed():
    # b = 2 samples: F = 2 ms, B = 4 ms per stage; a transfer of 2 x 0.5 MB = 0.5 + 1 = 1.5 ms.
    # DAPPLE, K = [2, 1]: stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1.
    #   dev0: F0 [0, 2], link busy [2, 3.5]; F1 [2, 4], link [4, 5.5]
    #   dev1: F0 [3.5, 5.5], B0 [5.5, 9.5] -> grad link [9.5, 11]; F1 [9.5, 11.5] (arrived 5.5),
    #         B1 [11.5, 15.5] -> grad link [15.5, 17]
    #   dev0: B0 [11, 15], waits, B1 [17, 21]                                  => step 21 ms
    r = simulate(_two_stage("dapple"), _profile(), _cluster())
    assert r.step_ms == pytest.approx(21.0)
    times = {(e.device, str(e.action)): (e.start_ms, e.end_ms) for e in r.events}
    assert times[(1, "1F1")] == pytest.approx((9.5, 11.5))
    assert times[(0, "0.0SEND_F1@0")] == pytest.approx((4.0, 5.5))
    assert times[(0, "0B0")] == pytest.approx((11.0, 15.0))
    assert times[(0, "0.0RECV_B1@0")] == pytest.approx((15.0, 17.0))  # the wait
    # busy = 2 x (2 + 4) = 12 ms of 21 on each device
    assert [d.busy_ms for d in r.devices] == pytest.approx([12.0, 12.0])
    assert r.devices[0].bubble_fraction == pytest.approx(9 / 21)
    # GPipe: dev1 F0 [3.5, 5.5], F1 [5.5, 7.5], B0 [7.5, 11.5] -> [11.5, 13], B1 [11.5, 15.5]
    # -> [15.5, 17]; dev0 B0 [13, 17], B1 [17, 21]                             => also 21 ms
    g = simulate(_two_stage("gpipe"), _profile(), _cluster())
    assert g.step_ms == pytest.approx(21.0)
    assert {(e.device, str(e.action)): e.start_ms for e in g.events}[(0, "0B0")] == pytest.approx(
        13.0
    )


def test_memory_and_in_flight_hand_computed():
    # params 1 MB per layer, fp32 Adam: parameters and two moments always held, 3 MB static;
    # the 1 MB gradient exists from the stage's first backward on (set to None each step).
    # b = 2: a slice keeps 1 MB, its output is 1 MB. Stage 0 holds per micro-batch 2 MB (kept +
    # its output, until the gradient comes back); its backward moment: kept 1 + output 1 +
    # arriving gradient 1 + the weight gradient in flight 1 = 4 MB. Stage 1 (last) holds 2 MB
    # (kept + the loss's fp32 log-softmax, 4 B x 0.25M logits); its moment is the loss's
    # backward: those 2 + two fp32 logits-shaped gradients 2 = 4 MB.
    prof = _profile(params=MB)
    d = simulate(_two_stage("dapple"), prof, _cluster())
    g = simulate(_two_stage("gpipe"), prof, _cluster())
    assert [x.peak_in_flight for x in d.devices] == [2, 1]
    assert [x.peak_in_flight for x in g.devices] == [2, 2]
    assert [x.static_memory_bytes for x in d.devices] == [3 * MB, 3 * MB]
    # stage 0: B0 with F1 held: 3 + 2 + 4; stage 1 under DAPPLE: B1 with the gradient: 3 + 1 + 4
    assert [x.peak_memory_bytes for x in d.devices] == [9 * MB, 8 * MB]
    assert [x.peak_memory_bytes for x in g.devices] == [9 * MB, 9 * MB]
    # stage 1 under DAPPLE: F0 at 3.5 (+2), B0 [5.5, 9.5] (+2, then -4 and the gradient +1),
    # F1 at 9.5 (+2), B1 [11.5, 15.5] (+2, then -4)
    assert [t for t, _ in d.memory[1]] == pytest.approx([0.0, 3.5, 5.5, 9.5, 11.5, 15.5])
    assert [b for _, b in d.memory[1]] == [3 * MB, 5 * MB, 7 * MB, 6 * MB, 8 * MB, 4 * MB]


def test_recompute_holds_only_the_stage_input():
    # stage 1 (last) re-computes: holds per slice its 1 MB input (output of layer 0) and the
    # loss's 1 MB fp32 log-softmax from F to B; while B runs, the slice being back-propagated
    # holds its full activations (2 layers x 0.5 MB x 2 samples = 2 MB), the log-softmax and the
    # loss's two gradients (2 MB): 5 MB beside the other slice's 2 MB. B = 4 + 2 ms.
    plan = Plan(
        planner="manual",
        global_batch_size=4,
        micro_batch_size=2,
        num_micro_batches=2,
        schedule="gpipe",
        stages=(
            StagePlan(layers=(0, 1), devices=(0,)),
            StagePlan(layers=(1, 3), devices=(1,), recompute="full"),
        ),
    )
    r = simulate(plan, _profile(3), _cluster())
    dev1 = r.device(1)
    assert dev1.peak_memory_bytes == pytest.approx(2 * MB + 5 * MB)
    b_events = [e for e in r.events if e.device == 1 and str(e.action) == "1B0"]
    assert b_events[0].duration_ms == pytest.approx(8.0 + 4.0)  # bwd 2x2x2 + recomputed fwd 2x1x2


def test_data_parallel_allreduce_adds_ar_time():
    # One stage on 2 replicas, b = 2: each replica runs 1 sample: F 2 ms, B 4 ms, then AR of the
    # stage's 2 MB of gradients.
    plan = Plan(
        planner="manual",
        global_batch_size=2,
        micro_batch_size=2,
        num_micro_batches=1,
        stages=(StagePlan(layers=(0, 2), devices=(0, 1)),),
    )
    cl = _cluster()
    r = simulate(plan, _profile(params=MB), cl)
    ar = allreduce_ms(cl, 2 * MB, (0, 1))
    assert ar > 0
    assert r.step_ms == pytest.approx(2.0 + 4.0 + ar)
    ars = [e for e in r.events if e.action.kind.value == "AR"]
    assert len(ars) == 2 and all(e.start_ms == pytest.approx(6.0) for e in ars)


def test_allreduce_waits_for_the_slowest_replica():
    # b = 3 over 2 replicas: slices of 2 and 1 samples; the AR starts when replica 0 finishes.
    plan = Plan(
        planner="manual",
        global_batch_size=3,
        micro_batch_size=3,
        num_micro_batches=1,
        stages=(StagePlan(layers=(0, 1), devices=(0, 1)),),
    )
    r = simulate(plan, _profile(1, params=MB), _cluster())
    ar = {e.device: e for e in r.events if e.action.kind.value == "AR"}
    assert ar[1].start_ms == pytest.approx(3.0)  # replica 1 arrived after 1 + 2 ms
    assert ar[0].start_ms == pytest.approx(6.0) and ar[1].end_ms == ar[0].end_ms
    assert r.device(1).busy_ms == pytest.approx(3.0)


def test_links_are_fifo_and_do_not_block_compute():
    # Slow link (2 MB: 2 ms of bytes, arriving 0.5 ms later) vs fast forward (b = 1: F = 1 ms):
    # sends of micro-batches 0..2 queue on the way out: [1, 3.5], [3, 5.5], [5, 7.5].
    plan = straight_plan(2, [0, 1], global_batch_size=3, num_micro_batches=3, schedule="gpipe")
    prof = _profile()
    prof = ModelProfile(
        model_name="x",
        layers=tuple(
            LayerProfile(
                name=x.name,
                forward=x.forward,
                backward=x.backward,
                output_bytes_per_sample=2 * MB,
                parameter_bytes=0,
                kept_activation_bytes_per_sample=0.0,
            )
            for x in prof.layers
        ),
    )
    r = simulate(plan, prof, _cluster())
    sends = [e for e in r.events if e.action.kind.value == "SEND_F"]
    assert [e.start_ms for e in sends] == pytest.approx([1.0, 3.0, 5.0])
    assert [e.end_ms for e in sends] == pytest.approx([3.5, 5.5, 7.5])
    f2 = next(e for e in r.events if str(e.action) == "0F2")
    assert f2.start_ms == pytest.approx(2.0)  # not held back by the busy link
    assert all(e.nbytes == 2 * MB for e in sends)


def test_slices_of_a_cut_share_the_receivers_port():
    # 2:1 split-concat, b = 2: replicas 0 and 1 (devices 0, 1) each send 1 sample (0.5 MB) to
    # device 2, whose way in carries both: each transfer lasts until that port has taken the
    # two slices, 0.5 + 1.0 = 1.5 ms, the comm stage's F; the gradients come back through its
    # way out, 1.5 ms too. Alone on their links they would take 1.0 ms.
    plan = straight_plan(
        2, [0, 1], global_batch_size=2, num_micro_batches=1, replicas=[2, 1], schedule="gpipe"
    )
    r = simulate(plan, _profile(), _cluster(3))
    sends = [e for e in r.events if e.action.kind.value == "SEND_F"]
    assert [e.duration_ms for e in sends] == pytest.approx([1.5, 1.5])
    # the gradients back: one sender, whose two slices take turns on its way out (0.5 ms of
    # bytes each); the last arrives when the comm stage's B says
    back = sorted((e for e in r.events if e.action.kind.value == "SEND_B"), key=lambda e: e.end_ms)
    assert len(back) == 2
    assert back[1].end_ms - back[0].start_ms == pytest.approx(1.5)
    comm = pipeline_latency(plan, _profile(), _cluster(3)).stages[1]
    assert (comm.kind, comm.forward_ms, comm.backward_ms) == ("comm", 1.5, 1.5)


def test_fan_out_across_servers_takes_the_network_interface_once():
    # 4:2 split-concat across 2 servers of 4 devices, b = 4: stage 1's replicas (devices 4, 5,
    # server 1) each send their 2 rows' gradients back as 2 slices of 1 row (0.5 MB) to two
    # replicas of stage 0 (server 0). Server 1's network interface carries all 4 slices (2 MB:
    # 2 ms of bytes at 1e6 bytes per ms), so each sender's last slice arrives the comm stage's
    # B = 0.5 + 2 ms after its first starts. Each of a sender's 2 turns is charged half the
    # interface's load, 2 samples; charging each turn the other sender's 2 samples plus its own
    # (3 samples: 3.5 ms) counted the other sender once per turn.
    cluster = dataclasses.replace(_cluster(4), servers=2)
    plan = straight_plan(
        2, [0, 1], global_batch_size=4, num_micro_batches=1, replicas=[4, 2], schedule="gpipe"
    )
    assert plan.stages[1].devices == (4, 5)
    assert shared_samples(cluster, [(4, 0, 1), (4, 1, 1), (5, 2, 1), (5, 3, 1)]) == [2, 2, 2, 2]
    assert shared_samples(cluster, [(0, 4, 1), (1, 4, 1), (2, 5, 1), (3, 5, 1)]) == [4, 4, 4, 4]
    comm = pipeline_latency(plan, _profile(), cluster).stages[1]
    assert (comm.kind, comm.forward_ms, comm.backward_ms) == ("comm", 2.5, 2.5)
    r = simulate(plan, _profile(), cluster)
    for dev in (4, 5):
        back = [e for e in r.events if e.device == dev and e.action.kind.value == "SEND_B"]
        assert len(back) == 2
        assert max(e.end_ms for e in back) - min(e.start_ms for e in back) == pytest.approx(2.5)
    fwd = [e for e in r.events if e.action.kind.value == "SEND_F"]
    assert len(fwd) == 4 and all(e.duration_ms == pytest.approx(2.5) for e in fwd)


def test_a_devices_sends_take_turns_on_its_way_out():
    # 3 stages, b = 1, 1 MB per sample to send (1.5 ms a message) against F = 1 ms: the middle
    # device sends activations forward and gradients back; they queue on its one way out.
    prof = ModelProfile(
        model_name="x",
        layers=tuple(
            dataclasses.replace(x, output_bytes_per_sample=MB) for x in _profile(3).layers
        ),
    )
    plan = straight_plan(3, [0, 1, 2], global_batch_size=6, num_micro_batches=6)
    r = simulate(plan, prof, _cluster(3))
    sends = sorted(
        (e for e in r.events if e.device == 1 and e.action.kind.value.startswith("SEND")),
        key=lambda e: e.start_ms,
    )
    assert {e.action.kind.value for e in sends} == {"SEND_F", "SEND_B"}
    assert all(e.duration_ms == pytest.approx(1.5) for e in sends)
    # the bytes (1 ms) hold the way out, the latency (0.5 ms) does not: never two at once,
    # and some waited for the one before
    held = [(e.start_ms, e.end_ms - 0.5) for e in sends]
    assert all(x[1] <= y[0] + 1e-9 for x, y in itertools.pairwise(held))
    assert any(x[1] == pytest.approx(y[0]) for x, y in itertools.pairwise(held))


def test_simulated_step_close_to_planner_latency_for_uniform_pipeline():
    plan = straight_plan(8, [0, 2, 4, 6], global_batch_size=16, num_micro_batches=8)
    r = simulate(plan, make_profile(8), make_cluster(1, 4))
    assert r.L_ms == pytest.approx(r.step_ms, rel=0.05)


def test_policy_b_hides_communication_that_policy_a_exposes():
    # Observed (not hand-computed): 4 stages, M = 8, 4 MB boundaries on a 100 Gbps link. With
    # K_i = S - i (policy A) every backward waits a round trip of transfers, so DAPPLE-A is
    # slower than GPipe; policy B's extra warm-up forwards hide it (paper section 6.3).
    prof = make_profile(8, fwd=1.0, bwd=2.0, act=2e6)
    cl = make_cluster(1, 4, 100.0)

    def step(schedule: str, policy: str = "A") -> float:
        plan = straight_plan(
            8,
            [0, 2, 4, 6],
            global_batch_size=16,
            num_micro_batches=8,
            schedule=schedule,
            policy=policy,
        )
        return simulate(plan, prof, cl).step_ms

    g, a, b = step("gpipe"), step("dapple", "A"), step("dapple", "B")
    assert a > g + 1.0
    assert b == pytest.approx(g)


def test_custom_schedule_is_validated():
    plan = _two_stage("dapple")
    sched = lower(plan)
    sched[1].remove(parse_action("1.0RECV_F0@0"))
    with pytest.raises(ValidationError, match="needs RECV_F0@0"):
        simulate(plan, _profile(), _cluster(), sched)
    with pytest.raises(ValidationError, match="model has 3 layers"):
        simulate(plan, _profile(3), _cluster())


def test_chrome_trace_document():
    r = simulate(_two_stage("dapple"), _profile(params=MB), _cluster())
    doc = json.loads(json.dumps(to_chrome_trace(r)))
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(r.events)
    assert {e["pid"] for e in xs} == {0, 1}
    f1 = next(e for e in xs if e["name"] == "1F1")
    assert f1["ts"] == pytest.approx(9500.0) and f1["dur"] == pytest.approx(2000.0)
    assert f1["args"]["micro_batch"] == 1
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"device 0 (stage 0, replica 0)", "device 1 (stage 1, replica 0)"}


def test_plots_write_images(tmp_path):
    from dapple.simulate.plots import plot_gantt, plot_memory

    runs = [
        ("GPipe", simulate(_two_stage("gpipe"), _profile(), _cluster())),
        ("DAPPLE", simulate(_two_stage("dapple"), _profile(), _cluster())),
    ]
    plot_gantt(runs, tmp_path / "g.png")
    plot_memory(runs, tmp_path / "m.png")
    for f in ("g.png", "m.png"):
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate(tmp_path, capsys):
    plan = straight_plan(8, [0, 2, 4, 6], global_batch_size=8, num_micro_batches=4)
    plan.save(tmp_path / "plan.json")
    make_profile(8).save(tmp_path / "p.json")
    make_cluster(1, 4).save(tmp_path / "c.json")
    args = [
        "simulate",
        "--plan",
        str(tmp_path / "plan.json"),
        "--profile",
        str(tmp_path / "p.json"),
    ]
    args += ["--cluster", str(tmp_path / "c.json"), "--trace", str(tmp_path / "t.json")]
    args += ["--gantt", str(tmp_path / "g.png"), "--memory", str(tmp_path / "m.png")]
    assert main([*args, "--schedule", "gpipe", "--other-schedule"]) == 0
    out = capsys.readouterr().out
    assert "GPipe, 1:1:1:1, M=4" in out and "DAPPLE (policy A), 1:1:1:1, M=4" in out
    assert "step time" in out and "planner L" in out
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["otherData"]["schedule"] == "gpipe"
    assert (tmp_path / "g.png").stat().st_size > 0 and (tmp_path / "m.png").stat().st_size > 0


def test_cli_simulate_reports_bad_plan(tmp_path, capsys):
    straight_plan(8, [0, 4], global_batch_size=4, num_micro_batches=2, replicas=[3, 3]).save(
        tmp_path / "plan.json"
    )
    make_profile(8).save(tmp_path / "p.json")
    rc = main(
        [
            "simulate",
            "--plan",
            str(tmp_path / "plan.json"),
            "--profile",
            str(tmp_path / "p.json"),
            "--cluster",
            "local-cpu",
        ]
    )
    assert rc == 2
    assert "dapple: error: plan uses device id(s) [4, 5]" in capsys.readouterr().err


def test_engine_and_validator_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, dapple.simulate.engine, dapple.schedule.validate, dapple.simulate.trace; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
