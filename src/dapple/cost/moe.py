"""Expert parallelism of one stage: memory per rank, the dispatch and combine all-to-alls, the
experts' and dense gradients' AllReduces. Pure, no torch.

A stage of r_s replicas may shard the routed experts of its mixture-of-experts layers over an
expert-parallel (EP) width e_s dividing r_s: replicas ``[j e_s, (j+1) e_s)`` form EP group j and
each member holds E / e_s of every layer's experts; everything else (attention, router, shared
experts, norms: the dense part) stays replicated on all r_s. Tokens travel to the members
holding their experts and back by two all-to-alls per layer forward (dispatch, combine) and two
backward (their gradients). Replica ``i`` of every EP group holds the same experts: those r_s /
e_s replicas all-reduce the experts' gradients, while the dense gradients are all-reduced over
all r_s, as ``AR(P_s, g_s)`` (:func:`~dapple.cost.comm.allreduce_ms`).

Links are the comm model's (:mod:`dapple.cost.comm`): a device's own link inside a server, and
one network interface per server shared by all traffic leaving it. Routing is uniform unless
the profile measured it: the busiest member of an EP group, holding E / e_s experts, receives
the tokens of all of them, ``member_imbalance(e_s)`` times its mean
(:meth:`~dapple.core.moe_profile.MoEProfile.member_imbalance`: from each expert's measured share
of the tokens, else bounded by the busiest single expert's), the factor on its all-to-all bytes
and its experts' compute.

A plan's stage of width e_s > 1 is costed from these (:func:`check_expert_stage`,
:func:`expert_slice_times`, :func:`expert_stage_sync_ms`, :func:`expert_sharded_profile`, read by
:func:`dapple.cost.terms.stage_terms` and :func:`dapple.cost.peak_memory.plan_stage_bytes`): it
extends the terms of the paper's latency (section 5.1, equation 1: F_s and B_s in T_w and T_s,
AR(P_s, g_s) in T_e) as

    F_s' = F_s + A2A_s + route tables (+ the busiest member's extra compute, + host CPU)
    B_s' = B_s + A2A_s (+ host CPU, + the forward's again under re-computation)
    AR_s' = AR(P_dense, g_s) + AR(P_experts / e_s, r_s / e_s replicas per shard)
    memory: P_dense + P_experts / e_s per rank, gradients and optimizer state alike

and, under ZeRO-1/2 (what ``dapple.runtime.parallel.expert`` runs), the dense part's optimizer
state (and ZeRO-2's gradients) 1/r_s as without EP, the experts' 1/(r_s/e_s) over the copies of
each shard - whole on their one holder at e_s = r_s (:func:`expert_parts`, read by
:func:`dapple.cost.peak_memory.expert_stage_state_bytes`); the update then covers
P_dense / r_s + (P_experts / e_s) / (r_s / e_s) = (P_dense + P_experts) / r_s per replica, and
AR_s moves the same bytes as at ZeRO 0 (a reduce-scatter and an all-gather for each
AllReduce), ZeRO-2 reduce-scattering both parts after each of the M backwards:
``(M + 1) / 2`` x AR_s, as :func:`~dapple.cost.comm.stage_sync_ms` prices ZeRO-2 without EP.

with A2A_s the dispatch and combine of all its MoE layers at the stage's largest slice (an
all-to-all paces every member of its group by the largest sender), the slowest of its EP groups.

Not modelled: the experts' per-call weight traffic that sharding also divides by e_s (the weight
gradients written per backward), token dropping (routing is dropless), kept activations
(on average unchanged per rank), the all-to-all's buffers, and expert parallelism combined
with tensor parallelism or ZeRO-3 (refused by :func:`check_expert_stage`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import LayerProfile
from dapple.core.moe_profile import MoEProfile
from dapple.core.parallelism import Parallelism
from dapple.core.plan import StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.comm import allreduce_ms
from dapple.cost.compute import compute_ms
from dapple.cost.moe_exchange import expert_host_ms, expert_table_ms
from dapple.cost.moe_memory import expert_parts, expert_sharded_profile
from dapple.errors import ValidationError

__all__ = [
    "SliceTimes",
    "alltoall_ms",
    "check_expert_stage",
    "check_expert_width",
    "expert_allreduce_ms",
    "expert_alltoall_ms",
    "expert_compute_ms",
    "expert_group_shapes",
    "expert_parts",
    "expert_sharded_profile",
    "expert_slice_times",
    "expert_stage_sync_ms",
    "expert_widths",
    "layer_alltoall_ms",
    "moe_sync_ms",
    "rank_parameter_bytes",
    "stage_alltoall_ms",
    "stage_rank_parameter_bytes",
]


def _gbps_to_bytes_per_ms(gbps: float) -> float:
    return gbps * 1e9 / 8 / 1e3


def check_expert_width(replicas: int, width: int, profile: ModelProfile | None = None) -> None:
    """Refuse an EP width e_s that does not divide the stage's r_s replicas, or (given the
    profile) the experts E of one of its mixture-of-experts layers.

    Raises:
        ValidationError: one line naming the width, the replicas or the layer and its E.
    """
    if not (isinstance(width, int) and not isinstance(width, bool) and width >= 1):
        raise ValidationError(f"expert-parallel width must be an integer >= 1, got {width!r}")
    if replicas % width:
        raise ValidationError(
            f"expert-parallel width {width} must divide the stage's {replicas} replicas"
        )
    for i, layer in enumerate(profile.layers if profile is not None else ()):
        if layer.moe is not None and layer.moe.experts % width:
            raise ValidationError(
                f"expert-parallel width {width} must divide the {layer.moe.experts} experts of "
                f"layer {i} ({layer.name!r})"
            )


# -- memory ---------------------------------------------------------------------------------


def rank_parameter_bytes(dense_bytes: float, expert_bytes: float, width: int) -> float:
    """Parameter bytes one rank holds of a layer: ``P_dense + P_experts / e_s`` (the
    optimizer state and gradients scale with them, :mod:`dapple.cost.memory`).

    Args:
        dense_bytes: the layer's replicated parameters.
        expert_bytes: its routed experts' parameters (all E).
        width: e_s.
    """
    return dense_bytes + expert_bytes / width


def _expert_bytes(layer: LayerProfile) -> int:
    return layer.moe.expert_parameter_bytes if layer.moe is not None else 0


def stage_rank_parameter_bytes(profile: ModelProfile, layers: tuple[int, int], width: int) -> float:
    """:func:`rank_parameter_bytes` summed over a stage's layers ``[start, end)`` (a dense
    layer's parameters all replicated)."""
    total = 0.0
    for layer in profile.layers[layers[0] : layers[1]]:
        expert = _expert_bytes(layer)
        total += rank_parameter_bytes(layer.parameter_bytes - expert, expert, width)
    return total


