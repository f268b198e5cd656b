"""An expert-parallel width e_s in a plan's cost terms (issue 45, :mod:`dapple.cost.moe` wired
into :func:`dapple.cost.terms.stage_terms` and :func:`dapple.cost.peak_memory.plan_stage_bytes`):
F_s, B_s, AR_s and the memory per rank of a tiny plan counted by hand; e_s = 1 unchanged; the
combinations not costed refused."""

from __future__ import annotations

import dataclasses

import pytest

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.moe_profile import MoEProfile
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.moe import expert_sharded_profile, expert_widths
from dapple.cost.moe_exchange import expert_host_ms
from dapple.cost.peak_memory import plan_stage_bytes
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.terms import stage_terms
from dapple.errors import ValidationError
from dapple.simulate import simulate

# 2 servers of 2 devices; 8000 Gbps = 1e9 bytes/ms inside, 800 Gbps = 1e8 bytes/ms across.
CLUSTER = Cluster(name="t", servers=2, devices_per_server=2, device_memory_bytes=2**36,
                  intra_server_bandwidth_gbps=8000, inter_server_bandwidth_gbps=800,
                  intra_server_latency_ms=0.01, inter_server_latency_ms=0.1)  # fmt: skip


def _moe(**kw: object) -> MoEProfile:
    base = dict(experts=8, top_k=2, expert_parameter_bytes=8000, tokens_per_expert_per_sample=4.0,
                dispatch_bytes_per_sample=1e9, combine_bytes_per_sample=1e9)  # fmt: skip
    return MoEProfile(**{**base, **kw})  # type: ignore[arg-type]


def _profile(moe: MoEProfile | None = None) -> ModelProfile:
    """embedding (dense, 3000 bytes), two MoE blocks of 10,000 bytes (8,000 of experts), head
    (dense, 3000); every layer 1 ms per sample forward and backward."""
    t = AffineTime(fixed_ms=0.0, per_sample_ms=1.0)
    m = moe or _moe()

    def layer(name: str, pb: int, moe: MoEProfile | None) -> LayerProfile:
        return LayerProfile(name=name, forward=t, backward=t, output_bytes_per_sample=100.0,
                            parameter_bytes=pb, kept_activation_bytes_per_sample=100.0, moe=moe)  # fmt: skip

    return ModelProfile(model_name="m", layers=(
        layer("embedding", 3000, None), layer("block0", 10000, m),
        layer("block1", 10000, m), layer("lm_head", 3000, None)))  # fmt: skip


def _plan(width: int, **kw: object) -> Plan:
    """One stage of all 4 layers on 4 replicas (devices 0-3, two per server), b = 8, M = 1."""
    st = StagePlan(layers=(0, 4), devices=(0, 1, 2, 3), expert_width=width, **kw)  # type: ignore[arg-type]
    return Plan(planner="t", model_name="m", global_batch_size=8, micro_batch_size=8,
                num_micro_batches=1, stages=(st,))  # fmt: skip


def test_width_two_adds_the_all_to_alls_and_splits_the_allreduce_by_hand() -> None:
    terms = stage_terms(_plan(2), _profile(), CLUSTER).stages[0]
    # slices of 2 samples; 4 layers x 2 ms each way
    # A2A per layer: each EP group {0,1}, {2,3} inside a server sends 2 x 1e9 bytes, half to
    # its partner: 0.01 + 1/2 x 2e9 / 1e9 = 1.01 ms, dispatch + combine, 2 MoE layers: 4.04;
    # the forward all-gathers each MoE layer's route table first: one latency each, 0.02
    assert terms.terms.forward_ms == pytest.approx(8.0 + 4.04 + 0.02)
    assert terms.terms.backward_ms == pytest.approx(8.0 + 4.04)
    r0 = terms.replicas[0]  # the first stage runs its whole backward as W
    assert (r0.input_grad_ms, r0.weight_grad_ms) == pytest.approx((0.0, 8.0 + 4.04))
    # AR(dense 10,000 bytes, 4 devices on 2 servers): intra 2 (1/2 x 1e4 / 1e9 + 0.01),
    # inter 2 x 1/2 x 1e4 / 1e8 + 2 x 0.1
    dense = 2 * (0.5e4 / 1e9 + 0.01) + (1e4 / 1e8 + 0.2)
    # experts 16,000 / 2 bytes over {0, 2} and {1, 3} at once, one per server: each server's
    # interface carries 2 x 1/2 x 8000 per group, 16,000 bytes in all, then 2 x 0.1 latency
    expert = 16000 / 1e8 + 0.2
    assert terms.terms.sync_ms == pytest.approx(dense + expert)
    assert terms.parameter_bytes == 26000  # P_s stays the whole stage's


