"""Planning on a mixed cluster: stages whose replicas sit on device kinds of different speed and
memory take unequal shares of each micro-batch (issue #43).

Pure, no torch. On a cluster with device kinds (:attr:`~dapple.core.cluster.Cluster.kinds`):

* the search prices a stage on devices ``d`` with speeds ``v_j`` as its slowest replica on the
  whole-sample shares that balance them (:func:`~dapple.cost.replica_shares.balanced_shares`):
  F_s, B_s = ``max_j (F, B)(n_j) / v_j``, and holds each replica's share in its own kind's
  memory (:func:`kind_stage`, the :class:`~dapple.planner.scorer.Scorer`'s hook);
* a kind with its own profile (:mod:`dapple.core.kind_profiles`) prices its replicas by its
  own per-layer times (speed 1), from a scorer of that profile's prefix sums;
* the search runs on the cluster with its speeds divided by the fastest
  (:func:`search_cluster`, the same times) and, with per-kind profiles, on each layer's
  fastest kind's times (:func:`~dapple.core.kind_profiles.fastest_layers`), so that the bounds
  it prunes by, priced at speed 1 from the scorer's own profile, stay lower bounds;
* the plan found is given those shares and re-priced by the cost model on the cluster as
  given (:func:`with_kind_shares`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from dapple.core.cluster import Cluster
from dapple.core.kind_profiles import profile_of
from dapple.core.plan import Plan, StagePlan, split_sizes
from dapple.core.profile import ModelProfile
from dapple.cost.compute import compute_ms
from dapple.cost.replica_shares import TimeOfSamples, balanced_shares_of
from dapple.cost.schedule_step import schedule_latency
from dapple.cost.tensor import tensor_compute_ms

if TYPE_CHECKING:
    from dapple.planner.scorer import Scorer
    from dapple.planner.zero_modes import ZeroMode

__all__ = [
    "kind_shares",
    "kind_stage",
    "replica_shares",
    "search_cluster",
    "stage_shares",
    "with_kind_shares",
]


def stage_shares(b: int, speeds: Sequence[float], ms: TimeOfSamples) -> tuple[int, ...]:
    """The replicas' slices of a micro-batch of b samples: the even split
    (:func:`~dapple.core.plan.split_sizes`) when the speeds are equal or b is below the replica
    count, else the balanced whole-sample shares (each >= 1, summing to b) of ``ms`` at each
    speed."""
    return replica_shares(b, speeds, [_at_speed(ms, v) for v in speeds])


def _at_speed(ms: TimeOfSamples, v: float) -> TimeOfSamples:
    return lambda n: ms(n) / v


def replica_shares(
    b: int, replicas: Sequence[Hashable], times: Sequence[TimeOfSamples]
) -> tuple[int, ...]:
    """:func:`stage_shares` of replicas each with its own ``times`` (``n -> ms`` at its speed,
    from its kind's own profile where it has one): the even split when the ``replicas`` keys
    are equal (:data:`Replica`) or b is below their count, else the balanced shares
    (:func:`~dapple.cost.replica_shares.balanced_shares_of`)."""
    if len(set(replicas)) == 1 or b < len(replicas):
        return split_sizes(b, len(replicas))
    return balanced_shares_of(b, times)


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


Replica = tuple[str, float]
"""What a replica's time depends on besides the layers: the name of its kind when the kind has
its own profile (else ``""``) and its speed."""

_SHARES: weakref.WeakKeyDictionary[
    Scorer, dict[tuple[int, int, tuple[Replica, ...], int], tuple[int, ...]]
] = weakref.WeakKeyDictionary()
"""Each scorer's balanced shares by ``(s, e, replicas' kinds and speeds, b)``, kept while the
scorer lives."""

_KIND_SCORERS: weakref.WeakKeyDictionary[Scorer, dict[str, Scorer]] = weakref.WeakKeyDictionary()
"""Each scorer's scorers of the kinds with their own profile (their prefix sums), by name."""

FB = Callable[[int, int, int], tuple[float, float]]
"""``(s, e, n) -> (F, B)`` of layers [s, e) on n samples at speed 1 (:meth:`Scorer.fb_ms`)."""

_DEVICES: weakref.WeakKeyDictionary[Scorer, dict[int, tuple[Replica, FB]]] = (
    weakref.WeakKeyDictionary()
)
"""Each scorer's :data:`Replica` key and F, B of each device it has priced (:func:`_device`)."""


_STAGE_SHARES: weakref.WeakKeyDictionary[
    Scorer, dict[tuple[int, int, tuple[int, ...], int], tuple[int, ...] | None]
] = weakref.WeakKeyDictionary()
"""Each scorer's :func:`kind_shares` by ``(s, e, devices, b)``: a search scores each stage
in many candidates."""


def _replica(cl: Cluster, x: int) -> Replica:
    k = cl.kind_of(x)
    if k is None:
        return ("", 1.0)
    return ("" if k.profile is None else k.name, k.speed)


def _device(sc: Scorer, x: int) -> tuple[Replica, FB]:
    """Device ``x``'s :data:`Replica` key and its F, B: the scorer's, or from its kind's own
    profile (a plain :class:`~dapple.planner.scorer.Scorer` of it, whatever ``sc``'s class:
    only its prefix sums are read); remembered per scorer."""
    from dapple.planner.scorer import Scorer

    known = _DEVICES.setdefault(sc, {})
    got = known.get(x)
    if got is not None:
        return got
    k = sc.cluster.kind_of(x)
    fb = sc.fb_ms
    if k is not None and k.profile is not None:
        own = _KIND_SCORERS.setdefault(sc, {})
        if k.name not in own:
            own[k.name] = Scorer(
                k.profile, sc.real_cluster, sc.global_batch_size, sc.zero_stage, sc.tensor_width
            )
        fb = own[k.name].fb_ms
    got = known[x] = (_replica(sc.cluster, x), fb)
    return got


