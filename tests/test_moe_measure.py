"""Measured mixture-of-experts profiles (issue 45 item 1): Hugging Face Mixtral and Qwen2-MoE
from tiny configs, router, experts and the rest of their layers timed apart, the expert load
counted, and the records put on a measured profile's layers. Nothing here depends on how fast
anything ran: only on what was counted and how the times are combined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler.moe_measure import (
    BlockMeasurement,
    configured_experts,
    measure_moe,
    moe_record,
    with_moe,
)

tf = pytest.importorskip("transformers")

SEQ, HIDDEN, FFN = 16, 32, 64
SIZES: dict[str, Any] = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                             max_position_embeddings=64, num_experts_per_tok=2)  # fmt: skip


def _save(kind: str, path: Path) -> Path:
    import torch

    if kind == "mixtral":
        config = tf.MixtralConfig(**SIZES, num_local_experts=4)
    elif kind == "qwen2_moe":
        config = tf.Qwen2MoeConfig(**SIZES, num_experts=6, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=48)  # fmt: skip
    elif kind == "deepseek_v3":
        config = tf.DeepseekV3Config(**{**SIZES, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                     first_k_dense_replace=1,
                                     n_routed_experts=8, n_shared_experts=1,
                                     moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=8,
                                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                     n_group=2, topk_group=1)  # fmt: skip
    else:
        config = tf.LlamaConfig(**{k: v for k, v in SIZES.items() if k != "num_experts_per_tok"})
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _workload(kind: str, tmp_path: Path) -> Any:
    from dapple.models.hf import hf_causal_lm

    return hf_causal_lm(_save(kind, tmp_path / kind), seq=SEQ)


def _profile_like(workload: Any, parameter_bytes: int = 10**7) -> ModelProfile:
    """A profile with the workload's layer names (times made up: not measured here)."""
    t = AffineTime(fixed_ms=0.0, per_sample_ms=1.0)
    return ModelProfile(model_name=workload.name, layers=tuple(
        LayerProfile(name=n, forward=t, backward=t, output_bytes_per_sample=1.0,
                     parameter_bytes=parameter_bytes, kept_activation_bytes_per_sample=1.0)
        for n in workload.layer_names))  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "experts", "expert_ffn"), [("mixtral", 4, FFN), ("qwen2_moe", 6, 24)]
)
def test_hf_moe_blocks_are_measured_apart_and_their_load_counted(
    kind: str, experts: int, expert_ffn: int, tmp_path: Path
) -> None:
    wl = _workload(kind, tmp_path)
    assert configured_experts(wl) == experts
    measured = measure_moe(wl, [1, 2], warmup=0, repeats=1)
    assert [(m.path, m.batch_size) for m in measured] == [
        (f"model.layers.{i}.mlp", b) for b in (1, 2) for i in range(2)
    ]
    for m in measured:
        assert m.layer == m.path.removesuffix(".mlp")
        assert (m.experts, m.top_k, m.tokens_per_sample) == (experts, 2, SEQ)
        assert len(m.load) == experts and sum(m.load) == m.batch_size * SEQ * 2
        # the routed experts only (Qwen's shared expert is dense): gate, up and down, fp32
        assert m.expert_parameter_bytes == experts * 3 * HIDDEN * expert_ffn * 4
        assert m.token_bytes == HIDDEN * 4
        assert all(t > 0 for t in (*m.layer_ms, *m.router_ms, *m.experts_ms))
    prof = with_moe(_profile_like(wl), measured)
    assert [ly.moe is not None for ly in prof.layers] == [False, True, True, False]
    moe = prof.layers[1].moe
    assert moe is not None and moe.experts == experts
    assert moe.tokens_per_expert_per_sample == SEQ * 2 / experts
    assert moe.max_tokens_per_expert_per_sample is not None
    assert moe.max_tokens_per_expert_per_sample >= moe.tokens_per_expert_per_sample
    assert moe.dispatch_bytes_per_sample == SEQ * 2 * HIDDEN * 4
    assert moe.router_time_share is not None and moe.expert_time_share is not None
    shares = zip(moe.router_time_share, moe.expert_time_share, strict=True)
    assert all(r + x <= 1 + 1e-9 for r, x in shares)
    path = tmp_path / "p.json"
    prof.save(path)
    assert ModelProfile.load(path) == prof