# -- all-to-all -----------------------------------------------------------------------------


def alltoall_ms(cluster: Cluster, nbytes: float, devices: Sequence[int]) -> float:
    """One all-to-all over ``devices`` (an EP group of e members) in which each member sends
    ``nbytes``, ``nbytes / e`` to every member (its own share stays).

    The exchanges run at once; on a server holding c members each member's link carries its
    ``(c - 1) nbytes / e`` to the others there, and the server's network interface the
    ``c (e - c) nbytes / e`` they send off the server; the busiest server paces the step:

        max over servers of max(lat_intra + (c-1)/e * nbytes / bw_intra,
                                lat_inter + c (e-c)/e * nbytes / bw_inter)

    (each term only where such traffic exists). 0 for one member or no bytes.

    Args:
        cluster: bandwidths and latencies.
        nbytes: bytes each member sends in all, its own share included.
        devices: the members' device ids.
    """
    return _shape_alltoall_ms(cluster, nbytes, _shape(cluster, devices))


_Shape = tuple[int, tuple[int, ...]]
"""An EP group as the all-to-all sees it: its e members and the distinct counts of members per
server (what :func:`alltoall_ms` reads of the device ids)."""


def _shape(cluster: Cluster, devices: Sequence[int]) -> _Shape:
    counts: dict[int, int] = {}
    for d in devices:
        s = cluster.server_of(d)
        counts[s] = counts.get(s, 0) + 1
    return len(devices), tuple(sorted(set(counts.values())))


def _shape_alltoall_ms(cluster: Cluster, nbytes: float, shape: _Shape) -> float:
    """:func:`alltoall_ms` of a group of that shape."""
    e, counts = shape
    if e <= 1 or nbytes <= 0:
        return 0.0
    intra = _gbps_to_bytes_per_ms(cluster.intra_server_bandwidth_gbps)
    inter = _gbps_to_bytes_per_ms(cluster.inter_server_bandwidth_gbps)
    t = 0.0
    for c in counts:
        if c > 1:
            t = max(t, cluster.intra_server_latency_ms + (c - 1) / e * nbytes / intra)
        if c < e:
            t = max(t, cluster.inter_server_latency_ms + c * (e - c) / e * nbytes / inter)
    return t


