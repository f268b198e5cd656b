"""Planning on a mixed cluster: stages whose replicas sit on device kinds of different speed and
memory take unequal shares of each micro-batch (issue #43).

Pure, no torch. On a cluster with device kinds (:attr:`~dapple.core.cluster.Cluster.kinds`):

* the search prices a stage on devices ``d`` with speeds ``v_j`` as its slowest replica on the
  whole-sample shares that balance them (:func:`~dapple.cost.replica_shares.balanced_shares`):
  F_s, B_s = ``max_j (F, B)(n_j) / v_j``, and holds each replica's share in its own kind's
  memory (:func:`kind_stage`, the :class:`~dapple.planner.evaluate.Scorer`'s hook);
* the search runs on the cluster with its speeds divided by the fastest
  (:func:`search_cluster`, the same times), so that the bounds it prunes by, priced at speed 1,
  stay lower bounds;
* the plan found is given those shares and re-priced by the cost model on the cluster as
  given (:func:`with_kind_shares`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan, split_sizes
from dapple.core.profile import ModelProfile
from dapple.cost.compute import compute_ms
from dapple.cost.replica_shares import TimeOfSamples, balanced_shares
from dapple.cost.schedules import schedule_latency
from dapple.cost.tensor import tensor_compute_ms

if TYPE_CHECKING:
    from dapple.planner.evaluate import Scorer
    from dapple.planner.zero_modes import ZeroMode

__all__ = ["kind_stage", "search_cluster", "stage_shares", "with_kind_shares"]


def stage_shares(b: int, speeds: Sequence[float], ms: TimeOfSamples) -> tuple[int, ...]:
    """The replicas' slices of a micro-batch of b samples: the even split
    (:func:`~dapple.core.plan.split_sizes`) when the speeds are equal or b is below the replica
    count, else the balanced whole-sample shares (each >= 1, summing to b)."""
    if len(set(speeds)) == 1 or b < len(speeds):
        return split_sizes(b, len(speeds))
    return balanced_shares(b, speeds, ms)


def search_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` with every kind's speed divided by the fastest and ``compute_slowdown`` by
    it too: every device computes in the same time, and no speed is above 1."""
    if not cluster.kinds:
        return cluster
    top = max(k.speed for k in cluster.kinds)
    if top == 1.0:
        return cluster
    return dataclasses.replace(
        cluster,
        compute_slowdown=cluster.compute_slowdown / top,
        kinds=tuple(dataclasses.replace(k, speed=k.speed / top) for k in cluster.kinds),
    )


_SHARES: weakref.WeakKeyDictionary[
    Scorer, dict[tuple[int, int, tuple[float, ...], int], tuple[int, ...]]
] = weakref.WeakKeyDictionary()
"""Each scorer's balanced shares by ``(s, e, replica speeds, b)``, kept while the scorer lives."""


def kind_stage(
    sc: Scorer, s: int, e: int, d: tuple[int, ...], b: int, mode: ZeroMode, M: int
) -> tuple[float, float, int, int, float]:
    """F, B, D without and with re-computation, and the memory floor of layers [s, e) on
    devices ``d`` of a cluster with kinds, as :meth:`Scorer._stage` reads them.

    F, B are those of the slowest replica on the :func:`stage_shares`; D the fewest micro-batches
    any replica holds with its share in its kind's usable memory; the floor the largest of the
    replicas' floors, each scaled to the smallest kind's memory (what
    :func:`~dapple.planner.cut_search.stage_unfit` compares it with).
    """
    cl = sc.cluster
    speeds = tuple(cl.speed_of(x) for x in d)

    def ms(n: int) -> float:
        f, bw = sc.fb_ms(s, e, n)
        return f + bw

    known = _SHARES.setdefault(sc, {})
    key = (s, e, speeds, b)  # placements with the same speeds share their shares
    shares = known.get(key)
    if shares is None:
        shares = known[key] = stage_shares(b, speeds, ms)
    j = max(range(len(d)), key=lambda i: ms(shares[i]) / speeds[i])
    f, bw = sc.fb_ms(s, e, shares[j])
    low = float(cl.usable_memory_bytes)
    d_nr = d_r = math.inf
    floor = 0.0
    for usable, n in sorted(
        {(float(cl.usable_memory_of(x)), n) for x, n in zip(d, shares, strict=True)}
    ):
        a, r, fl = sc._options(s, e, n, len(d), mode, M, usable)
        d_nr, d_r, floor = min(d_nr, a), min(d_r, r), max(floor, fl * low / usable)
    return f / speeds[j], bw / speeds[j], int(d_nr), int(d_r), floor


def _stage_ms(profile: ModelProfile, cluster: Cluster, st: StagePlan) -> TimeOfSamples:
    """``n -> F + B`` of stage ``st``'s layers on n samples at speed 1, one tensor rank's."""
    t = st.tensor_width

    def ms(n: int) -> float:
        if t == 1:
            f, bw = compute_ms(profile, cluster, st.layers, n)
        else:
            f, bw = tensor_compute_ms(profile, cluster, st.layers, n, t)
        return f + bw

    return ms


def with_kind_shares(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Plan:
    """``plan`` with each stage on replicas of different speeds given its balanced shares
    (:func:`stage_shares`) and ``predicted_step_ms`` re-priced by the cost model on
    ``cluster`` (:func:`~dapple.cost.schedules.schedule_latency`); ``plan`` itself on a
    cluster without kinds.

    Raises:
        ValidationError: the plan does not fit the profile or the cluster (from the cost model).
    """
    if not cluster.kinds:
        return plan
    b = plan.micro_batch_size
    stages = []
    for st in plan.stages:
        speeds = [cluster.speed_of(x) for x in st.replica_devices]
        shares = stage_shares(b, speeds, _stage_ms(profile, cluster, st))
        even = shares == split_sizes(b, st.replicas)
        stages.append(dataclasses.replace(st, shares=None if even else shares))
    plan = dataclasses.replace(plan, stages=tuple(stages))
    return dataclasses.replace(plan, predicted_step_ms=schedule_latency(plan, profile, cluster))
