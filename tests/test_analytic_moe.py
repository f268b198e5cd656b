"""Analytic profiles of mixtures of experts (issue 45 item 1): Mixtral-8x7B, Qwen-MoE and
DeepSeek-V3 shapes, their parameters against the published counts and against ``transformers``,
FLOPs of the active experts only, and ``dapple profile --analytic``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dapple.cli import main
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler.analytic import analytic_profile, block_ops, layer_costs
from dapple.profiler.analytic_moe_models import MLASpec, MoESpec, moe_from_hf
from dapple.profiler.analytic_moe_ops import EXPERT_OPS, ROUTER_OPS
from dapple.profiler.analytic_presets import (
    PRESETS,
    PUBLISHED_ACTIVE_PARAMETERS,
    from_hf_config,
)

MOE_PRESETS = ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen2-57b-a14b", "deepseek-v3")


def _printed(text: str) -> tuple[float, float]:
    """``"12.9B"`` -> (12.9e9, half a unit of the last printed digit)."""
    digits = text[:-1]
    places = len(digits.partition(".")[2])
    return float(digits) * 1e9, 0.5 * 10**-places * 1e9


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen2-57b-a14b"])
def test_active_parameters_match_the_published_counts(name: str) -> None:
    published, rounding = _printed(PUBLISHED_ACTIVE_PARAMETERS[name])
    count = PRESETS[name].active_parameters()
    assert abs(count - published) <= max(0.01 * published, rounding), (count, published)


def test_mixtral_is_46_7b_with_12_9b_active() -> None:
    spec = PRESETS["mixtral-8x7b"]
    assert round(spec.parameters() / 1e9, 1) == 46.7
    assert round(spec.active_parameters() / 1e9, 1) == 12.9


def test_deepseek_v3_is_671b_with_37b_active() -> None:
    spec = PRESETS["deepseek-v3"]
    assert round(spec.parameters() / 1e9) == 671
    # DeepSeek counts 36.6B active without the input embedding table (a lookup; README_WEIGHTS
    # of deepseek-ai/DeepSeek-V3), "37B" in the report's abstract.
    assert round((spec.active_parameters() - spec.vocab * spec.hidden) / 1e9, 1) == 36.6
    assert abs(spec.active_parameters() - 37e9) <= 0.02 * 37e9


def _tiny_configs() -> dict[str, Any]:
    tf = pytest.importorskip("transformers")
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=128,
                 max_position_embeddings=64, num_experts_per_tok=2)  # fmt: skip
    return {
        "mixtral": tf.MixtralConfig(**sizes, num_hidden_layers=2, num_key_value_heads=2,
                                    num_local_experts=4),
        "qwen2_moe": tf.Qwen2MoeConfig(**sizes, num_hidden_layers=2, num_key_value_heads=2,
                                       num_experts=6, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=48),
        "deepseek_v3": tf.DeepseekV3Config(**sizes, num_hidden_layers=3, num_key_value_heads=4,
                                           first_k_dense_replace=1, n_routed_experts=8,
                                           n_shared_experts=1, moe_intermediate_size=16,
                                           q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                                           qk_rope_head_dim=4, v_head_dim=8, n_group=2,
                                           topk_group=1),
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_hf_config_parameters_match_transformers(kind: str) -> None:
    tf = pytest.importorskip("transformers")
    config = _tiny_configs()[kind]
    model = tf.AutoModelForCausalLM.from_config(config)
    spec = from_hf_config(config.to_dict(), kind)
    assert spec.parameters() == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    blocks = spec.layers - (spec.moe.dense_layers if spec.moe else 0)
    assert spec.moe is not None and blocks * spec.moe.routed_parameters(spec.hidden) == experts


def test_hf_configs_of_the_presets_give_the_presets() -> None:
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
               "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
    assert from_hf_config(mixtral, "m", seq=4096) == dataclasses.replace(
        PRESETS["mixtral-8x7b"], name="m"
    )
    v3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
          "vocab_size": 129280, "moe_intermediate_size": 2048, "n_routed_experts": 256,
          "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
          "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128}  # fmt: skip
    assert from_hf_config(v3, "v3", seq=4096).parameters() == PRESETS["deepseek-v3"].parameters()


def test_qwen_moe_with_dense_blocks_between_is_refused() -> None:
    cfg = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
           "decoder_sparse_step": 2}  # fmt: skip
    with pytest.raises(ValidationError, match="decoder_sparse_step=2"):
        moe_from_hf(cfg, "qwen2_moe", "q")
    with pytest.raises(ValidationError, match="num_local_experts is not set"):
        moe_from_hf({}, "mixtral", "m")


def test_invalid_shapes_are_refused() -> None:
    with pytest.raises(ValidationError, match="top_k must be at most experts = 4, got 5"):
        MoESpec(experts=4, top_k=5, expert_ffn=8)
    with pytest.raises(ValidationError, match="kv_rank must be an integer >= 1, got 0"):
        MLASpec(q_rank=0, kv_rank=0, nope_dim=8, rope_dim=4, v_dim=8)
    with pytest.raises(ValidationError, match="4 dense blocks exceed its 2 blocks"):
        dataclasses.replace(PRESETS["mixtral-8x7b"], layers=2,
                            moe=MoESpec(experts=4, top_k=2, expert_ffn=8, dense_layers=4))  # fmt: skip


# -- FLOPs and bytes ----------------------------------------------------------------------


def test_moe_block_flops_are_those_of_its_active_experts() -> None:
    """A top-k block's GEMM FLOPs are a dense block's of width k f_e plus the router's."""
    spec = dataclasses.replace(PRESETS["mixtral-8x7b"], seq=256)
    s, h, k, f_e, n_e = 256, spec.hidden, 2, 14336, 8
    dense = dataclasses.replace(spec, moe=None, ffn=k * f_e)
    moe_ops, dense_ops = block_ops(spec, s, 2, "flash"), block_ops(dense, s, 2, "flash")
    moe_flops = sum(op.fwd_flops for op in moe_ops)
    assert moe_flops == sum(op.fwd_flops for op in dense_ops) + 2 * s * h * n_e
    experts = [op for op in moe_ops if op.name in EXPERT_OPS and op.kind == "matmul"]
    assert sum(op.fwd_flops for op in experts) == 6 * s * k * h * f_e
    assert sum(op.bwd_flops for op in experts) == 12 * s * k * h * f_e
    # the weights of all E experts are read once per call
    assert sum(op.fwd_bytes_per_call for op in experts) == n_e * 3 * h * f_e * 2


