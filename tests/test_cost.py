"""Cost model golden values (paper section 5.1, equations 1-3)."""

from __future__ import annotations

import dataclasses

import pytest

from builders import make_cluster, make_profile
from dapple.core.plan import StagePlan, straight_plan
from dapple.cost.comm import allreduce_ms, comm_stage_ms, transfer_ms
from dapple.cost.compute import compute_ms, stage_compute_ms
from dapple.cost.latency import latency
from dapple.cost.memory import (
    boundary_bytes,
    held_activation_bytes,
    parameter_state_bytes,
)
from dapple.cost.peak_memory import in_flight_limit, stage_bytes, stage_peak
from dapple.cost.pipeline import pipeline_latency

BPMS_100G = 100e9 / 8 / 1e3  # bytes per ms at 100 Gbps


def test_compute_ms_sums_layers_and_recompute_adds_forward() -> None:
    p, c = make_profile(6, fwd=1.0, bwd=2.0), make_cluster()
    assert compute_ms(p, c, (0, 3), 4) == (12.0, 24.0)
    assert compute_ms(p, c, (0, 3), 4, recompute=True) == (12.0, 36.0)
    assert compute_ms(p, c, (2, 3), 0) == (0.0, 0.0)
    slow = dataclasses.replace(c, compute_slowdown=2.0)
    assert compute_ms(p, slow, (0, 1), 1) == (2.0, 4.0)


def test_stage_compute_uses_the_largest_slice() -> None:
    p, c = make_profile(4), make_cluster()
    st = StagePlan(layers=(0, 2), devices=(0, 1))
    assert stage_compute_ms(p, c, st, 5) == (6.0, 12.0)  # slices 3 + 2: the 3 paces the stage


def test_boundary_bytes() -> None:
    p = dataclasses.replace(make_profile(3, act=1000.0), input_bytes_per_sample=7.0)
    assert boundary_bytes(p, 0, 2) == 14.0
    assert boundary_bytes(p, 2, 3) == 3000.0


def test_transfer_ms_latency_plus_bandwidth() -> None:
    c = make_cluster(servers=2, per_server=2, gbps=100.0)
    assert transfer_ms(c, 0, 0, 1) == 0.0
    assert transfer_ms(c, 1e6, 0, 1) == pytest.approx(0.005 + 1e6 / BPMS_100G)
    assert transfer_ms(c, 1e6, 0, 2) == pytest.approx(0.02 + 1e6 / (BPMS_100G / 4))


def test_allreduce_ring_and_hierarchical() -> None:
    c = make_cluster(servers=2, per_server=4, gbps=100.0)
    assert allreduce_ms(c, 1e6, [3]) == 0.0
    ring = 2 * 3 / 4 * 1e6 / BPMS_100G + 6 * 0.005
    assert allreduce_ms(c, 1e6, [0, 1, 2, 3]) == pytest.approx(ring)
    # 2 servers x 2 devices: intra reduce-scatter + all-gather, inter ring of 2 servers
    intra = 2 * (1 / 2 * 1e6 / BPMS_100G + 0.005)
    inter = 2 * 1 / 2 * 1e6 / (BPMS_100G / 4) + 2 * 0.02
    assert allreduce_ms(c, 1e6, [0, 1, 4, 5]) == pytest.approx(intra + inter)
    # one device per server: just the inter-server ring
    assert allreduce_ms(c, 1e6, [0, 4]) == pytest.approx(inter)


def test_comm_stage_follows_split_concat_links() -> None:
    p, c = make_profile(4, act=1000.0), make_cluster(servers=2, per_server=2, gbps=100.0)
    src = StagePlan(layers=(0, 2), devices=(0, 1))
    # concat of 2 replicas into device 2 on the other server: its NIC receives all 4 samples
    dst = StagePlan(layers=(2, 4), devices=(2,))
    f, b = comm_stage_ms(p, c, src, dst, 4)
    assert f == b == pytest.approx(0.02 + 4000 / (BPMS_100G / 4))
    # one-to-one inside a server: one device link with 4 samples
    src1 = StagePlan(layers=(0, 2), devices=(0,))
    dst1 = StagePlan(layers=(2, 4), devices=(1,))
    assert comm_stage_ms(p, c, src1, dst1, 4)[0] == pytest.approx(0.005 + 4000 / BPMS_100G)
    # split 1 -> 2 inside a server: the sender's link carries 4 samples in all
    dst2 = StagePlan(layers=(2, 4), devices=(1, 0))
    src2 = StagePlan(layers=(0, 2), devices=(0,))
    # replica 1 of dst is device 0 itself: only 2 samples move (to device 1)
    assert comm_stage_ms(p, c, src2, dst2, 4)[0] == pytest.approx(0.005 + 2000 / BPMS_100G)


def test_memory_terms() -> None:
    p = dataclasses.replace(make_profile(4, act=100.0, params=1000), input_bytes_per_sample=5.0)
    # 4 B per parameter byte (fp32 Adam), plus the largest layer's gradient autograd produces
    # before adding it to the accumulated one
    assert parameter_state_bytes(p, (0, 2)) == 2000 * 4 + 1000
    st = StagePlan(layers=(0, 2), devices=(0, 1))
    assert held_activation_bytes(p, st, 3) == 600.0
    rec = dataclasses.replace(st, recompute="full")
    assert held_activation_bytes(p, rec, 3) == 15.0  # only the stage input (model input here)
    # b = 6 over 2 replicas: slices of 3; K = 2 in flight of M = 3 (dapple.cost.peak_memory).
    # Always held: parameters, the AllReduce buffers and two moments, 8000 B (the gradients
    # are set to None each step). A micro-batch holds 600 B kept and its 300 B output until
    # the output's gradient comes back (re-computing: the 15 B input and the output). A later
    # backward of layer 1: both gradients 2000, the other micro-batch, its 900 B, the arriving
    # 300 B gradient and layer 1's 1000 B weight gradient in flight.
    assert stage_peak(p, st, 6, 2, 3).peak == 8000 + 2000 + 900 + (900 + 300 + 1000)
    assert stage_peak(p, rec, 6, 2, 3).peak == 8000 + 2000 + 315 + (900 + 300 + 1000)