def layer_alltoall_ms(
    cluster: Cluster, moe: MoEProfile, samples: float, devices: Sequence[int]
) -> float:
    """The forward's dispatch and combine of one mixture-of-experts layer on ``samples`` per
    member: ``A2A(m x b x dispatch) + A2A(m x b x combine)`` with m the busiest member's
    ``member_imbalance(e)`` (its receiver's way in paces the exchange); the backward
    sends their gradients the same ways, in the same time.

    Args:
        cluster: bandwidths and latencies.
        moe: the layer's record (bytes per sample, imbalance).
        samples: samples of one micro-batch on each member (its slice).
        devices: the EP group's device ids.
    """
    return _shape_layer_ms(cluster, moe, samples, _shape(cluster, devices))


def _shape_layer_ms(cluster: Cluster, moe: MoEProfile, samples: float, shape: _Shape) -> float:
    """:func:`layer_alltoall_ms` over a group of that shape."""
    scale = moe.member_imbalance(shape[0]) * samples
    return _shape_alltoall_ms(
        cluster, scale * moe.dispatch_bytes_per_sample, shape
    ) + _shape_alltoall_ms(cluster, scale * moe.combine_bytes_per_sample, shape)


def stage_alltoall_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    devices: Sequence[int],
    samples: float,
) -> float:
    """:func:`layer_alltoall_ms` summed over the mixture-of-experts layers of a stage's
    ``[start, end)``: what the all-to-alls add to its F_s per micro-batch (and to B_s)."""
    return _shape_stage_ms(profile, cluster, layers, _shape(cluster, devices), samples)


def _shape_stage_ms(
    profile: ModelProfile, cluster: Cluster, layers: tuple[int, int], shape: _Shape, samples: float
) -> float:
    """:func:`stage_alltoall_ms` over a group of that shape."""
    return sum(
        _shape_layer_ms(cluster, layer.moe, samples, shape)
        for layer in profile.layers[layers[0] : layers[1]]
        if layer.moe is not None
    )


def expert_compute_ms(ms: float, expert_share: float, imbalance: float, width: int) -> float:
    """A layer's time on the busiest member of its EP group: the routed experts' share
    ``x`` of the time ``t`` scaled by the imbalance bound, ``t (1 - x) + t x imbalance``
    when e_s > 1; ``t`` at e_s = 1 (every replica runs its own tokens through all experts).

    Args:
        ms: the layer's forward or backward time.
        expert_share: the experts' fraction of it (``MoEProfile.expert_time_share``).
        imbalance: the busiest member's tokens over the mean (>= 1,
            ``MoEProfile.member_imbalance``).
        width: e_s.
    """
    if width <= 1:
        return ms
    return ms * (1 - expert_share) + ms * expert_share * imbalance


# -- gradients ------------------------------------------------------------------------------


def expert_allreduce_ms(
    cluster: Cluster, expert_bytes: float, devices: Sequence[int], width: int
) -> float:
    """The experts' gradient AllReduce of a stage: member i of every EP group (``devices[i::
    e_s]``, r_s / e_s replicas) all-reduces the ``expert_bytes / e_s`` it holds; the e_s
    groups run at once.

    Each group is the hierarchical ring of :func:`~dapple.cost.comm.allreduce_ms`; the groups
    use different devices inside a server, but share each server's network interface, which
    carries ``2 (k_g - 1) / k_g x bytes`` of every group g spanning k_g > 1 servers:

        max_g intra_g + max over servers of (sum over its groups g of that, / bw_inter)
                      + 2 (k - 1) lat_inter

    At e_s = 1 this is ``AR(P_experts, all r_s)``; at e_s = r_s, 0 (no copies).

    Args:
        cluster: bandwidths and latencies.
        expert_bytes: the stage's routed experts' gradient bytes (all E of every layer).
        devices: the stage's replicas' device ids, in replica order.
        width: e_s, dividing ``len(devices)``.

    Raises:
        ValidationError: e_s does not divide the replicas.
    """
    check_expert_width(len(devices), width)
    nbytes = expert_bytes / width
    if len(devices) // width <= 1 or nbytes <= 0:
        return 0.0
    intra = _gbps_to_bytes_per_ms(cluster.intra_server_bandwidth_gbps)
    inter = _gbps_to_bytes_per_ms(cluster.inter_server_bandwidth_gbps)
    intra_ms, k_max = 0.0, 1
    nic_bytes: dict[int, float] = {}
    for g in (devices[i::width] for i in range(width)):
        servers = [cluster.server_of(d) for d in g]  # one group's ring, as allreduce_ms
        k = len(set(servers))
        c = max(servers.count(s) for s in set(servers))
        if c > 1:
            phase = (c - 1) / c * nbytes / intra + (c - 1) * cluster.intra_server_latency_ms
            intra_ms = max(intra_ms, 2 * phase)
        if k > 1:
            k_max = max(k_max, k)
            for s in set(servers):
                nic_bytes[s] = nic_bytes.get(s, 0.0) + 2 * (k - 1) / k * nbytes
    inter_ms = max(nic_bytes.values(), default=0.0) / inter
    return intra_ms + inter_ms + 2 * (k_max - 1) * cluster.inter_server_latency_ms