def test_deepseek_v3_measures_its_sparse_blocks_not_its_dense_first(tmp_path: Path) -> None:
    wl = _workload("deepseek_v3", tmp_path)
    measured = measure_moe(wl, [2], warmup=0, repeats=1)
    assert [m.path for m in measured] == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert all(sum(m.load) == 2 * SEQ * 2 and m.experts == 8 for m in measured)
    prof = with_moe(_profile_like(wl), measured)
    assert [ly.moe is not None for ly in prof.layers] == [False, False, True, True, False]


def test_a_dense_model_has_nothing_to_measure(tmp_path: Path) -> None:
    wl = _workload("llama", tmp_path)
    assert configured_experts(wl) == 0
    assert measure_moe(wl, [1], warmup=0, repeats=1) == []
    prof = _profile_like(wl)
    assert with_moe(prof, []) == prof


def _m(path: str = "model.layers.0.mlp", b: int = 2, **kw: Any) -> BlockMeasurement:
    base: dict[str, Any] = dict(
        path=path, layer=path.removesuffix(".mlp"), batch_size=b, experts=4, top_k=2,
        expert_parameter_bytes=1000, tokens_per_sample=8, token_bytes=16,
        layer_ms=(10.0, 20.0), router_ms=(1.0, 2.0), experts_ms=(4.0, 6.0),
        load=(b * 2, b * 4, b * 6, b * 4),
    )  # fmt: skip
    return BlockMeasurement(**{**base, **kw})


def test_record_shares_are_of_the_largest_batch_and_the_peak_a_median() -> None:
    rec = moe_record([
        _m(b=1, load=(1, 3, 9, 3)), _m(b=2, layer_ms=(20.0, 40.0)), _m(b=4, load=(8, 8, 8, 8)),
    ])  # fmt: skip
    assert rec.router_time_share == (0.1, 0.1) and rec.expert_time_share == (0.4, 0.3)
    assert rec.tokens_per_expert_per_sample == 8 * 2 / 4
    assert rec.max_tokens_per_expert_per_sample == 6.0  # median of 9, 6, 2 -> 6
    assert rec.imbalance == 1.5
    # each expert's median tokens per sample: (1, 2, 2), (3, 4, 2), (9, 6, 2), (3, 4, 2)
    assert rec.expert_load_shares == pytest.approx((2 / 14, 3 / 14, 6 / 14, 3 / 14))
    assert rec.member_imbalance(2) == pytest.approx(9 / 7)  # (2 + 3 | 6 + 3) of 14
    assert rec.dispatch_bytes_per_sample == rec.combine_bytes_per_sample == 8 * 2 * 16


def test_parts_longer_than_their_layer_are_scaled_to_it() -> None:
    rec = moe_record([_m(layer_ms=(2.5, 1.0))])
    assert rec.router_time_share == pytest.approx((1 / 5, 2 / 8))
    assert rec.expert_time_share == pytest.approx((4 / 5, 6 / 8))


def test_records_and_profiles_refuse_mismatches() -> None:
    with pytest.raises(ValidationError, match="measurements of one block"):
        moe_record([_m(), _m(path="model.layers.1.mlp")])
    with pytest.raises(ValidationError, match="measurements of one block"):
        moe_record([])
    t = AffineTime(fixed_ms=0.0, per_sample_ms=1.0)
    prof = ModelProfile(model_name="m", layers=tuple(
        LayerProfile(name=n, forward=t, backward=t, output_bytes_per_sample=1.0,
                     parameter_bytes=10**6, kept_activation_bytes_per_sample=1.0)
        for n in ("model.layers.1", "model.layers.10")))  # fmt: skip
    out = with_moe(prof, [_m("model.layers.10.mlp")])  # not model.layers.1's
    assert out.layers[0].moe is None and out.layers[1].moe is not None
    with pytest.raises(ValidationError, match=r"'model\.layers\.2\.mlp' is in no layer"):
        with_moe(prof, [_m("model.layers.2.mlp")])


@pytest.mark.slow
def test_dapple_profile_of_an_hf_mixtral_dir_records_its_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple.cli import main

    d = _save("mixtral", tmp_path / "mixtral")
    out = tmp_path / "p.json"
    args = ["profile", "-m", f"hf:{d}", "--batch-sizes", "1,2", "--repeats", "1", "--warmup",
            "0", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "hf-mixtral: mixture-of-experts layers (2)" in said
    prof = ModelProfile.load(out)
    moe = [ly.moe for ly in prof.layers]
    assert [m is not None for m in moe] == [False, True, True, False]
    assert all(m.experts == 4 and m.imbalance >= 1 for m in moe if m is not None)
