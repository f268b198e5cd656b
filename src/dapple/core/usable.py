"""The devices a plan can keep busy, and the cluster the DAPPLE search enumerates. Pure, no torch.

A plan has at most S_max <= N computation stages (each at least one layer). A replica of a
stage computes only on a non-empty slice of a micro-batch of b = B / M <= B samples
(:func:`~dapple.core.slicing.split_sizes`: a stage of r > b replicas leaves r - b of them
with nothing to compute), and a replica spans t <= t_max devices (its tensor width). So at most

    U = S_max x B x t_max

devices compute in any plan of a global batch of B samples. :func:`usable_devices` gives U;
:func:`usable_cluster` cuts a larger cluster down to the fewest of its first servers that hold U
devices, so the search (its states, replica counts, placements and grid points) does not grow
with devices that could only idle. The cut cluster's device ids are the first ones of the
cluster (one server larger than U keeps its id layout: the cut cluster is that one server), its
links, memory and host terms are unchanged, and its server size keeps the same divisibility by
each tensor width (:data:`~dapple.core.tensor_layout.TENSOR_WIDTHS`), so the widths searched are
unchanged: every plan of it is a plan of the whole cluster at the same cost. On a cluster with
device kinds the cut keeps the kinds of its first servers (the last one cut to what is left) and
the smallest memory among them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dapple.core.cluster import Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.tensor_layout import TENSOR_WIDTHS

__all__ = ["usable_cluster", "usable_devices"]


def usable_devices(
    num_layers: int, global_batch_size: int, widths: Sequence[int], max_stages: int | None = None
) -> int:
    """U = S_max x B x t_max: the most devices any plan keeps computing (module docstring).

    Args:
        num_layers: N, the profile's layers (the most stages).
        global_batch_size: B, samples per step (the most samples of one micro-batch).
        widths: the tensor widths searched (t_max is the largest).
        max_stages: a cap on the stages below N (None or 0: N, as the search reads it).
    """
    stages = min(num_layers, max_stages) if max_stages else num_layers
    return stages * global_batch_size * max(widths, default=1)


def usable_cluster(cluster: Cluster, usable: int) -> Cluster:
    """``cluster`` cut to the fewest of its first servers holding ``usable`` devices (itself
    when it has no more); a server of more than ``usable`` devices is cut to the smallest size
    of at least ``usable`` divisible by the same tensor widths as the whole server.

    Args:
        cluster: the cluster planned on.
        usable: the devices a plan can use (:func:`usable_devices`), >= 1.
    """
    if cluster.num_devices <= usable:
        return cluster
    dps = cluster.devices_per_server
    if dps > usable:
        divides = [dps % t == 0 for t in TENSOR_WIDTHS]
        size = usable
        while [size % t == 0 for t in TENSOR_WIDTHS] != divides:  # ends at dps at the latest
            size += 1
        dps = size
    servers = min(cluster.servers, -(-usable // dps))
    return dataclasses.replace(
        cluster, servers=servers, devices_per_server=dps, **_kinds_of_first(cluster, servers)
    )


def _kinds_of_first(cluster: Cluster, servers: int) -> dict[str, Any]:
    """The device kinds of ``cluster``'s first ``servers`` servers and their smallest memory,
    as :class:`Cluster` fields (none on a cluster without kinds)."""
    if not cluster.kinds:
        return {}
    kinds: list[DeviceKind] = []
    left = servers
    for k in cluster.kinds:
        if left == 0:
            break
        kinds.append(dataclasses.replace(k, servers=min(k.servers, left)))
        left -= kinds[-1].servers
    return {"kinds": tuple(kinds), "device_memory_bytes": min(k.device_memory_bytes for k in kinds)}
