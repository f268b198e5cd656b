"""Baseline planners scored under the same cost model: DP, straight, GPipe, PipeDream.

Each returns a :class:`Plan` whose ``predicted_step_ms`` is the cost model's L, with M chosen
among divisors of the global batch size
(:func:`~dapple.planner.search.micro_batch_candidates`) to minimise L (paper section 7.4
evaluates PipeDream's partition/replication as a synchronous plan the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dapple.core.cluster import Cluster
from dapple.core.plan import DEFAULT_SCHEDULE, Plan
from dapple.core.profile import ModelProfile
from dapple.core.usable import usable_cluster, usable_devices
from dapple.cost.comm import allreduce_ms
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.batches import infeasible_message, micro_batch_candidates
from dapple.planner.partition import block_partition
from dapple.planner.scorer import Scored, Scorer, StageSpec
from dapple.schedule.fill_drain import SCHEDULE as GPIPE

__all__ = ["dp_plan", "gpipe_plan", "pipedream_plan", "straight_plan_baseline"]

PIPEDREAM_MAX_WORK = 5e6
"""Largest N^2 G^2 the PipeDream baseline accepts (BERT-48 on 16 devices, 6.4e5, takes ~1.5 s)."""

Candidate = Callable[[int], list[StageSpec] | None]


def _best_over_m(
    name: str,
    sc: Scorer,
    make: Candidate,
    *,
    schedule: str = DEFAULT_SCHEDULE,
    recompute: bool | None = None,
) -> Plan:
    best: tuple[float, list[StageSpec], int, Scored] | None = None
    for M in micro_batch_candidates(sc.global_batch_size):
        stages = make(M)
        if stages is None:
            continue
        got = sc.score(stages, M, schedule=schedule, recompute=recompute)
        if got is not None and (best is None or got.L_ms < best[0]):
            best = (got.L_ms, stages, M, got)
    if best is None:
        raise InfeasibleError(
            f"{name}: " + infeasible_message(sc.profile, sc.cluster, sc.global_batch_size)
        )
    _, stages, M, scored = best
    return sc.build_plan(name, stages, M, scored)


def _layer_times(sc: Scorer, samples: int) -> list[float]:
    out = []
    for i in range(sc.N):
        f, b = sc.fb_ms(i, i + 1, samples)
        out.append(f + b)
    return out


def dp_plan(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """Pure data parallelism: one stage on every device, gradient accumulation over M
    micro-batches (M the one with the least L among those that fit, no re-computation). On a
    cluster of more than B devices (B the global batch size), every device of the fewest
    servers holding B (:func:`~dapple.core.usable.usable_cluster`): a replica beyond the
    B samples of a step would have none to compute.

    Raises:
        InfeasibleError: the whole model does not fit one device for any M.
    """
    cluster = usable_cluster(cluster, usable_devices(1, global_batch_size, [1]))
    sc = Scorer(profile, cluster, global_batch_size)
    devices = tuple(range(sc.G))
    return _best_over_m("dp", sc, lambda M: [(0, sc.N, devices)], recompute=False)


def _one_per_device(sc: Scorer, M: int) -> list[StageSpec]:
    S = min(sc.N, sc.G)
    cuts = block_partition(_layer_times(sc, sc.global_batch_size // M), S)
    return [(cuts[i], cuts[i + 1], (i,)) for i in range(S)]


def straight_plan_baseline(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """Straight pipeline: one stage per device (min(N, G) stages), layers balanced by time,
    DAPPLE schedule, re-computation only where memory demands it.

    Raises:
        InfeasibleError: no M fits.
    """
    sc = Scorer(profile, cluster, global_batch_size)
    return _best_over_m("straight", sc, lambda M: _one_per_device(sc, M))


def gpipe_plan(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """GPipe as torchgpipe plans it: min(N, G) stages, no replication, layers block-partitioned
    by time, GPipe schedule (all M forwards first) with checkpointing (re-computation) on every
    stage.

    Raises:
        InfeasibleError: no M fits (GPipe holds all M micro-batches' stage inputs).
    """
    sc = Scorer(profile, cluster, global_batch_size)
    return _best_over_m(
        "gpipe", sc, lambda M: _one_per_device(sc, M), schedule=GPIPE.name, recompute=True
    )


def _pipedream_partition(sc: Scorer, b: int) -> list[StageSpec] | None:
    """PipeDream's partitioning DP (Narayanan et al. 2019, section 3.1), single level.

    ``A(j, m)``: the slowest stage time when layers [0, j) run on m devices. A stage of layers
    [i, j) replicated on m' devices takes ``max(T(i, j), sync(i, j, m')) / m'`` where T is its
    forward + backward time of one (per-replica) minibatch of b samples and sync the gradient
    all-reduce; the transfer between stages costs ``2 x`` boundary bytes over the link.
    Stages take consecutive device ids.
    """
    N, G = sc.N, sc.G
    cl = sc.cluster
    inf = math.inf

    def T(i: int, j: int) -> float:
        f, bw = sc.fb_ms(i, j, b)
        return f + bw

    def stage(i: int, j: int, m: int, first: int) -> float:
        devs = tuple(range(first, first + m))
        return max(T(i, j), allreduce_ms(cl, sc.param_bytes(i, j), devs)) / m

    A = [[inf] * (G + 1) for _ in range(N + 1)]
    arg: list[list[tuple[int, int] | None]] = [[None] * (G + 1) for _ in range(N + 1)]
    for j in range(1, N + 1):
        for m in range(1, G + 1):
            A[j][m] = stage(0, j, m, 0)
            for i in range(1, j):
                per_sample = sc.profile.layers[i - 1].output_bytes_per_sample
                for m1 in range(1, m):
                    prev = A[i][m - m1]
                    if prev >= A[j][m]:
                        continue
                    a, c = m - m1 - 1, m - m1
                    comm = 2 * per_sample * b / cl.bandwidth_bytes_per_ms(a, c)
                    v = max(prev, comm, stage(i, j, m1, m - m1))
                    if v < A[j][m]:
                        A[j][m] = v
                        arg[j][m] = (i, m1)
    if A[N][G] == inf:
        return None
    out: list[tuple[int, int, int]] = []
    j, m = N, G
    while True:
        step = arg[j][m]
        if step is None:
            out.append((0, j, m))
            break
        i, m1 = step
        out.append((i, j, m1))
        j, m = i, m - m1
    out.reverse()
    stages: list[StageSpec] = []
    dev = 0
    for i, j, m in out:
        stages.append((i, j, tuple(range(dev, dev + m))))
        dev += m
    return stages


def pipedream_plan(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """PipeDream's partition and replication, run as a synchronous DAPPLE-scheduled plan.

    PipeDream balances stage throughput for asynchronous training; here its plan for the
    micro-batch size of each candidate M is scored by L (section 7.4).

    Raises:
        ValidationError: the instance is too large for this O(N^2 G^2) dynamic program.
        InfeasibleError: no M fits.
    """
    N, G = profile.num_layers, cluster.num_devices
    if N * N * G * G > PIPEDREAM_MAX_WORK:
        raise ValidationError(
            f"the pipedream planner's O(N^2 G^2) search is limited to N^2 G^2 <= "
            f"{PIPEDREAM_MAX_WORK:.0e}; got N={N} layers, G={G} devices"
        )
    sc = Scorer(profile, cluster, global_batch_size)
    cache: dict[int, list[StageSpec] | None] = {}

    def make(M: int) -> list[StageSpec] | None:
        b = global_batch_size // M
        if b not in cache:
            cache[b] = _pipedream_partition(sc, b)
        return cache[b]

    return _best_over_m("pipedream", sc, make)