def _time(fb: FB, s: int, e: int, v: float) -> TimeOfSamples:
    """``n -> (F + B) / v`` of layers [s, e)."""

    def ms(n: int) -> float:
        f, bw = fb(s, e, n)
        return (f + bw) / v

    return ms


def _replicas(
    sc: Scorer, s: int, e: int, d: tuple[int, ...], b: int
) -> tuple[list[tuple[Replica, FB]], tuple[int, ...]]:
    """Per replica of layers [s, e) on ``d``: its :data:`Replica` key and F, B
    (:func:`_device`), and the stage's shares (:func:`replica_shares` of their times at their
    speeds), remembered per scorer: placements on the same kinds share their shares."""
    rows = [_device(sc, x) for x in d]
    who = tuple(r for r, _ in rows)
    known = _SHARES.setdefault(sc, {})
    key = (s, e, who, b)
    shares = known.get(key)
    if shares is None:
        times = [_time(fb, s, e, v) for (_, v), fb in rows]
        shares = known[key] = replica_shares(b, who, times)
    return rows, shares


def kind_stage(
    sc: Scorer, s: int, e: int, d: tuple[int, ...], b: int, mode: ZeroMode, M: int
) -> tuple[float, float, int, int, float]:
    """F, B, D without and with re-computation, and the memory floor of layers [s, e) on
    devices ``d`` of a cluster with kinds, as :meth:`Scorer._stage` reads them.

    F, B are those of the slowest replica on the :func:`stage_shares`, each at its speed from
    its kind's own profile where it has one (the first such replica); D the fewest
    micro-batches any replica holds with its share in its kind's usable memory; the floor the
    largest of the replicas' floors, each scaled to the smallest kind's memory (what
    :func:`~dapple.planner.cut_search.stage_unfit` compares it with).
    """
    cl = sc.cluster
    rows, shares = _replicas(sc, s, e, d, b)
    best: tuple[float, float, float] | None = None  # F, B, (F + B) / v of the slowest
    seen = set()
    for ((_, v), fb), n in zip(rows, shares, strict=True):
        if (v, fb, n) in seen:  # a replica like an earlier one: the same time
            continue
        seen.add((v, fb, n))
        f, bw = fb(s, e, n)
        t = (f + bw) / v
        if best is None or t > best[2]:
            best = (f / v, bw / v, t)
    assert best is not None
    low = float(cl.usable_memory_bytes)
    d_nr = d_r = math.inf
    floor = 0.0
    for usable, n in sorted(
        {(float(cl.usable_memory_of(x)), n) for x, n in zip(d, shares, strict=True)}
    ):
        a, r, fl = sc._options(s, e, n, len(d), mode, M, usable)
        d_nr, d_r, floor = min(d_nr, a), min(d_r, r), max(floor, fl * low / usable)
    return best[0], best[1], int(d_nr), int(d_r), floor


def kind_shares(sc: Scorer, s: int, e: int, d: tuple[int, ...], b: int) -> tuple[int, ...] | None:
    """The shares :func:`kind_stage` prices layers [s, e) on devices ``d`` with, as a
    :attr:`~dapple.core.plan.StagePlan.shares` (None: the even split), for the split-concat
    on either side of the stage (:meth:`~dapple.planner.scorer.Scorer.comm_ms`)."""
    if not sc.cluster.kinds or len(d) == 1:
        return None
    known = _STAGE_SHARES.setdefault(sc, {})
    key = (s, e, d, b)
    if key not in known:
        shares = _replicas(sc, s, e, d, b)[1]
        known[key] = None if shares == split_sizes(b, len(d)) else shares
    return known[key]


def _stage_ms(profile: ModelProfile, cluster: Cluster, st: StagePlan, v: float) -> TimeOfSamples:
    """``n -> (F + B) / v`` of stage ``st``'s layers on n samples, one tensor rank's."""
    layout = st.parallel

    def ms(n: int) -> float:
        if layout.tensor_parallel:
            f, bw = tensor_compute_ms(profile, cluster, st.layers, n, layout.tensor_width)
        else:
            f, bw = compute_ms(profile, cluster, st.layers, n)
        return (f + bw) / v

    return ms


def with_kind_shares(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Plan:
    """``plan`` with each stage on replicas of different kinds given its balanced shares
    (:func:`stage_shares`, each replica at its speed from its kind's own profile where it has
    one) and ``predicted_step_ms`` re-priced by the cost model on ``cluster``
    (:func:`~dapple.cost.schedule_step.schedule_latency`); ``plan`` itself on a cluster without
    kinds.

    Raises:
        ValidationError: the plan does not fit the profile or the cluster (from the cost model).
    """
    if not cluster.kinds:
        return plan
    b = plan.micro_batch_size
    stages = []
    for st in plan.stages:
        d = st.replica_devices
        times = [_stage_ms(profile_of(cluster, x, profile), cluster, st, cluster.speed_of(x))
                 for x in d]  # fmt: skip
        shares = replica_shares(b, [_replica(cluster, x) for x in d], times)
        even = shares == split_sizes(b, st.replicas)
        stages.append(dataclasses.replace(st, shares=None if even else shares))
    plan = dataclasses.replace(plan, stages=tuple(stages))
    return dataclasses.replace(plan, predicted_step_ms=schedule_latency(plan, profile, cluster))