def test_latency_two_stage_golden() -> None:
    # 2 stages of 3 layers, F = 6, B = 12 per micro-batch of 2 samples, no comm, no AR (1 replica)
    p, c = make_profile(6, act=0.0, params=0), make_cluster()
    plan = straight_plan(6, [0, 3], global_batch_size=8, num_micro_batches=4)
    r = pipeline_latency(plan, p, c)
    assert r.S == 3 and r.Q == 2
    assert (r.T_w_ms, r.T_s_ms, r.T_e_ms) == (12.0, 54.0, 24.0)
    assert r.L_ms == 90.0  # M (F + B) + F + B of the other stage: the 1F1B makespan
    assert [s.kind for s in r.stages] == ["compute", "comm", "compute"]
    assert r.fits_memory


def test_pivot_moves_to_a_slow_early_stage() -> None:
    L, tw, ts, te, Q = latency([4.0, 1.0], [8.0, 2.0], [0.0, 0.0], 3, [12.0, 3.0])
    assert Q == 0
    assert (tw, ts) == (4.0, 24.0)
    assert te == 1.0 + 2.0 + 8.0  # the last micro-batch's tail F_1 + B_1, then B_0
    assert L == 39.0


def test_ending_phase_counts_allreduce_of_early_stages() -> None:
    L, _, _, te, Q = latency([1.0, 1.0], [2.0, 2.0], [10.0, 0.0], 2, [3.0, 3.0])
    assert Q == 1
    assert te == 2.0 + 2.0 + 10.0
    assert 2.0 + 3.0 + te == L


def test_memory_flag_and_single_stage_is_data_parallel() -> None:
    p = make_profile(4, act=1e9, params=10**6)
    c = make_cluster(per_server=2)
    plan = straight_plan(4, [0], global_batch_size=64, num_micro_batches=1, replicas=[2])
    r = pipeline_latency(plan, p, c)
    assert not r.fits_memory  # 32 samples x 4 GB (decimal) of activations
    assert r.S == 1 and r.Q == 0
    assert r.L_ms == r.T_w_ms + r.T_e_ms


def test_policy_b_hides_large_comm() -> None:
    p = make_profile(4, act=5e5, params=0)
    c = make_cluster(servers=4, per_server=1, gbps=10.0)
    a = straight_plan(4, [0, 1, 2, 3], global_batch_size=32, num_micro_batches=16, policy="A")
    b = dataclasses.replace(a, policy="B")
    la, lb = pipeline_latency(a, p, c).L_ms, pipeline_latency(b, p, c).L_ms
    assert lb < la


def test_overlaps_equal_split_concat_transfers() -> None:
    import random

    from dapple.core.plan import transfers
    from dapple.cost.comm import overlaps

    rng = random.Random(0)
    for _ in range(500):
        b, r1, r2 = rng.randint(0, 40), rng.randint(1, 50), rng.randint(1, 50)
        assert overlaps(b, r1, r2) == list(transfers(b, r1, r2)), (b, r1, r2)


def test_in_flight_limit() -> None:
    p = dataclasses.replace(make_profile(2, act=100.0, params=1000), input_bytes_per_sample=5.0)
    st = StagePlan(layers=(0, 2), devices=(0,))
    sb, redone = stage_bytes(p, (0, 2), 4)  # one stage (the last): micro-batches of 4 samples
    # parameters and two moments 6000 B; a micro-batch holds 800 B kept and the loss's 400 B
    # log-softmax (4 B x 100 fp32 logits); a later backward adds both gradients (2000) to its
    # layer 1 moment (kept 800 + arriving gradient 400 + weight gradient 1000)
    assert (sb.static, sb.other, sb.grads, sb.later) == (6000, 1200, 2000, 2200)
    mem = 6000 + 4200 + 2 * 1200 + 50
    # 3 micro-batches fit; re-computing holds 20 B of input and the 400 B log-softmax each
    assert in_flight_limit(sb, mem, 8) == 3
    assert in_flight_limit(redone, mem, 8) == 1 + (mem - 6000 - 4200) // 420
    assert in_flight_limit(sb, 6000 + 4199, 8) == in_flight_limit(redone, 6000 + 4199, 8) == 0
    # K = M (GPipe): the later backwards hold M - 2 others, so 2 of 2 fit where 2 of 3 do not
    tight = 6000 + 4200 + 1199
    assert in_flight_limit(sb, tight, 3) == 1 and in_flight_limit(sb, tight, 2) == 2
    assert stage_peak(p, st, 4, 2, 2).peak <= tight < stage_peak(p, st, 4, 2, 3).peak
    empty = dataclasses.replace(p, layers=tuple(
        dataclasses.replace(x, parameter_bytes=0, kept_activation_bytes_per_sample=0.0,
                            output_bytes_per_sample=0.0) for x in p.layers
    ), input_bytes_per_sample=0.0)  # fmt: skip
    assert in_flight_limit(stage_bytes(empty, (0, 2), 4)[0], mem, 8) == 10**9  # no memory taken
