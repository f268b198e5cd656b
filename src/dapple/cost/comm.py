"""Communication in the cost model: point-to-point transfers, split-concat comm stages and
the gradient AllReduce AR(P_s, g_s) (paper sections 5.1 and 6.2).

Cross-server traffic of one server shares its one network interface: the inter-server
bandwidth is per server, so concurrent transfers (and hierarchical AllReduce shards) leaving or
entering a server add up. Pure, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dapple.core.cluster import Cluster
from dapple.core.parallelism import Parallelism
from dapple.core.plan import StagePlan, slice_bounds
from dapple.core.profile import ModelProfile
from dapple.cost.memory import boundary_bytes

__all__ = [
    "Port",
    "allreduce_ms",
    "busiest_link_ms",
    "comm_stage_ms",
    "link_loads",
    "overlaps",
    "port_loads",
    "server_counts",
    "shared_samples",
    "stage_sync_ms",
    "transfer_ms",
    "transfer_ports",
]


def transfer_ms(cluster: Cluster, nbytes: float, src_device: int, dst_device: int) -> float:
    """Point-to-point time of ``nbytes``: link latency + bytes / bandwidth; 0 when nothing moves.

    Args:
        cluster: link classes (same server or across servers).
        nbytes: bytes sent.
        src_device: sending device id.
        dst_device: receiving device id (the same device costs nothing).
    """
    if nbytes <= 0 or src_device == dst_device:
        return 0.0
    return cluster.latency_ms(src_device, dst_device) + nbytes / cluster.bandwidth_bytes_per_ms(
        src_device, dst_device
    )


def server_counts(cluster: Cluster, devices: Sequence[int]) -> tuple[int, ...]:
    """How many of ``devices`` each server they span holds (one count per server, in order of
    first appearance)."""
    return _server_counts(cluster.devices_per_server, tuple(devices))


@functools.lru_cache(maxsize=1 << 12)
def _server_counts(per_server: int, devices: tuple[int, ...]) -> tuple[int, ...]:
    """:func:`server_counts`, remembered: a planner asks it for the same device sets with each
    stage's bytes (:meth:`Cluster.server_of <dapple.core.cluster.Cluster.server_of>`: device
    ``d`` is on server ``d // per_server``)."""
    counts: dict[int, int] = {}
    for d in devices:
        s = d // per_server
        counts[s] = counts.get(s, 0) + 1
    return tuple(counts.values())


def stage_sync_ms(
    cluster: Cluster,
    nbytes: float,
    devices: Sequence[int],
    reductions: int = 1,
) -> float:
    """The gradient and parameter synchronisation of a stage in one step, with ``reductions``
    of its gradients (:meth:`Parallelism.gradient_reductions
    <dapple.core.parallelism.Parallelism.gradient_reductions>`).

    No ZeRO: AR(P_s, g_s) (:func:`allreduce_ms`), a reduction of 1. ZeRO-1: a reduce-scatter
    of the gradients and an all-gather of the updated parameters
    (:mod:`dapple.runtime.parallel.zero`), each the ``(n-1)/n`` of the bytes that is one half of
    the ring AllReduce: AR in all. ZeRO-2: the reduce-scatter after each of the M backward
    passes (``reductions`` = M), then the all-gather: ``(M + 1) / 2`` x AR. The smaller
    optimizer update is not modelled (the cost model has no update term)."""
    ar = allreduce_ms(cluster, nbytes, devices)
    return ar * (reductions + 1) / 2


def stage_update_ms(
    cluster: Cluster, profile: ModelProfile, nbytes: float, parallel: Parallelism
) -> float:
    """U_s: the optimizer update of a stage's ``nbytes`` of parameters on each replica,
    ``U * nbytes`` with U the profile's measured ``update_ms_per_parameter_byte``, divided by
    r_s when ``parallel`` shards the optimizer state (each replica updates its 1/r_s shard).
    The cost model adds it to AR_s: a replica updates after its stage's synchronisation,
    before the step ends.

    0 for a profile without U, and on clusters with host CPU terms, whose calibrated per-step
    host CPU (``Cluster.step_overhead_ms``, :mod:`dapple.cost.host`) already holds the
    update."""
    if cluster.host_overheads or not profile.update_ms_per_parameter_byte:
        return 0.0
    shards = parallel.replicas if parallel.shards_optimizer else 1
    return profile.update_ms_per_parameter_byte * nbytes / shards