def test_width_two_halves_the_experts_state_per_rank_by_hand() -> None:
    prof = _profile()
    plan1, plan2 = _plan(1), _plan(2)
    one = plan_stage_bytes(prof, plan1.stages[0], 8)
    two = plan_stage_bytes(prof, plan2.stages[0], 8)
    # fp32, Adam (factor 3), 4 replicas: parameters, optimizer state and the AllReduce buffer
    # 4 bytes per parameter byte always held; the gradients G = P
    assert (one.static, one.grads) == (26000 * 4, 26000)
    assert (two.static, two.grads) == (18000 * 4, 18000)  # 10,000 dense + 16,000 / 2
    assert two.other == one.other  # activations unchanged


def test_the_busiest_expert_slows_the_sharded_stage() -> None:
    skewed = _moe(max_tokens_per_expert_per_sample=6.0, expert_time_share=(0.5, 0.5))
    prof = _profile(skewed)  # imbalance 1.5, half of a block's time in its experts
    terms = stage_terms(_plan(2), prof, CLUSTER).stages[0].terms
    # A2A scaled by 1.5: 0.01 + 1/2 x 3e9 / 1e9 = 1.51 per call, 4 calls; each block's 2 ms
    # forward gains 2 x 0.5 x 0.5 = 0.5 ms, backward likewise
    assert terms.forward_ms == pytest.approx(8.0 + 4 * 1.51 + 2 * 0.5 + 0.02)  # + the tables
    assert terms.backward_ms == pytest.approx(8.0 + 4 * 1.51 + 2 * 0.5)
    # unsharded, no imbalance is paid: every replica runs its own tokens
    assert stage_terms(_plan(1), prof, CLUSTER).stages[0].terms.forward_ms == 8.0


def test_a_member_pays_the_sum_of_its_experts_not_the_busiest_one() -> None:
    # The busiest single expert has 1.5x the mean (0.1875 of the tokens against 1/8), but at
    # e_s = 2 each member holds 4 experts whose shares sum to 1/2: nothing to pay, the stage
    # costs as balanced. At e_s = 4 the busiest member (0.1875 + 0.125) holds 1.25x its mean.
    shares = (0.1875, 0.125, 0.0625, 0.125, 0.1875, 0.125, 0.0625, 0.125)
    skewed = _moe(max_tokens_per_expert_per_sample=6.0, expert_time_share=(0.5, 0.5),
                  expert_load_shares=shares)  # fmt: skip
    assert (skewed.imbalance, skewed.member_imbalance(2), skewed.member_imbalance(4)) == (
        1.5,
        1.0,
        pytest.approx(1.25),
    )
    balanced = stage_terms(_plan(2), _profile(), CLUSTER).stages[0].terms
    assert stage_terms(_plan(2), _profile(skewed), CLUSTER).stages[0].terms == balanced
    bound = _moe(max_tokens_per_expert_per_sample=6.0, expert_time_share=(0.5, 0.5))
    assert stage_terms(_plan(2), _profile(bound), CLUSTER).stages[0].terms.forward_ms > (
        balanced.forward_ms
    )
    # e_s = 4 (groups of 4 across both servers): each block's 2 ms forward gains 2 x 0.5 x 0.25
    four = stage_terms(_plan(4), _profile(skewed), CLUSTER).stages[0].terms
    even = stage_terms(_plan(4), _profile(_moe(expert_time_share=(0.5, 0.5))), CLUSTER)
    a2a = four.forward_ms - 8.0 - 2 * 0.25
    assert a2a > even.stages[0].terms.forward_ms - 8.0  # the busiest receiver's bytes, 1.25x