def test_latent_attention_flops_are_the_hand_count() -> None:
    spec = dataclasses.replace(PRESETS["deepseek-v3"], seq=128)
    s, h, a = 128.0, 7168, 128
    ops = {op.name: op for op in block_ops(spec, s, 2, "flash")}
    gemm = 2 * s * (h * 1536 + 1536 * a * 192 + h * (512 + 64) + 512 * a * 256 + a * 128 * h)
    names = ("q_down", "q_up", "kv_down", "kv_up", "attention_out")
    assert sum(ops[n].fwd_flops for n in names) == gemm
    assert ops["attention"].fwd_flops == 2 * s * (s + 1) / 2 * a * (192 + 128)


def test_profiles_carry_the_moe_record_of_every_sparse_block() -> None:
    prof = analytic_profile("deepseek-v3", "h100", batch_sizes=(1, 2))
    spec = PRESETS["deepseek-v3"]
    assert sum(ly.parameter_bytes for ly in prof.layers) == 4 * spec.parameters()
    blocks = prof.layers[1:-1]
    assert [ly.moe is None for ly in blocks] == [True] * 3 + [False] * 58
    moe = blocks[-1].moe
    assert moe is not None
    assert moe.expert_parameter_bytes == 4 * 256 * 3 * 7168 * 2048
    assert blocks[-1].parameter_bytes - moe.expert_parameter_bytes == 4 * (
        spec.block_parameters() - spec.moe.routed_parameters(7168)  # type: ignore[union-attr]
    )
    assert moe.tokens_per_expert_per_sample == 4096 * 8 / 256
    assert moe.dispatch_bytes_per_sample == moe.combine_bytes_per_sample == 4096 * 8 * 7168 * 2
    assert moe.router_time_share is not None and moe.expert_time_share is not None
    assert 0 < moe.router_time_share[0] < 0.05 < moe.expert_time_share[0] < 1


def test_recomputed_experts_count_in_the_backward_share() -> None:
    costs = layer_costs(PRESETS["mixtral-8x7b"], "bf16", recompute="full")
    block = costs[1]
    assert {op.name for op in block.recomputed} >= ROUTER_OPS | EXPERT_OPS
    none = analytic_profile("mixtral-8x7b", "h100", batch_sizes=(1,))
    full = analytic_profile("mixtral-8x7b", "h100", batch_sizes=(1,), recompute="full")
    shares = [p.layers[1].moe.expert_time_share for p in (none, full)]  # type: ignore[union-attr]
    assert shares[0] is not None and shares[1] is not None
    assert shares[1][0] == pytest.approx(shares[0][0])  # the forward is the same
    assert shares[1][1] != pytest.approx(shares[0][1])  # the backward re-runs the forward


# -- the command --------------------------------------------------------------------------


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_dapple_profile_analytic_writes_moe_profiles(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--analytic", "h100", "-m", name, "-o", str(out)]) == 0
    spec = PRESETS[name]
    sparse = spec.layers - (spec.moe.dense_layers if spec.moe else 0)
    assert f"{name}: mixture-of-experts layers ({sparse})" in capsys.readouterr().out
    prof = ModelProfile.load(out)
    assert prof.model_name == name
    assert sum(ly.parameter_bytes for ly in prof.layers) == 4 * PRESETS[name].parameters()
    assert prof.layers[-2].moe is not None
    assert prof.layers[-2].moe.experts == PRESETS[name].moe.experts  # type: ignore[union-attr]
