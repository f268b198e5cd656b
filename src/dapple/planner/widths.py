"""Tensor-parallel widths in the planner: a width-t search on a cluster of tensor groups.

The DAPPLE search (:func:`dapple.planner.search.dapple_search`) runs once per tensor width t with
every stage of width t (uniform t_s, as torchtitan's and Megatron's grids), then refines each
plan to per-stage widths (:mod:`dapple.planner.stage_widths`). A width-t search runs
on :func:`group_cluster`: every t consecutive devices of a server, one tensor group, act as one
device, so every placement the search makes keeps a tensor group inside a server and the
split-concat links between groups are those between their first devices, as the cost model
charges them (:func:`dapple.cost.comm.comm_stage_ms`). :func:`real_devices` maps a searched
stage back to the cluster's devices (replica-major, :class:`dapple.core.plan.StagePlan`).
Pure, no torch.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

from dapple.core.cluster import Cluster
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import TENSOR_WIDTHS
from dapple.cost.tensor import TP_ALLREDUCES_PER_PASS

__all__ = ["TensorSums", "group_cluster", "real_devices", "width_candidates"]


def width_candidates(profile: ModelProfile, cluster: Cluster) -> list[int]:
    """The widths t the planner tries: 1, and each of :data:`TENSOR_WIDTHS` that divides the
    server size when some layer shards (``LayerProfile.tensor_parallel``) and the cluster's
    devices compute on dedicated cores (the shared-core model counts devices per server); of
    those, only widths the model's sizes allow where the profile records them
    (``ModelProfile.tensor_widths``)."""
    if cluster.compute_cores_per_server is not None or not any(
        x.tensor_parallel for x in profile.layers
    ):
        return [1]
    cuttable = profile.tensor_widths
    return [
        t
        for t in TENSOR_WIDTHS
        if cluster.devices_per_server % t == 0 and (t == 1 or cuttable is None or t in cuttable)
    ]


def group_cluster(cluster: Cluster, t: int) -> Cluster:
    """``cluster`` with every tensor group of t consecutive devices as one device: servers of
    ``devices_per_server / t`` devices, links, memory and host terms unchanged."""
    if t == 1:
        return cluster
    return dataclasses.replace(cluster, devices_per_server=cluster.devices_per_server // t)


def real_devices(groups: tuple[int, ...], t: int) -> tuple[int, ...]:
    """The devices of tensor groups ``groups`` of :func:`group_cluster`, replica-major."""
    if t == 1:
        return groups
    return tuple(d for g in groups for d in range(g * t, (g + 1) * t))


class TensorSums:
    """Prefix sums of the shardable layers, for the TP all-reduces of a layer range in O(1):
    per pass ``TP_ALLREDUCES_PER_PASS x (2(t-1)/t x n x sum(out_l) / B_intra + n_blocks x 2(t-1)
    x latency)`` (:func:`dapple.cost.tensor.tensor_comm_ms`, summed in another order)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, t: int) -> None:
        ls = profile.layers
        self.t = t
        self._blocks = [0, *accumulate(1 if x.tensor_parallel else 0 for x in ls)]
        self._out = [
            0.0,
            *accumulate(x.output_bytes_per_sample if x.tensor_parallel else 0.0 for x in ls),
        ]
        self._bpms = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
        self._lat = cluster.intra_server_latency_ms

    def blocks(self, s: int, e: int) -> int:
        """Shardable layers in ``[s, e)``."""
        return self._blocks[e] - self._blocks[s]

    def comm_ms(self, s: int, e: int, samples: int) -> float:
        """The TP all-reduces of one forward (or backward) of layers ``[s, e)``."""
        n = self.blocks(s, e)
        t = self.t
        if n == 0 or t == 1 or samples <= 0:
            return 0.0
        nbytes = (self._out[e] - self._out[s]) * samples
        return TP_ALLREDUCES_PER_PASS * (
            2 * (t - 1) / t * nbytes / self._bpms + n * 2 * (t - 1) * self._lat
        )
