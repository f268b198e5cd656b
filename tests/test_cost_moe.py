"""Expert-parallel pricing of one stage (issue 45 item 2, :mod:`dapple.cost.moe`): memory per
rank, the all-to-alls inside and across servers, the experts' and dense AllReduces, against
hand counts and as properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.moe_profile import MoEProfile
from dapple.core.profile import ModelProfile
from dapple.cost.comm import allreduce_ms
from dapple.cost.moe import (
    alltoall_ms,
    check_expert_width,
    expert_allreduce_ms,
    expert_compute_ms,
    layer_alltoall_ms,
    moe_sync_ms,
    rank_parameter_bytes,
    stage_alltoall_ms,
    stage_rank_parameter_bytes,
)
from dapple.errors import ValidationError

# 4 servers of 8 devices; 8000 Gbps = 1e9 bytes/ms inside, 800 Gbps = 1e8 bytes/ms across.
CLUSTER = Cluster(name="t", servers=4, devices_per_server=8, device_memory_bytes=2**36,
                  intra_server_bandwidth_gbps=8000, inter_server_bandwidth_gbps=800,
                  intra_server_latency_ms=0.01, inter_server_latency_ms=0.1)  # fmt: skip
INTRA, INTER = 1e9, 1e8


def _moe(**kw: object) -> MoEProfile:
    base = dict(experts=8, top_k=2, expert_parameter_bytes=8000, tokens_per_expert_per_sample=4.0,
                dispatch_bytes_per_sample=1e9, combine_bytes_per_sample=1e9)  # fmt: skip
    return MoEProfile(**{**base, **kw})  # type: ignore[arg-type]


def _profile() -> ModelProfile:
    """embedding (dense), two MoE blocks of 10,000 bytes (8,000 of experts), head (dense)."""
    t = AffineTime(fixed_ms=0.0, per_sample_ms=1.0)

    def layer(name: str, pb: int, moe: MoEProfile | None) -> LayerProfile:
        return LayerProfile(name=name, forward=t, backward=t, output_bytes_per_sample=100.0,
                            parameter_bytes=pb, kept_activation_bytes_per_sample=100.0, moe=moe)  # fmt: skip

    return ModelProfile(model_name="m", layers=(
        layer("embedding", 3000, None), layer("block0", 10000, _moe()),
        layer("block1", 10000, _moe()), layer("lm_head", 3000, None)))  # fmt: skip


# -- memory -----------------------------------------------------------------------------------


def test_experts_are_sharded_and_the_rest_replicated() -> None:
    assert rank_parameter_bytes(2000, 8000, 4) == 2000 + 2000
    prof = _profile()
    assert stage_rank_parameter_bytes(prof, (0, 4), 1) == 26000
    assert stage_rank_parameter_bytes(prof, (0, 4), 8) == 3000 + 2 * (2000 + 1000) + 3000
    assert stage_rank_parameter_bytes(prof, (0, 1), 8) == 3000  # a dense stage


def test_widths_that_do_not_divide_are_refused_naming_them() -> None:
    check_expert_width(8, 4, _profile())
    with pytest.raises(ValidationError, match="width 3 must divide the stage's 8 replicas"):
        check_expert_width(8, 3)
    with pytest.raises(ValidationError, match="width 16 must divide the 8 experts of layer 1"):
        check_expert_width(16, 16, _profile())
    with pytest.raises(ValidationError, match="integer >= 1, got 0"):
        check_expert_width(8, 0)
    with pytest.raises(ValidationError, match="width 3 must divide the stage's 4 replicas"):
        expert_allreduce_ms(CLUSTER, 1e6, [0, 1, 2, 3], 3)


# -- all-to-all -------------------------------------------------------------------------------


def test_alltoall_inside_one_server_is_the_hand_count() -> None:
    # 4 members: each sends 3/4 of its bytes over its own link
    assert alltoall_ms(CLUSTER, 4e9, [0, 1, 2, 3]) == pytest.approx(0.01 + 3 / 4 * 4e9 / INTRA)


def test_alltoall_across_servers_is_paced_by_the_network_interface() -> None:
    # 2 members on each of 2 servers: 1/4 inside, and the 2 x 2/4 of each server off it
    devices = [0, 1, 8, 9]
    inside = 0.01 + 1 / 4 * 4e9 / INTRA
    across = 0.1 + 2 * 2 / 4 * 4e9 / INTER
    assert alltoall_ms(CLUSTER, 4e9, devices) == pytest.approx(max(inside, across))
    # one member per server: only the network
    assert alltoall_ms(CLUSTER, 4e9, [0, 8]) == pytest.approx(0.1 + 1 / 2 * 4e9 / INTER)


def test_nothing_moves_for_one_member_or_no_bytes() -> None:
    assert alltoall_ms(CLUSTER, 1e6, [3]) == 0.0
    assert alltoall_ms(CLUSTER, 0.0, [0, 1]) == 0.0
    assert layer_alltoall_ms(CLUSTER, _moe(), 4, [5]) == 0.0


def test_layer_alltoall_is_dispatch_plus_combine_scaled_by_the_imbalance() -> None:
    devices = [0, 1, 2, 3]
    balanced = layer_alltoall_ms(CLUSTER, _moe(combine_bytes_per_sample=2e9), 2, devices)
    assert balanced == pytest.approx(
        alltoall_ms(CLUSTER, 2e9, devices) + alltoall_ms(CLUSTER, 4e9, devices)
    )
    skewed = _moe(max_tokens_per_expert_per_sample=6.0)  # imbalance 1.5
    assert layer_alltoall_ms(CLUSTER, skewed, 2, devices) == pytest.approx(
        2 * alltoall_ms(CLUSTER, 1.5 * 2e9, devices)
    )
    prof = _profile()
    assert stage_alltoall_ms(prof, CLUSTER, (0, 4), devices, 2) == pytest.approx(
        2 * layer_alltoall_ms(CLUSTER, _moe(), 2, devices)
    )
    assert stage_alltoall_ms(prof, CLUSTER, (3, 4), devices, 2) == 0.0


def test_expert_compute_pays_the_imbalance_only_when_sharded() -> None:
    assert expert_compute_ms(10.0, 0.5, 1.5, 1) == 10.0
    assert expert_compute_ms(10.0, 0.5, 1.5, 4) == pytest.approx(5.0 + 7.5)
    assert expert_compute_ms(10.0, 0.5, 1.0, 4) == 10.0


# -- gradients --------------------------------------------------------------------------------


def test_expert_allreduce_over_the_replicas_holding_the_same_experts() -> None:
    r8 = list(range(8))  # one server
    assert expert_allreduce_ms(CLUSTER, 8e9, r8, 8) == 0.0  # no copies
    # e = 2: groups {0,2,4,6} and {1,3,5,7}, each a ring over 4 of 4e9 bytes, at once
    assert expert_allreduce_ms(CLUSTER, 8e9, r8, 2) == pytest.approx(
        allreduce_ms(CLUSTER, 4e9, [0, 2, 4, 6])
    )


def test_expert_allreduce_groups_share_the_network_interface() -> None:
    devices = [0, 1, 8, 9]  # 2 replicas on each of 2 servers, e = 2: groups {0, 8} and {1, 9}
    nbytes = 8e9 / 2
    one_group = allreduce_ms(CLUSTER, nbytes, [0, 8])
    shared = 0.2 + 2 * (2 * (2 - 1) / 2 * nbytes) / INTER  # both groups through one interface
    assert expert_allreduce_ms(CLUSTER, 8e9, devices, 2) == pytest.approx(shared)
    assert shared > one_group


def test_sync_is_the_dense_allreduce_then_the_experts() -> None:
    devices = list(range(16))
    assert moe_sync_ms(CLUSTER, 2e9, 8e9, devices, 4) == pytest.approx(
        allreduce_ms(CLUSTER, 2e9, devices) + expert_allreduce_ms(CLUSTER, 8e9, devices, 4)
    )


def test_mixtral_stage_on_h100_servers() -> None:
    """Mixtral-8x7B's blocks at EP 8 over 16 replicas of two H100 servers: a rank holds one
    expert of each layer, and the experts' gradients cross servers in pairs."""
    from dapple.profiler.analytic import analytic_profile

    prof = analytic_profile("mixtral-8x7b", "h100", batch_sizes=(1,))
    cluster = dataclasses.replace(PRESETS["h100-8x"], servers=2)
    blocks = (1, prof.num_layers - 1)
    full = stage_rank_parameter_bytes(prof, blocks, 1)
    sharded = stage_rank_parameter_bytes(prof, blocks, 8)
    expert = sum(ly.moe.expert_parameter_bytes for ly in prof.layers if ly.moe is not None)
    assert full - sharded == pytest.approx(expert * 7 / 8)
    inside = stage_alltoall_ms(prof, cluster, blocks, list(range(8)), 1)
    across = stage_alltoall_ms(prof, cluster, blocks, [0, 1, 2, 3, 8, 9, 10, 11], 1)
    assert 0 < inside < across
    assert expert_allreduce_ms(cluster, expert, list(range(16)), 8) > 0


