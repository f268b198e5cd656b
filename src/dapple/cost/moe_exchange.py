"""The expert exchange's costs beside its all-to-alls' bytes (:mod:`dapple.cost.moe`): the
route tables' all-gathers and, on CPU hosts, the host CPU of its collectives and copies. Pure,
no torch."""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.profile import ModelProfile
from dapple.cost.host import MIB

__all__ = ["EXCHANGE_CALLS", "expert_host_ms", "expert_table_ms"]


EXCHANGE_CALLS = (3, 2)
"""Collectives of one MoE layer's expert exchange on each member, ``(forward, backward)``: the
route table's all-gather, the dispatch and the combine all-to-all forward; their gradients'
two all-to-alls backward (:mod:`dapple.runtime.parallel.expert.exchange`)."""


def expert_host_ms(
    profile: ModelProfile, cluster: Cluster, layers: tuple[int, int], samples: int, width: int
) -> tuple[float, float]:
    """The host CPU the expert exchange adds to a member's F and B on a slice of ``samples``
    at EP width e_s > 1, on clusters with host terms (:mod:`dapple.cost.host`): per MoE layer,
    ``a`` per collective (:data:`EXCHANGE_CALLS`) and ``c`` per byte it sends and receives
    through the dispatch and the combine, ``(e - 1) / e`` of its rows' bytes sent and the
    busiest member's ``member_imbalance(e)`` times that received, each way. ``(0, 0)`` at e_s
    = 1 or without host terms."""
    if width <= 1 or not cluster.host_overheads:
        return 0.0, 0.0
    a, c = cluster.action_overhead_ms, cluster.comm_cpu_ms_per_mb / MIB
    f = b = 0.0
    for layer in profile.layers[layers[0] : layers[1]]:
        moe = layer.moe
        if moe is None:
            continue
        rows = (width - 1) / width * samples
        moved = (
            rows
            * (1 + moe.member_imbalance(width))
            * (moe.dispatch_bytes_per_sample + moe.combine_bytes_per_sample)
        )
        f += a * EXCHANGE_CALLS[0] + c * moved
        b += a * EXCHANGE_CALLS[1] + c * moved
    return f, b


def expert_table_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    shapes: frozenset[tuple[int, tuple[int, ...]]],
) -> float:
    """The route tables' all-gathers of a stage's forward: before its dispatch each MoE layer
    all-gathers every member's tokens per expert (E counts), one link latency on the slowest
    of the EP group ``shapes`` ((members, distinct members per server), as
    :func:`dapple.cost.moe.expert_group_shapes` gives them; across servers where a group spans
    them); their bytes are negligible."""
    moe_layers = sum(1 for x in profile.layers[layers[0] : layers[1]] if x.moe is not None)
    if not moe_layers:
        return 0.0
    lat = max(
        cluster.intra_server_latency_ms if counts == (e,) else cluster.inter_server_latency_ms
        for e, counts in shapes
        if e > 1
    )
    return moe_layers * lat
