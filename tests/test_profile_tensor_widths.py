"""The tensor widths a model's sizes allow, recorded in its profile, bound the planner's widths.

A Hugging Face LLaMA with 2 key/value heads cannot be cut over 4 ranks; the runtime refuses such
a plan. The profiler records the widths the config allows (``ModelProfile.tensor_widths``), and
the planner's width search and the grid offer no other, so every plan made from a measured
profile is one the runtime accepts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from builders import make_cluster, make_profile
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.tp_plan import hf_tensor_widths
from dapple.planner.grid import factorisations
from dapple.planner.widths import width_candidates


def _shardable(widths: tuple[int, ...] | None) -> ModelProfile:
    prof = make_profile(4)
    layers = tuple(dataclasses.replace(x, tensor_parallel=True) for x in prof.layers)
    return dataclasses.replace(prof, layers=layers, tensor_widths=widths)


def test_widths_divide_every_size_a_tensor_group_cuts() -> None:
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    assert hf_tensor_widths(cfg, (1, 2, 4, 8)) == (1, 2)
    cfg = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
    assert hf_tensor_widths(cfg, (1, 2, 4, 8)) == (1, 2, 4, 8)
    assert hf_tensor_widths(SimpleNamespace(num_attention_heads=6), (1, 2, 4)) == (1, 2)


def test_the_planner_offers_only_recorded_widths() -> None:
    cluster = make_cluster(per_server=8)
    assert width_candidates(_shardable(None), cluster) == [1, 2, 4, 8]
    assert width_candidates(_shardable((1, 2)), cluster) == [1, 2]
    assert {tp for _, tp, _ in factorisations(_shardable((1, 2)), cluster)} == {1, 2}
    assert {tp for _, tp, _ in factorisations(_shardable(None), cluster)} == {1, 2, 4, 8}


def test_widths_round_trip_and_are_checked(tmp_path: Path) -> None:
    prof = _shardable((1, 2))
    prof.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == prof
    assert "tensor_widths" not in _shardable(None).to_dict()  # older files read as before
    bad = {**prof.to_dict(), "tensor_widths": ["2"]}
    with pytest.raises(ValidationError, match="tensor_widths must be a list of integers"):
        ModelProfile.from_dict(bad)


def test_a_measured_llama_profile_records_what_its_heads_allow(tmp_path: Path) -> None:
    tf = pytest.importorskip("transformers")
    import dapple.api as dp

    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=64)  # fmt: skip
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    prof = dp.profile(f"hf:{tmp_path / 'm'}", batch_sizes=[1], device="cpu", repeats=1)
    assert prof.tensor_widths == (1, 2)
    assert width_candidates(prof, make_cluster(per_server=4)) == [1, 2]