# -- properties -------------------------------------------------------------------------------

_devices = st.lists(st.integers(0, 31), min_size=1, max_size=16, unique=True)


@given(devices=_devices, nbytes=st.floats(1.0, 1e9))
def test_width_one_expert_allreduce_is_the_comm_models_allreduce(
    devices: list[int], nbytes: float
) -> None:
    assert expert_allreduce_ms(CLUSTER, nbytes, devices, 1) == pytest.approx(
        allreduce_ms(CLUSTER, nbytes, devices)
    )


@given(devices=_devices, a=st.floats(0.0, 1e9), b=st.floats(0.0, 1e9))
def test_alltoall_grows_with_bytes_and_never_beats_the_slowest_link(
    devices: list[int], a: float, b: float
) -> None:
    lo, hi = sorted((a, b))
    assert alltoall_ms(CLUSTER, lo, devices) <= alltoall_ms(CLUSTER, hi, devices)
    e = len(devices)
    if e > 1 and hi > 0:
        # at least the bytes one member sends away, over the fastest link
        assert alltoall_ms(CLUSTER, hi, devices) >= (e - 1) / e * hi / INTRA


@given(
    dense=st.integers(0, 10**9),
    expert=st.integers(0, 10**9),
    widths=st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8])),
)
def test_wider_expert_parallelism_never_holds_more(
    dense: int, expert: int, widths: tuple[int, int]
) -> None:
    lo, hi = sorted(widths)
    assert rank_parameter_bytes(dense, expert, hi) <= rank_parameter_bytes(dense, expert, lo)
    assert rank_parameter_bytes(dense, expert, hi) >= dense