def moe_sync_ms(
    cluster: Cluster,
    dense_bytes: float,
    expert_bytes: float,
    devices: Sequence[int],
    width: int,
    reductions: int = 1,
) -> float:
    """A stage's gradient synchronisation with EP width e_s: ``AR(P_dense, r_s)`` over all
    replicas, then :func:`expert_allreduce_ms` of the experts over r_s / e_s replicas each
    (in turn, as a runtime reducing its buckets one after the other would); under ZeRO-1 the
    same bytes (reduce-scatters, then all-gathers), under ZeRO-2 ``(M + 1) / 2`` times them
    (a reduce-scatter of both parts after each of the M backwards, ``reductions`` = M, then
    the all-gathers), as :func:`~dapple.cost.comm.stage_sync_ms` prices them.

    Raises:
        ValidationError: e_s does not divide the replicas.
    """
    ar = allreduce_ms(cluster, dense_bytes, devices) + expert_allreduce_ms(
        cluster, expert_bytes, devices, width
    )
    return ar * (reductions + 1) / 2


# -- a plan's stage -------------------------------------------------------------------------

SliceTimes = tuple[tuple[float, float], tuple[float, float]]
"""``((F, B), (I, W))`` of one replica's slice, as :mod:`dapple.cost.terms` keeps them."""


def expert_widths(profile: ModelProfile, layers: tuple[int, int], replicas: int) -> list[int]:
    """The EP widths e_s a stage of layers ``[start, end)`` on r_s replicas may take: the
    divisors of r_s that divide every MoE layer's E, ascending; ``[1]`` for a stage without
    MoE layers."""
    experts = [x.moe.experts for x in profile.layers[layers[0] : layers[1]] if x.moe is not None]
    if not experts:
        return [1]
    g = math.gcd(*experts)
    return [e for e in range(1, replicas + 1) if replicas % e == 0 and g % e == 0]


def check_expert_stage(profile: ModelProfile, stage: StagePlan, parallel: Parallelism) -> None:
    """Refuse a stage whose EP width the cost model does not price: e_s > 1 with a tensor
    width t_s > 1 or ZeRO-3 (``parallel``: the stage's layout under the run's ZeRO floor), or
    an e_s that does not divide one of its MoE layers' E (:func:`check_expert_width`).
    Nothing to check at e_s = 1.

    Raises:
        ValidationError: one line naming the stage's layers and the offending value.
    """
    e = stage.expert_width
    if not stage.parallel.expert_parallel:
        return
    what = f"stage {list(stage.layers)} (expert_width {e})"
    if stage.parallel.tensor_parallel:
        raise ValidationError(
            f"{what}: expert parallelism with tensor_width {stage.tensor_width} is not costed; "
            "use tensor_width 1"
        )
    if parallel.shards_params:
        raise ValidationError(
            f"{what}: expert parallelism with zero_stage {parallel.zero_stage} is not costed; "
            "use 0, 1 or 2"
        )
    sub = dataclasses.replace(profile, layers=profile.layers[stage.layers[0] : stage.layers[1]])
    try:
        check_expert_width(stage.replicas, e, sub)
    except ValidationError as err:
        raise ValidationError(f"{what}: {err}") from err


def _groups(stage: StagePlan) -> list[tuple[int, ...]]:
    """The device ids of each EP group of ``stage`` (t_s = 1)."""
    e, d = stage.expert_width, stage.replica_devices
    return [d[k : k + e] for k in range(0, len(d), e)]


