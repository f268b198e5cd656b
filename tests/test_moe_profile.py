"""The mixture-of-experts record of a layer profile (issue 45 item 1): validation, the file
round trip, and dense profiles written exactly as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.moe_profile import MoEProfile
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler.paper_models import load_profile


def _moe(**kw: Any) -> MoEProfile:
    """Top-2 of 8 experts on 16 tokens of width 32 in fp32: 4 tokens per expert per sample,
    16 * 2 * 32 * 4 bytes each way."""
    base: dict[str, Any] = dict(
        experts=8, top_k=2, expert_parameter_bytes=8 * 3 * 32 * 64 * 4,
        tokens_per_expert_per_sample=4.0, dispatch_bytes_per_sample=4096.0,
        combine_bytes_per_sample=4096.0,
    )  # fmt: skip
    return MoEProfile(**{**base, **kw})


def _layer(moe: MoEProfile | None, parameter_bytes: int = 300_000) -> LayerProfile:
    t = AffineTime(fixed_ms=0.1, per_sample_ms=1.0)
    return LayerProfile(name="block0", forward=t, backward=t, output_bytes_per_sample=2048.0,
                        parameter_bytes=parameter_bytes, kept_activation_bytes_per_sample=1e4,
                        moe=moe)  # fmt: skip


def test_layer_round_trips_its_moe_record() -> None:
    moe = _moe(max_tokens_per_expert_per_sample=6.0, router_time_share=(0.05, 0.04),
               expert_time_share=(0.5, 0.55))  # fmt: skip
    layer = _layer(moe)
    back = LayerProfile.from_dict(json.loads(json.dumps(layer.to_dict())))
    assert back == layer
    assert back.moe is not None and back.moe.imbalance == 1.5


def test_dense_layers_write_no_moe_key_and_read_as_before(tmp_path: Path) -> None:
    layer = _layer(None)
    assert "moe" not in layer.to_dict()
    prof = load_profile("paper:bert48")
    assert all(ly.moe is None for ly in prof.layers)
    path = tmp_path / "p.json"
    prof.save(path)
    assert "moe" not in path.read_text()
    assert ModelProfile.load(path) == prof


def test_a_member_holds_the_tokens_of_all_its_experts() -> None:
    shares = (0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1)
    moe = _moe(max_tokens_per_expert_per_sample=9.6, expert_load_shares=shares)
    assert moe.imbalance == pytest.approx(2.4)
    # members hold 8, 4, 2, 1 experts: (0.6 | 0.4), (0.4 | 0.2 | 0.2 | 0.2), the busiest alone
    assert [moe.member_imbalance(e) for e in (1, 2, 4, 8)] == pytest.approx([1.0, 1.2, 1.6, 2.4])
    back = MoEProfile.from_dict(json.loads(json.dumps(moe.to_dict())))
    assert back == moe and back.expert_load_shares == shares
    # not measured: the busiest single expert bounds every member
    assert _moe(max_tokens_per_expert_per_sample=6.0).member_imbalance(2) == 1.5
    assert "expert_load_shares" not in _moe().to_dict()
    with pytest.raises(ValidationError, match="dividing the 8 experts, got 3"):
        moe.member_imbalance(3)
    for bad in ((0.5, 0.5), (0.2,) * 8, (-0.1, 0.3, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1)):
        with pytest.raises(ValidationError, match="8 fractions >= 0 summing to 1"):
            _moe(expert_load_shares=bad)


def test_unmeasured_routing_is_balanced() -> None:
    assert _moe().imbalance == 1.0
    assert _moe(tokens_per_expert_per_sample=0.0).imbalance == 1.0
    assert "max_tokens_per_expert_per_sample" not in _moe().to_dict()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"experts": 0}, "experts must be an integer >= 1, got 0"),
        ({"top_k": 9}, "top_k must be at most experts = 8, got 9"),
        ({"expert_parameter_bytes": -1}, "expert_parameter_bytes must be an integer >= 0"),
        ({"dispatch_bytes_per_sample": float("nan")}, "dispatch_bytes_per_sample"),
        ({"max_tokens_per_expert_per_sample": 3.0}, "number >= the mean 4.0, got 3.0"),
        ({"router_time_share": (0.5, 1.5)}, "router_time_share must be None or two fractions"),
        (
            {"router_time_share": (0.6, 0.1), "expert_time_share": (0.6, 0.1)},
            "add up to more than the layer's time",
        ),
    ],
)
def test_invalid_records_are_refused_naming_the_value(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _moe(**kw)


def test_expert_parameters_must_fit_in_the_layer() -> None:
    with pytest.raises(ValidationError, match="fit in parameter_bytes = 100"):
        _layer(_moe(), parameter_bytes=100)


def test_a_file_record_names_the_layer_and_the_field() -> None:
    d = _layer(_moe()).to_dict()
    del d["moe"]["top_k"]
    with pytest.raises(ValidationError, match=r"layer 0\.moe.*top_k"):
        LayerProfile.from_dict(d)
    d = _layer(_moe()).to_dict()
    d["moe"]["router_time_share"] = "half"
    with pytest.raises(ValidationError, match="router_time_share"):
        LayerProfile.from_dict(d)


@given(
    experts=st.integers(1, 512),
    k=st.integers(1, 16),
    tokens=st.floats(0, 1e6),
    extra=st.floats(0, 1e3),
    shares=st.tuples(st.floats(0, 0.5), st.floats(0, 0.5)),
)
def test_any_valid_record_round_trips(
    experts: int, k: int, tokens: float, extra: float, shares: tuple[float, float]
) -> None:
    moe = _moe(experts=experts, top_k=min(k, experts), tokens_per_expert_per_sample=tokens,
               max_tokens_per_expert_per_sample=tokens + extra, router_time_share=shares,
               expert_time_share=shares)  # fmt: skip
    assert MoEProfile.from_dict(json.loads(json.dumps(moe.to_dict()))) == moe
    assert moe.imbalance >= 1.0
    assert dataclasses.replace(moe, max_tokens_per_expert_per_sample=None).imbalance == 1.0
