"""A mixture-of-experts record through the length-aware profile (``cost.at_length``): a layer at a
planned length keeps its record, with its per-sample tokens and bytes at that length."""

from __future__ import annotations

from typing import Any

import pytest

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.moe_profile import MoEProfile
from dapple.cost.at_length import layer_at_length, per_sample_at_length


def _moe(tokens: float, peak: float | None) -> MoEProfile:
    """Top-2 of 8 experts: ``tokens`` per expert per sample, 1024 bytes per token each way."""
    return MoEProfile(experts=8, top_k=2, expert_parameter_bytes=49152,
                      tokens_per_expert_per_sample=tokens, max_tokens_per_expert_per_sample=peak,
                      dispatch_bytes_per_sample=tokens * 4 * 1024,
                      combine_bytes_per_sample=tokens * 4 * 1024,
                      router_time_share=(0.05, 0.04))  # fmt: skip


def _layer(seq: float, moe: MoEProfile | None) -> LayerProfile:
    t = AffineTime(fixed_ms=0.1, per_sample_ms=seq / 100)
    return LayerProfile(name="block", forward=t, backward=t, output_bytes_per_sample=seq * 64,
                        parameter_bytes=100_000, kept_activation_bytes_per_sample=seq * 256,
                        moe=moe)  # fmt: skip


LENGTHS = [128.0, 512.0]


@pytest.mark.parametrize("L", [128.0, 300.0, 512.0, 1024.0])
def test_a_layer_at_a_length_keeps_its_moe_record_at_that_length(L: float) -> None:
    layers = [_layer(s, _moe(s / 4, s / 2)) for s in LENGTHS]
    got = layer_at_length(LENGTHS, layers, L).moe
    assert got is not None
    want: dict[str, Any] = {
        "tokens_per_expert_per_sample": per_sample_at_length(LENGTHS, [32.0, 128.0], L),
        "max_tokens_per_expert_per_sample": per_sample_at_length(LENGTHS, [64.0, 256.0], L),
        "dispatch_bytes_per_sample": per_sample_at_length(LENGTHS, [131072.0, 524288.0], L),
    }
    for field, value in want.items():
        assert getattr(got, field) == pytest.approx(value), field
    assert got.combine_bytes_per_sample == got.dispatch_bytes_per_sample
    assert (got.experts, got.top_k, got.expert_parameter_bytes) == (8, 2, 49152)
    assert got.router_time_share == (0.05, 0.04)
    if L in LENGTHS:  # a measured length: its own record
        assert got == layers[LENGTHS.index(L)].moe


def test_dense_layers_and_unmeasured_peaks_stay_so() -> None:
    dense = [_layer(s, None) for s in LENGTHS]
    assert layer_at_length(LENGTHS, dense, 300.0).moe is None
    no_peak = [_layer(s, _moe(s / 4, None if s == 512.0 else s / 2)) for s in LENGTHS]
    got = layer_at_length(LENGTHS, no_peak, 300.0).moe
    assert got is not None and got.max_tokens_per_expert_per_sample is None
