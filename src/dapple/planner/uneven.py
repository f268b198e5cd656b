"""The least-L pipeline whose stages have *different* replica counts over all G devices.

The DAPPLE search (:func:`dapple.planner.make_plan`) returns the least predicted step time L,
which may be one process or an even pipeline. :func:`uneven_pipeline` is the least-L plan under
the same cost model among pipelines of 2 to :data:`MAX_UNEVEN_STAGES` stages with uneven
replication (every partition of the N layers, every uneven replication of the G devices, every
placement policy, every M >= S so that micro-batches are in every stage at once). ``dapple
demo`` trains it when the planner's choice shows nothing that only a pipeline does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.oracle import placements
from dapple.planner.scorer import Scored, Scorer, StageSpec
from dapple.planner.search import micro_batch_candidates

__all__ = ["MAX_UNEVEN_STAGES", "is_uneven_pipeline", "uneven_pipeline"]

MAX_UNEVEN_STAGES = 3
"""Most computation stages :func:`uneven_pipeline` tries (4 devices: 3:1, 1:3, 2:1:1, 1:2:1,
1:1:2; every partition of the layers for each)."""


def is_uneven_pipeline(plan: Plan, num_devices: int) -> bool:
    """Whether ``plan`` is a pipeline over all ``num_devices`` devices whose stages do not all
    have the same replica count, with M >= S micro-batches (its stages work at once)."""
    S = plan.num_stages
    uneven = len({st.replicas for st in plan.stages}) > 1
    return S >= 2 and uneven and plan.num_micro_batches >= S and len(plan.devices) == num_devices


def _replications(G: int, S: int) -> Iterator[tuple[int, ...]]:
    """Replica counts of S stages over all G devices (each >= 1), not all equal."""
    for inner in itertools.combinations(range(1, G), S - 1):
        bounds = (0, *inner, G)
        reps = tuple(bounds[i + 1] - bounds[i] for i in range(S))
        if len(set(reps)) > 1:
            yield reps


def uneven_pipeline(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """The least-L plan with 2 to :data:`MAX_UNEVEN_STAGES` stages and uneven replication over
    all G devices of ``cluster``, with M >= S micro-batches (a pipeline whose stages work at
    once; M = 1 would run them one after the other), scored as the DAPPLE search scores its
    candidates.

    Raises:
        ValidationError: fewer than 3 devices (no uneven replication of 2 stages exists) or
            fewer than 2 layers.
        InfeasibleError: no such plan fits device memory.
    """
    N, G = profile.num_layers, cluster.num_devices
    if G < 3 or N < 2:
        raise ValidationError(
            f"an uneven pipeline needs at least 3 devices (2:1) and 2 layers, got {G} devices "
            f"and {N} layers"
        )
    sc = Scorer(profile, cluster, global_batch_size)
    Ms = micro_batch_candidates(global_batch_size)
    best: tuple[float, list[StageSpec], int, Scored] | None = None
    for S in range(2, min(N, G, MAX_UNEVEN_STAGES) + 1):
        for reps in _replications(G, S):
            for devs in placements(cluster, reps):
                for inner in itertools.combinations(range(1, N), S - 1):
                    cuts = (0, *inner, N)
                    stages = [(cuts[i], cuts[i + 1], devs[i]) for i in range(S)]
                    for M in (m for m in Ms if m >= S):
                        got = sc.score(stages, M)
                        if got is not None and (best is None or got.L_ms < best[0]):
                            best = (got.L_ms, stages, M, got)
    if best is None:
        raise InfeasibleError(
            f"no pipeline with uneven replication over {G} devices fits "
            f"{cluster.usable_memory_bytes / 2**20:.0f} MiB per device"
        )
    _, stages, M, scored = best
    return sc.build_plan("dapple-uneven", stages, M, scored)