def test_the_exchange_costs_host_cpu_on_a_cpu_host() -> None:
    # a = 0.1 ms per collective, c = 1 ms per MiB; 1 MiB each way per sample: at e_s = 2 a
    # member of 2 samples sends 1 sample's rows away and receives as many, dispatch and combine:
    # 4 MiB per MoE layer, 3 collectives forward (the route table's all-gather, dispatch,
    # combine), 2 backward; 2 MoE layers
    cpu = dataclasses.replace(CLUSTER, action_overhead_ms=0.1, comm_cpu_ms_per_mb=1.0)
    prof = _profile(_moe(dispatch_bytes_per_sample=2**20, combine_bytes_per_sample=2**20))
    assert expert_host_ms(prof, cpu, (0, 4), 2, 2) == pytest.approx((2 * 4.3, 2 * 4.2))
    assert expert_host_ms(prof, cpu, (0, 4), 2, 1) == (0.0, 0.0)
    assert expert_host_ms(prof, CLUSTER, (0, 4), 2, 2) == (0.0, 0.0)  # no host terms


def test_recomputation_repeats_the_forward_all_to_alls() -> None:
    terms = stage_terms(_plan(2, recompute="full"), _profile(), CLUSTER).stages[0].terms
    assert terms.backward_ms == pytest.approx(2 * (8.0 + 4.04) + 0.02)  # the tables again


def test_width_one_is_the_plan_without_experts_sharded() -> None:
    prof = _profile()
    dense = dataclasses.replace(
        prof, layers=tuple(dataclasses.replace(x, moe=None) for x in prof.layers)
    )
    assert (
        stage_terms(_plan(1), prof, CLUSTER).stages == stage_terms(_plan(1), dense, CLUSTER).stages
    )
    assert expert_sharded_profile(prof, 1) is prof
    got = pipeline_latency(_plan(2), prof, CLUSTER).L_ms
    assert got > pipeline_latency(_plan(1), prof, CLUSTER).L_ms  # inside 2 servers, A2A costs


def test_widths_a_stage_may_take() -> None:
    prof = _profile()
    assert expert_widths(prof, (0, 4), 12) == [1, 2, 4]
    assert expert_widths(prof, (0, 4), 16) == [1, 2, 4, 8]
    assert expert_widths(prof, (0, 1), 16) == [1]  # no MoE layer


def test_widths_not_costed_are_refused_naming_the_stage() -> None:
    with pytest.raises(ValidationError, match=r"stage \[0, 4\] \(expert_width 2\): .*zero_stage 3"):
        stage_terms(_plan(2, zero_stage=3), _profile(), CLUSTER)
    with pytest.raises(ValidationError, match=r"stage \[0, 4\] \(expert_width 2\): .*zero_stage 3"):
        stage_terms(_plan(2), _profile(), CLUSTER, zero_stage=3)
    with pytest.raises(ValidationError, match="width 4 must divide the 2 experts of layer 1"):
        stage_terms(_plan(4), _profile(_moe(experts=2, top_k=1)), CLUSTER)


