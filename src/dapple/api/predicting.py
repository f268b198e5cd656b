"""What a run is predicted to take, from its profile and cluster, before it starts.

:func:`predict_run` gives the step time (the simulator, :func:`~dapple.api.simulating.simulate`,
on the plan under the run's ZeRO floor) and each device group's memory (the cost model,
:func:`planned_memory`). :func:`dapple.api.train` computes it once, where the profile and
cluster are loaded for the run's checks, and returns it with the metrics: ``dapple train``
prints both beside what it measured without loading them again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile

if TYPE_CHECKING:
    from dapple.runtime.train_config import TrainConfig

__all__ = ["RunPrediction", "planned_memory", "predict_run"]


@dataclass(frozen=True, slots=True)
class RunPrediction:
    """A run's step time and memory as the simulator and the cost model predict them."""

    step_ms: float
    """The simulated step time of the plan under the run's ZeRO floor."""
    memory_bytes: tuple[float, ...]
    """The planner's per-replica estimate of each device group (:func:`planned_memory`)."""


def planned_memory(
    plan: Plan,
    profile: ModelProfile | str | Path,
    cluster: Cluster | str,
    optimizer: str,
    momentum: float = 0.0,
) -> tuple[float, ...]:
    """The planner's per-replica estimate of each stage, with the optimizer state of
    ``optimizer`` (and ``momentum``): its tensors and its K_i micro-batches' activations
    (interleaved and ZB-H1: per device group, all its chunks, by replaying the schedule's
    compute order).

    Args:
        plan: The plan as it runs (its schedule and policy).
        profile: A :class:`ModelProfile`, its JSON path, ``paper:NAME`` or ``KIND=FILE,...``.
        cluster: A :class:`Cluster`, a preset name or a file.
        optimizer: The run's optimizer (``sgd``, ``adam``, ``adamw``).
        momentum: The run's SGD momentum.

    Raises:
        ValidationError: a bad profile or cluster.
    """
    from dapple.api._inputs import as_cluster, with_profile_set
    from dapple.cost.pipeline import pipeline_latency
    from dapple.runtime.train_config import state_factor
    from dapple.schedule.registry import get_schedule

    prof, cl = with_profile_set(profile, as_cluster(cluster))
    prof = dataclasses.replace(prof, optimizer_state_factor=state_factor(optimizer, momentum))
    if not get_schedule(plan.schedule).uses_pipeline_latency:  # not L's rows: replay its order
        from dapple.cost.schedule_step import device_memory_by_group

        return tuple(device_memory_by_group(plan, prof))
    rows = pipeline_latency(plan, prof, cl).stages
    return tuple(float(r.memory_bytes) for r in rows if r.kind == "compute")


def predict_run(
    plan: Plan, profile: ModelProfile | str | Path, cluster: Cluster | str, config: TrainConfig
) -> RunPrediction:
    """The step time and memory of ``plan`` run as ``config`` says, on ``profile`` and
    ``cluster``.

    Raises:
        ValidationError: a bad profile or cluster, or a plan they cannot cost.
    """
    from dapple.api.simulating import simulate
    from dapple.runtime.parallel.stage_mesh import zero_floored

    floored = zero_floored(plan, config.zero_stage)
    step_ms = simulate(floored, profile, cluster, on_nonfinite=config.on_nonfinite).step_ms
    memory = planned_memory(plan, profile, cluster, config.optimizer, config.momentum)
    return RunPrediction(step_ms, memory)
