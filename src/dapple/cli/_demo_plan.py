"""The demo's plans: the planner's choice, the best uneven pipeline, and why the choice won.

The planner (:func:`dapple.planner.make_plan`) returns the least predicted step time L. On a
loaded machine that may be one process, which shows nothing that only dapple does. The demo
therefore always trains a pipeline whose stages have *different* replica counts over all G
processes: the planner's choice when it is one, else
:func:`dapple.planner.uneven.uneven_pipeline`, the least-L such plan under the same cost model.
:func:`why` says in two lines what the candidates cost and what limited the choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency

__all__ = [
    "MEMORY_LIMIT_SHARE",
    "Costed",
    "cost",
    "why",
]

MEMORY_LIMIT_SHARE = 0.8
"""A plan whose peak memory per process passes this share of the usable memory is limited by it."""


@dataclass(frozen=True, slots=True)
class Costed:
    """A plan with what the cost model says of it beside L."""

    name: str
    """Which planner made it (``dapple``, ``dp``, ``uneven``...)."""
    plan: Plan
    peak_bytes: float
    """Peak memory of one process (the largest over the stages' replicas)."""
    transfer_ms: float
    """Boundary transfers of one step: M x (F + B) of the comm stages."""
    allreduce_ms: float
    """The largest AR_s (gradient AllReduce plus update) of a stage."""

    @property
    def step_ms(self) -> float:
        """L, the predicted step time."""
        return self.plan.predicted_step_ms

    @property
    def label(self) -> str:
        """``2:1:1 with M=4``, ``DP x4`` or ``1 process``."""
        p = self.plan
        if p.num_stages == 1:
            n = len(p.devices)
            return "1 process" if n == 1 else f"DP x{n}"
        return f"{p.replication} with M={p.num_micro_batches}"


def cost(name: str, plan: Plan, profile: ModelProfile, cluster: Cluster) -> Costed:
    """``plan`` with its peak memory, transfers and largest AllReduce under the cost model."""
    br = pipeline_latency(plan, profile, cluster)
    M = plan.num_micro_batches
    return Costed(
        name=name,
        plan=plan,
        peak_bytes=max(r.memory_bytes for r in br.stages),
        transfer_ms=sum(M * (r.forward_ms + r.backward_ms) for r in br.stages if r.kind == "comm"),
        allreduce_ms=max(r.allreduce_ms for r in br.stages),
    )


def _mib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def why(choice: Costed, trained: Costed, others: Sequence[Costed], cluster: Cluster) -> list[str]:
    """Two lines: what the planner's choice is predicted to cost against the trained uneven
    pipeline and the other candidates, and what limited the choice (the cores the processes
    share, their host CPU overheads, the pipeline's transfers and AllReduce, memory).

    Args:
        choice: the planner's plan.
        trained: the uneven pipeline the demo trains (``choice`` itself when it is one).
        others: the baselines, for comparison.
        cluster: the calibrated cluster.
    """
    G = cluster.num_devices
    n = len(choice.plan.devices)
    rivals: dict[str, Costed] = {}  # one per label, the first named (planners repeat plans)
    for c in (trained, *others):
        if not _same(c.plan, choice.plan):
            rivals.setdefault(c.label, c)
    faster = ", ".join(
        f"{c.step_ms / choice.step_ms:.2f}x faster than {c.label} ({c.name}, {c.step_ms:.1f} ms)"
        for c in sorted(rivals.values(), key=lambda c: c.step_ms)[:3]
    )
    who = f"1 of {G} processes" if n == 1 else f"{choice.label} on {n} of {G} processes"
    head = f"why: dapple chose {who}, predicted {choice.step_ms:.1f} ms per step"
    return [f"{head}: {faster}" if faster else head, _limits(choice, trained, cluster)]


def _same(a: Plan, b: Plan) -> bool:
    """The same stages, devices and M (whichever planner named them)."""
    return a.stages == b.stages and a.num_micro_batches == b.num_micro_batches


def _limits(choice: Costed, trained: Costed, cluster: Cluster) -> str:
    """The one line of what limited the choice."""
    G = cluster.num_devices
    c, E = cluster.compute_cores_per_server, cluster.background_load_per_server
    parts = []
    if c is not None and c < G:
        parts.append(
            f"compute: calibration measured {c:.2f} full-speed workers' worth of cores for the "
            f"{G} processes (background load {E:.2f}): beyond {max(1, math.ceil(c))} computing "
            "at once they only share the cores"
        )
    elif c is not None:
        parts.append(f"compute: each of the {G} processes gets a full core (measured {c:.2f})")
    if cluster.host_overheads:
        parts.append(
            f"host CPU: each process spends {cluster.step_overhead_ms:.3g} ms per step and "
            f"{cluster.action_overhead_ms:.3g} ms per forward, backward or transfer on those cores"
        )
    if not _same(trained.plan, choice.plan):
        parts.append(
            f"{trained.label} adds {trained.transfer_ms:.3g} ms of boundary transfers and "
            f"{trained.allreduce_ms:.3g} ms of gradient AllReduce and update per step"
        )
    usable = cluster.usable_memory_bytes
    peak = max(choice.peak_bytes, trained.peak_bytes)
    verdict = "limits it" if peak > MEMORY_LIMIT_SHARE * usable else "no limit"
    parts.append(f"memory: peak {_mib(peak)} of {_mib(usable)} per process, {verdict}")
    return "limits: " + "; ".join(parts)