def _busiest_expert_ms(
    profile: ModelProfile, cluster: Cluster, layers: tuple[int, int], n: int, width: int
) -> tuple[float, float, float]:
    """``(forward, I, W)`` the busiest member of an EP group of width e_s adds on a slice of n
    samples: per MoE layer with measured routing and expert time shares,
    :func:`expert_compute_ms` at its ``member_imbalance(e_s)`` less its time; the backward's
    part split between I and W as the layer's backward splits."""
    f_x = i_x = w_x = 0.0
    for i in range(*layers):
        moe = profile.layers[i].moe
        if moe is None or moe.expert_time_share is None:
            continue
        imbalance = moe.member_imbalance(width)
        if imbalance <= 1.0:
            continue
        f, b = compute_ms(profile, cluster, (i, i + 1), n)
        xf, xb = moe.expert_time_share
        f_x += expert_compute_ms(f, xf, imbalance, width) - f
        extra_b = expert_compute_ms(b, xb, imbalance, width) - b
        bi, bw = profile.layers[i].backward_split(n)
        share = bi / (bi + bw) if bi + bw > 0 else 1.0
        i_x += extra_b * share
        w_x += extra_b * (1.0 - share)
    return f_x, i_x, w_x


def expert_slice_times(
    profile: ModelProfile,
    cluster: Cluster,
    stage: StagePlan,
    times: Mapping[int, SliceTimes],
    largest: int,
    a2a: float | None = None,
) -> dict[int, SliceTimes]:
    """The slice times of a stage of EP width e_s > 1 (``times`` as the stage costs them
    without expert parallelism, per slice size): A2A_s (``a2a``, or
    :func:`expert_alltoall_ms` at the ``largest`` slice), added to F, to B and to I (the
    backward's all-to-alls carry input gradients), the route tables' all-gathers
    (:func:`expert_table_ms`) to F, both once more to B and I under re-computation;
    plus the busiest member's compute (:func:`_busiest_expert_ms`) and, on hosts with CPU
    terms, the exchange's host CPU (:func:`expert_host_ms`). ``times`` unchanged at e_s = 1."""
    if not stage.parallel.expert_parallel:
        return dict(times)
    if a2a is None:
        a2a = expert_alltoall_ms(
            profile, cluster, stage.layers, expert_group_shapes(cluster, stage), largest
        )
    out: dict[int, SliceTimes] = {}
    e = stage.expert_width
    table = expert_table_ms(profile, cluster, stage.layers, expert_group_shapes(cluster, stage))
    for n, ((f, b), (i, w)) in times.items():
        fx, ix, wx = _busiest_expert_ms(profile, cluster, stage.layers, n, e)
        hf, hb = expert_host_ms(profile, cluster, stage.layers, n, e)
        fwd = a2a + table + fx + hf
        to_i = a2a + ix + hb + (fwd if stage.recompute else 0.0)
        if stage.layers[0] == 0:  # the first stage runs its whole backward as W
            i, w = i, w + to_i + wx
        else:
            i, w = i + to_i, w + wx
        out[n] = ((f + fwd, b + to_i + wx), (i, w))
    return out


def expert_group_shapes(cluster: Cluster, stage: StagePlan) -> frozenset[_Shape]:
    """The distinct shapes of ``stage``'s EP groups (members, distinct members per server):
    all an all-to-all's price reads of them (groups alike cost alike)."""
    return frozenset(_shape(cluster, g) for g in _groups(stage))


def expert_alltoall_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    shapes: frozenset[_Shape],
    samples: int,
) -> float:
    """A2A_s: :func:`stage_alltoall_ms` of layers ``[start, end)`` on ``samples`` per member,
    on the slowest of the EP group ``shapes`` (:func:`expert_group_shapes`)."""
    return max(_shape_stage_ms(profile, cluster, layers, sh, samples) for sh in shapes)


def expert_stage_sync_ms(
    profile: ModelProfile,
    cluster: Cluster,
    stage: StagePlan,
    reductions: int = 1,
) -> float:
    """AR_s of a stage of EP width e_s (t_s = 1) with ``reductions`` of its gradients in a
    step (M under ZeRO-2, :meth:`~dapple.core.parallelism.Parallelism.gradient_reductions`):
    :func:`moe_sync_ms` of its dense and expert gradient bytes over its replicas;
    :func:`~dapple.cost.comm.stage_sync_ms` at e_s = 1."""
    s, e = stage.layers
    expert = float(sum(_expert_bytes(x) for x in profile.layers[s:e]))
    dense = sum(x.parameter_bytes for x in profile.layers[s:e]) - expert
    return moe_sync_ms(cluster, dense, expert, stage.devices, stage.expert_width, reductions)
