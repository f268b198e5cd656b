"""Device placement policies of section 5.2: Fresh First, Append First, Scatter First.

The state of the allocation is the occupancy: how many devices of each server are taken.
Inside a server devices are taken lowest id first, so an occupancy fixes the free device ids
and a policy only decides how many devices to take from each server.
"""

from __future__ import annotations

import functools

from dapple.core.cluster import Cluster

__all__ = ["POLICIES", "first_free_devices", "first_placed", "place", "remaining_devices"]

POLICIES = ("fresh", "append", "scatter")
"""Placement policies of section 5.2 in the order the search tries them."""

Occupancy = tuple[int, ...]


def _take(
    cluster: Cluster, occ: Occupancy, counts: dict[int, int]
) -> tuple[tuple[int, ...], Occupancy]:
    dps = cluster.devices_per_server
    devs: list[int] = []
    new = list(occ)
    for srv in sorted(counts):
        n = counts[srv]
        devs.extend(srv * dps + occ[srv] + i for i in range(n))
        new[srv] += n
    return tuple(devs), tuple(new)


def place(
    cluster: Cluster, occ: Occupancy, m: int, policy: str
) -> tuple[tuple[int, ...], Occupancy] | None:
    """Take ``m`` devices from the free ones under ``policy``.

    Args:
        cluster: servers and devices per server.
        occ: devices already taken per server.
        m: devices wanted (>= 1).
        policy: ``fresh`` (whole fresh servers first, then partly used ones), ``append``
            (partly used servers first, then fresh ones) or ``scatter`` (equal shares of the
            used servers that have room, or of all servers when all are fresh).

    Returns:
        ``(device ids, new occupancy)`` or None when fewer than ``m`` devices are free.
    """
    dps = cluster.devices_per_server
    free = [dps - u for u in occ]
    if m > sum(free):
        return None
    counts: dict[int, int] = {}
    need = m

    def fill(order: list[int]) -> None:
        nonlocal need
        for srv in order:
            if need == 0:
                return
            n = min(free[srv] - counts.get(srv, 0), need)
            if n > 0:
                counts[srv] = counts.get(srv, 0) + n
                need -= n

    fresh, partly = _server_classes(dps, occ)
    if policy == "fresh":
        fill(fresh)
        fill(sorted(partly, key=lambda s: -free[s]))
    elif policy == "append":
        fill(partly)
        fill(fresh)
    elif policy == "scatter":
        group = partly if partly else fresh
        while need > 0 and group:
            share = max(1, need // len(group))
            progressed = False
            for srv in group:
                if need == 0:
                    break
                n = min(free[srv] - counts.get(srv, 0), share, need)
                if n > 0:
                    counts[srv] = counts.get(srv, 0) + n
                    need -= n
                    progressed = True
            if not progressed:
                break
        fill(fresh)
        fill(partly)
    else:
        raise ValueError(f"unknown placement policy {policy!r}; choose one of {POLICIES}")
    return _take(cluster, occ, counts)


@functools.lru_cache(maxsize=1 << 10)
def _server_classes(dps: int, occ: Occupancy) -> tuple[list[int], list[int]]:
    """The fresh servers and the partly used ones of an occupancy (servers of ``dps``
    devices), in server order; remembered: the search places many replica counts by each
    policy from one occupancy. Callers only read the lists."""
    fresh = [s for s, u in enumerate(occ) if u == 0]
    partly = [s for s, u in enumerate(occ) if 0 < u < dps]
    return fresh, partly


def remaining_devices(cluster: Cluster, occ: Occupancy) -> tuple[int, ...]:
    """The free device ids of an occupancy, in id order."""
    dps = cluster.devices_per_server
    return tuple(s * dps + i for s in range(len(occ)) for i in range(occ[s], dps))


def first_placed(
    cluster: Cluster, occ: Occupancy, devices: tuple[int, ...], n: int
) -> tuple[tuple[int, ...], Occupancy]:
    """The first ``n`` of ``devices`` (a placement from ``occ``, in id order) and the
    occupancy of ``occ`` with them taken: a prefix of each server's run, so still lowest id
    first."""
    kept, new = devices[:n], list(occ)
    dps = cluster.devices_per_server
    for d in kept:
        new[d // dps] += 1
    return kept, tuple(new)


def first_free_devices(cluster: Cluster, occ: Occupancy, n: int) -> tuple[int, ...]:
    """The first ``n`` of :func:`remaining_devices` (all of them when fewer are free), without
    listing the rest: the servers after the n-th free device are not visited."""
    dps = cluster.devices_per_server
    out: list[int] = []
    first = 0  # the leading full servers, skipped at once (as bytes) where counts fit a byte
    if dps < 256:
        packed = bytes(occ)
        first = len(packed) - len(packed.lstrip(bytes([dps])))
    for s in range(first, len(occ)):
        if len(out) >= n:
            break
        u = occ[s]
        if u < dps:
            out.extend(range(s * dps + u, s * dps + min(dps, u + n - len(out))))
    return tuple(out)
