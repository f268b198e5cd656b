"""CPU time to wall time: what a lone device's measured CPU ms cost in wall ms.

An extension beyond the paper's cost model, whose profiles are wall times of dedicated devices.
On a CPU host shared with other programs two kinds of input are CPU time, not wall time:

* a profile taken among co-workers (``ModelProfile.clock == "cpu"``): each layer's time is the
  CPU time of the profiling thread, its time while scheduled;
* the runtime's host terms (``Cluster.action_overhead_ms``, ``step_overhead_ms``,
  ``comm_cpu_ms_per_mb``), measured by ``dapple calibrate`` as process CPU time.

One device computing alone then takes W = ``Cluster.lone_wall_per_cpu`` wall ms per CPU ms
(the calibration's lone matmul in both clocks: 1.0 on idle cores, 4-8 on 2 cores at load
15-28, ``benchmarks/fidelity.md``). :func:`on_wall_clock` folds W into the cluster's
``compute_slowdown`` (for a CPU-clock profile) and its host terms, so every F_s, B_s and host
extra the cost model and the simulator read is a lone device's wall time; processor sharing
(:meth:`~dapple.core.cluster.Cluster.compute_rate`, :mod:`dapple.cost.sharing`) stretches it
further by how many devices compute at once. Pure, no torch.
"""

from __future__ import annotations

import dataclasses

from dapple.core.cluster import Cluster
from dapple.core.profile import ModelProfile

__all__ = ["on_wall_clock"]


def on_wall_clock(profile: ModelProfile, cluster: Cluster) -> Cluster:
    """``cluster`` with its lone device's wall ms per CPU ms W folded into the terms timed in
    CPU time: ``compute_slowdown`` x W when ``profile`` was measured in CPU time, each host
    term x W; ``lone_wall_per_cpu`` 1 in the result, so folding it again changes nothing.

    ``cluster`` itself (the same object) when W = 1: every number keeps its bits.
    """
    w = cluster.lone_wall_per_cpu
    if w == 1:
        return cluster
    return dataclasses.replace(
        cluster,
        lone_wall_per_cpu=1.0,
        compute_slowdown=cluster.compute_slowdown * (w if profile.clock == "cpu" else 1.0),
        action_overhead_ms=cluster.action_overhead_ms * w,
        step_overhead_ms=cluster.step_overhead_ms * w,
        comm_cpu_ms_per_mb=cluster.comm_cpu_ms_per_mb * w,
    )
