"""The profile as one rank of an expert-parallel stage holds it (:mod:`dapple.cost.moe`): each
MoE layer's experts ``1/e_s`` (:func:`expert_sharded_profile`), and that profile's dense part
apart from its experts (:func:`expert_parts`), which ZeRO-1/2 shards at e_s = r_s where the
experts stay whole. A layer whose parameter bytes these change loses its sizes one by one
(``LayerProfile.parameter_sizes``): its gradient buckets count it as one tensor. Pure, no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dapple.core.layer_profile import LayerProfile
from dapple.core.profile import ModelProfile

__all__ = ["expert_parts", "expert_sharded_profile"]


def _shard_layer(layer: LayerProfile, width: int) -> LayerProfile:
    """``layer`` as one rank of EP width e_s holds it: its experts' bytes ``/ e_s`` (rounded
    up), taken off its parameters, its MoE record's and (when recorded) its cast parameters."""
    if layer.moe is None or width == 1:
        return layer
    expert = layer.moe.expert_parameter_bytes
    cut = expert - -(-expert // width)
    cast = layer.cast_parameter_bytes
    return dataclasses.replace(
        layer,
        parameter_bytes=layer.parameter_bytes - cut,
        cast_parameter_bytes=None if cast is None else max(0, cast - cut),
        moe=dataclasses.replace(layer.moe, expert_parameter_bytes=expert - cut),
        parameter_sizes=None,
    )


def expert_sharded_profile(profile: ModelProfile, width: int) -> ModelProfile:
    """``profile`` with every MoE layer's parameters as one rank of EP width e_s holds them,
    ``P_dense + P_experts / e_s``: the memory model (:mod:`dapple.cost.memory`,
    :mod:`dapple.cost.peak_memory`) then counts the experts' parameters, gradients and optimizer
    state ``1/e_s`` on each rank. ``profile`` itself at e_s = 1."""
    if width == 1 or all(x.moe is None for x in profile.layers):
        return profile
    memory = profile.memory_at
    return dataclasses.replace(
        profile,
        layers=tuple(_shard_layer(x, width) for x in profile.layers),
        memory_at=None
        if memory is None
        else dataclasses.replace(
            memory, layers=tuple(_shard_layer(x, width) for x in memory.layers)
        ),
    )


def _part(layer: LayerProfile, width: int, experts: bool) -> LayerProfile:
    """``layer``'s experts as one rank of EP width e_s holds them (``experts``) or the rest."""
    if layer.moe is None:
        return layer if not experts else dataclasses.replace(
            layer, parameter_bytes=0, cast_parameter_bytes=None, tied_parameter_bytes=0,
            tied_layers=(), parameter_sizes=None,
        )  # fmt: skip
    expert = layer.moe.expert_parameter_bytes
    mine = -(-expert // width)
    cast = layer.cast_parameter_bytes
    if experts:
        return dataclasses.replace(
            layer, parameter_bytes=mine, cast_parameter_bytes=None if cast is None else
            min(cast, mine), tied_parameter_bytes=0, tied_layers=(),
            moe=dataclasses.replace(layer.moe, expert_parameter_bytes=mine), parameter_sizes=None,
        )  # fmt: skip
    return dataclasses.replace(
        layer, parameter_bytes=layer.parameter_bytes - expert,
        cast_parameter_bytes=None if cast is None else max(0, cast - expert), moe=None,
        parameter_sizes=None,
    )  # fmt: skip


def expert_parts(profile: ModelProfile, width: int) -> tuple[ModelProfile, ModelProfile]:
    """``profile`` split into its dense part (every MoE layer without its experts) and its
    experts as one rank of EP width e_s holds them (every other parameter 0): the memory model
    counts ZeRO's sharding on the first only (each rank's experts have no other holder at
    e_s = r_s). Parameters only: the activations stay the first's."""

    def split(layers: Sequence[LayerProfile], experts: bool) -> tuple[LayerProfile, ...]:
        return tuple(_part(x, width, experts) for x in layers)

    out = []
    for experts in (False, True):
        memory = profile.memory_at
        out.append(dataclasses.replace(
            profile, layers=split(profile.layers, experts),
            memory_at=None if memory is None else dataclasses.replace(
                memory, layers=split(memory.layers, experts)),
        ))  # fmt: skip
    return out[0], out[1]