def allreduce_ms(cluster: Cluster, nbytes: float, devices: Sequence[int]) -> float:
    """AR(P_s, g_s): time to all-reduce ``nbytes`` of gradients over ``devices``.

    Ring within one server: ``2(n-1)/n * bytes / bw + 2(n-1) * latency``. When the set spans k
    servers, hierarchical: intra-server reduce-scatter, inter-server ring all-reduce of the
    shards (all shards of a server share its network interface, so a server moves
    ``2(k-1)/k * bytes`` in all), intra-server all-gather. Zero for one replica.

    Args:
        cluster: bandwidths and latencies.
        nbytes: gradient bytes (the stage's parameter bytes).
        devices: the replicas' device ids.
    """
    n = len(devices)
    if n <= 1 or nbytes <= 0:
        return 0.0
    counts = server_counts(cluster, devices)
    k = len(counts)
    intra_bpms = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
    inter_bpms = cluster.inter_server_bandwidth_gbps * 1e9 / 8 / 1e3
    if k == 1:
        return 2 * (n - 1) / n * nbytes / intra_bpms + 2 * (n - 1) * cluster.intra_server_latency_ms
    c = max(counts)  # the most crowded server paces the intra-server phases
    intra = 0.0
    if c > 1:
        intra = 2 * ((c - 1) / c * nbytes / intra_bpms + (c - 1) * cluster.intra_server_latency_ms)
    inter = 2 * (k - 1) / k * nbytes / inter_bpms + 2 * (k - 1) * cluster.inter_server_latency_ms
    return intra + inter


def overlaps(
    b: int,
    r_src: int,
    r_dst: int,
    src_shares: Sequence[int] | None = None,
    dst_shares: Sequence[int] | None = None,
) -> list[tuple[int, int, int, int]]:
    """:func:`dapple.core.plan.transfers` in O(r_src + r_dst) by a two-pointer sweep over the
    slice bounds (``transfers`` compares every pair), even slices unless shares are given."""
    if src_shares is None and dst_shares is None:
        return list(_even_overlaps(b, r_src, r_dst))
    return _overlaps(b, r_src, r_dst, src_shares, dst_shares)


@functools.lru_cache(maxsize=1 << 12)
def _even_overlaps(b: int, r_src: int, r_dst: int) -> tuple[tuple[int, int, int, int], ...]:
    """:func:`overlaps` of even slices, remembered: a planner asks for the same few (b, r_src,
    r_dst) with many device sets."""
    return tuple(_overlaps(b, r_src, r_dst, None, None))


def _overlaps(
    b: int,
    r_src: int,
    r_dst: int,
    src_shares: Sequence[int] | None,
    dst_shares: Sequence[int] | None,
) -> list[tuple[int, int, int, int]]:
    """The sweep of :func:`overlaps`."""
    src = slice_bounds(b, r_src, src_shares)
    dst = slice_bounds(b, r_dst, dst_shares)
    out: list[tuple[int, int, int, int]] = []
    j = k = 0
    while j < r_src and k < r_dst:
        lo = max(src[j][0], dst[k][0])
        hi = min(src[j][1], dst[k][1])
        if lo < hi:
            out.append((j, k, lo, hi))
        # advance whichever slice ends first (empty slices end where they start)
        if src[j][1] <= dst[k][1]:
            j += 1
        else:
            k += 1
    return out


Port = tuple[str, int]
"""A direction of a link that concurrent transfers share: ``("device out", d)``, ``("device
in", d)`` inside a server, ``("nic out", server)``, ``("nic in", server)`` across servers."""


def transfer_ports(cluster: Cluster, src_device: int, dst_device: int) -> tuple[Port, Port]:
    """The two ports a transfer from ``src_device`` to ``dst_device`` occupies: the sender's
    way out and the receiver's way in (device links inside a server, the servers' network
    interfaces across servers)."""
    dps = cluster.devices_per_server  # device d is on server d // dps (Cluster.server_of)
    sa, sc = src_device // dps, dst_device // dps
    if sa == sc:
        return ("device out", src_device), ("device in", dst_device)
    return ("nic out", sa), ("nic in", sc)


def port_loads(
    cluster: Cluster,
    src_devices: Sequence[int],
    dst_devices: Sequence[int],
    b: int,
    src_shares: Sequence[int] | None = None,
    dst_shares: Sequence[int] | None = None,
) -> dict[Port, int]:
    """Samples every port carries in the split-concat of one micro-batch between two stages.

    Split-concat (section 6.2, :func:`dapple.core.plan.transfers`): replica j before the cut
    sends its overlap with replica k's slice to ``dst_devices[k]``. Transfers proceed
    concurrently; a device's link inside a server carries its own messages out (and in), and
    a server's network interface carries the sum of all cross-server samples leaving (or
    entering) it (:func:`transfer_ports`). A device sending to itself uses no port.

    Args:
        cluster: link classes.
        src_devices: replicas before the cut, in slice order.
        dst_devices: replicas after the cut, in slice order.
        b: samples of one micro-batch.
        src_shares: the slices of the replicas before the cut; None: even.
        dst_shares: the slices of those after it; None: even.
    """
    cut = overlaps(b, len(src_devices), len(dst_devices), src_shares, dst_shares)
    return _port_totals(
        cluster, [(src_devices[j], dst_devices[k], hi - lo) for j, k, lo, hi in cut]
    )[0]


