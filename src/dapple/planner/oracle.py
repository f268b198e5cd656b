"""Exhaustive oracle for small instances: every partition, replication and policy placement.

Scores every contiguous partition of the N layers, every replication vector over all G
devices and every sequence of placement policies (section 5.2; the last stage takes the
remaining devices), for every M, with the same L as the DP. Used to check the DP.
"""

from __future__ import annotations

from collections.abc import Iterator

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.batches import infeasible_message, micro_batch_candidates
from dapple.planner.placement import POLICIES, place, remaining_devices
from dapple.planner.scorer import Scored, Scorer, StageSpec

__all__ = ["MAX_ORACLE_DEVICES", "MAX_ORACLE_LAYERS", "exhaustive_plan", "placements"]

MAX_ORACLE_LAYERS = 12
MAX_ORACLE_DEVICES = 8


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered ways of writing ``total`` as ``parts`` positive integers."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def placements(cluster: Cluster, replicas: tuple[int, ...]) -> set[tuple[tuple[int, ...], ...]]:
    """Every distinct device assignment of stages with ``replicas`` devices that a sequence of
    placement policies yields (each stage but the last by some policy, the last the rest)."""
    out: set[tuple[tuple[int, ...], ...]] = set()

    def rec(i: int, occ: tuple[int, ...], acc: tuple[tuple[int, ...], ...]) -> None:
        if i == len(replicas) - 1:
            rest = remaining_devices(cluster, occ)
            if len(rest) == replicas[i]:
                out.add((*acc, rest))
            return
        seen = set()
        for pol in POLICIES:
            got = place(cluster, occ, replicas[i], pol)
            if got is None or got[0] in seen:
                continue
            seen.add(got[0])
            rec(i + 1, got[1], (*acc, got[0]))

    rec(0, (0,) * cluster.servers, ())
    return out


def exhaustive_plan(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """The plan with the least L in the whole policy-placement space (small instances only).

    Raises:
        ValidationError: more than MAX_ORACLE_LAYERS layers or MAX_ORACLE_DEVICES devices.
        InfeasibleError: nothing fits.
    """
    N, G = profile.num_layers, cluster.num_devices
    if N > MAX_ORACLE_LAYERS or G > MAX_ORACLE_DEVICES:
        raise ValidationError(
            f"the exhaustive planner handles at most {MAX_ORACLE_LAYERS} layers and "
            f"{MAX_ORACLE_DEVICES} devices, got {N} layers and {G} devices"
        )
    sc = Scorer(profile, cluster, global_batch_size)
    best: tuple[float, list[StageSpec], int, Scored] | None = None
    Ms = micro_batch_candidates(global_batch_size)
    for S in range(1, min(N, G) + 1):
        for sizes in _compositions(N, S):
            cuts = [0]
            for n in sizes:
                cuts.append(cuts[-1] + n)
            for reps in _compositions(G, S):
                for devs in placements(cluster, reps):
                    stages = [(cuts[i], cuts[i + 1], devs[i]) for i in range(S)]
                    for M in Ms:
                        got = sc.score(stages, M)
                        if got is not None and (best is None or got.L_ms < best[0]):
                            best = (got.L_ms, stages, M, got)
    if best is None:
        raise InfeasibleError(infeasible_message(profile, cluster, global_batch_size))
    _, stages, M, scored = best
    return sc.build_plan("exhaustive", stages, M, scored)