def test_zero_at_the_full_width_shards_the_dense_state_only_by_hand() -> None:
    """e_s = r_s = 4 under ZeRO-1/2: the 10,000 dense bytes at ZeRO's bytes per parameter byte
    (Adam, factor 3: ZeRO-1 2 + 3/4, ZeRO-2 1 + 3/4), each rank's 4,000 expert bytes whole at
    1 + 3 (no other holder); the update covers (10,000 + 16,000) / 4 bytes per replica; the
    dense AllReduce unchanged."""
    prof = dataclasses.replace(_profile(), update_ms_per_parameter_byte=1e-3)
    zero1 = plan_stage_bytes(prof, _plan(4, zero_stage=1).stages[0], 8)
    zero2 = plan_stage_bytes(prof, _plan(4, zero_stage=2).stages[0], 8)
    assert (zero1.static, zero1.grads) == (10000 * 2.75 + 4000 * 4, 0)
    assert (zero2.static, zero2.grads) == (10000 * 1.75 + 4000 * 4, 0)
    plain = plan_stage_bytes(prof, _plan(4).stages[0], 8)
    assert (plain.static, plain.grads) == (14000 * 4, 14000)  # 10,000 + 16,000 / 4, unsharded
    for z in (1, 2):
        terms = stage_terms(_plan(4, zero_stage=z), prof, CLUSTER).stages[0].terms
        assert terms.update_ms == pytest.approx(1e-3 * 26000 / 4)
        assert terms.sync_ms == stage_terms(_plan(4), prof, CLUSTER).stages[0].terms.sync_ms
    assert stage_terms(_plan(4), prof, CLUSTER).stages[0].terms.update_ms == pytest.approx(14.0)


def test_zero_below_the_full_width_shards_the_experts_state_over_their_copies_by_hand() -> None:
    """e_s = 2 on r_s = 4 under ZeRO-1/2: the 10,000 dense bytes at ZeRO's bytes per parameter
    byte over 4 (ZeRO-1 2 + 3/4, ZeRO-2 1 + 3/4), each rank's 8,000 expert bytes over their 2
    copies (ZeRO-1 2 + 3/2, ZeRO-2 1 + 3/2); the update (10,000 + 16,000) / 4 bytes per
    replica; AR_s the ZeRO-0 bytes (dense over 4, experts over each shard's 2 copies), ZeRO-2
    (M + 1) / 2 = 3/2 times it at M = 2."""
    prof = dataclasses.replace(_profile(), update_ms_per_parameter_byte=1e-3)
    zero1 = plan_stage_bytes(prof, _plan(2, zero_stage=1).stages[0], 8)
    zero2 = plan_stage_bytes(prof, _plan(2, zero_stage=2).stages[0], 8)
    assert (zero1.static, zero1.grads) == (10000 * 2.75 + 8000 * 3.5, 0)
    assert (zero2.static, zero2.grads) == (10000 * 1.75 + 8000 * 2.5, 0)
    plain = plan_stage_bytes(prof, _plan(2).stages[0], 8)
    assert (plain.static, plain.grads) == (18000 * 4, 18000)  # 10,000 + 16,000 / 2, unsharded
    dense = 2 * (0.5e4 / 1e9 + 0.01) + (1e4 / 1e8 + 0.2)  # as in the width-two test above
    expert = 16000 / 1e8 + 0.2
    for z in (1, 2):
        terms = stage_terms(_plan(2, zero_stage=z), prof, CLUSTER).stages[0].terms
        assert terms.update_ms == pytest.approx(1e-3 * 26000 / 4)
        assert terms.sync_ms == pytest.approx(dense + expert)  # M = 1
        two = dataclasses.replace(_plan(2, zero_stage=z), micro_batch_size=4, num_micro_batches=2)
        got = stage_terms(two, prof, CLUSTER).stages[0].terms.sync_ms
        assert got == pytest.approx((dense + expert) * (1.5 if z == 2 else 1.0))
    assert stage_terms(_plan(2), prof, CLUSTER).stages[0].terms.update_ms == pytest.approx(18.0)


def test_zero_3_with_experts_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"\(expert_width 4\): .*zero_stage 3 is not costed"):
        stage_terms(_plan(4), _profile(), CLUSTER, zero_stage=3)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_exchange_shares_the_cores_like_compute(width: int) -> None:
    # 4 replicas on one server of 2 cores: the simulator shares F and B whole, the all-to-alls
    # inside them included, and so does L (it left them out of the shared work: 32.1 ms at
    # every width against 48.3 and 56.3 simulated)
    cl = dataclasses.replace(CLUSTER, servers=1, devices_per_server=4, compute_cores_per_server=2.0)
    plan = _plan(width)
    L = pipeline_latency(plan, _profile(), cl).L_ms
    assert pytest.approx(simulate(plan, _profile(), cl).step_ms, rel=1e-9) == L