def _port_totals(
    cluster: Cluster, pairs: Sequence[tuple[int, int, int]]
) -> tuple[dict[Port, int], dict[tuple[Port, int], int]]:
    """Samples through each port over transfers ``(sender, receiver, samples)``, in all and
    per ``(port, sender)``; a device sending to itself uses no port."""
    loads: dict[Port, int] = {}
    mine: dict[tuple[Port, int], int] = {}
    for a, c, n in pairs:
        if a != c:
            for p in transfer_ports(cluster, a, c):
                loads[p] = loads.get(p, 0) + n
                mine[(p, a)] = mine.get((p, a), 0) + n
    return loads, mine


def shared_samples(cluster: Cluster, pairs: Sequence[tuple[int, int, int]]) -> list[float]:
    """Per transfer ``(sender, receiver, samples)`` of one cut's slices, the samples a port
    is charged while it moves, the largest over its two ports (:func:`transfer_ports`).

    Every sender's slices through a port cross at once and share it, so the port needs the
    time of its whole load ``L`` for the cut (the comm stage's busiest port,
    :func:`busiest_link_ms`). A sender's own slices take turns on its way out (the simulator
    queues them), so each is charged its part of the sender's own samples there, ``n x L /
    own``: the turns add up to ``L``. A sender's only slice through a port is charged ``L``;
    one on its sender's own device link, ``n``. A device sending to itself moves nothing and
    shares nothing."""
    loads, mine = _port_totals(cluster, pairs)
    return [
        n if a == c else max(n * loads[p] / mine[(p, a)] for p in transfer_ports(cluster, a, c))
        for a, c, n in pairs
    ]


def link_loads(
    cluster: Cluster,
    src_devices: Sequence[int],
    dst_devices: Sequence[int],
    b: int,
    src_shares: Sequence[int] | None = None,
    dst_shares: Sequence[int] | None = None,
) -> list[tuple[float, float]]:
    """Every busy port of the split-concat between two stages (:func:`port_loads`, same
    arguments), as ``(latency_ms, samples / bytes_per_ms)``: its latency and the ms it is busy
    per byte of one sample."""
    intra = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
    inter = cluster.inter_server_bandwidth_gbps * 1e9 / 8 / 1e3
    out = []
    loads = port_loads(cluster, src_devices, dst_devices, b, src_shares, dst_shares)
    for (kind, _), n in loads.items():
        if kind.startswith("device"):
            out.append((cluster.intra_server_latency_ms, n / intra))
        else:
            out.append((cluster.inter_server_latency_ms, n / inter))
    return out


def busiest_link_ms(links: Sequence[tuple[float, float]], bytes_per_sample: float) -> float:
    """Time of a comm stage: its busiest link, ``max(latency + bytes_per_sample * samples /
    bandwidth)`` over :func:`link_loads`; 0 when nothing moves."""
    t = 0.0
    if bytes_per_sample <= 0:
        return t
    for lat, coef in links:
        v = lat + bytes_per_sample * coef
        if v > t:
            t = v
    return t


def comm_stage_ms(
    profile: ModelProfile,
    cluster: Cluster,
    src: StagePlan,
    dst: StagePlan,
    micro_batch_size: int,
) -> tuple[float, float]:
    """F and B of the communication stage between computation stages ``src`` and ``dst``.

    The busiest link of the split-concat (:func:`link_loads`, :func:`busiest_link_ms`) of
    the activations crossing the cut. Backward gradients take the same links in reverse:
    same time. A replica of a tensor-parallel stage sends and receives on its group's first
    device (:attr:`~dapple.core.plan.StagePlan.replica_devices`); the group shares the
    activations inside its server, not charged.

    Args:
        profile: boundary activation sizes.
        cluster: link classes.
        src: the stage before the cut (its end is the cut).
        dst: the stage after the cut.
        micro_batch_size: b.

    Returns:
        ``(forward_ms, backward_ms)``.
    """
    links = link_loads(
        cluster, src.replica_devices, dst.replica_devices, micro_batch_size, src.shares, dst.shares
    )
    t = busiest_link_ms(links, boundary_bytes(profile, src.layers[1], 1))
    return t, t
