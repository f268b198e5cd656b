"""Runtime: run any plan on ``torch.distributed`` - uneven replication, split-concat, DAPPLE or
GPipe schedules - by interpreting the same lowered schedule the simulator runs (section 6).

Entry points: :func:`train` (Python API; spawns local workers or joins a ``torchrun`` group),
:func:`run_plan` (one rank, on an already initialised process group) and ``dapple train``.

The names below load on first use (:pep:`562`), so a command that only reads or checks its
configuration (:mod:`dapple.runtime.train_config`) refuses a bad value without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapple.runtime.engine import StageRun, run_plan, validate_run
    from dapple.runtime.launch.failure import RankFailure
    from dapple.runtime.launch.launcher import (
        free_port,
        init_distributed,
        resolve_workload,
        shutdown_distributed,
        spawn,
        train,
    )
    from dapple.runtime.memory import ActivationMeter
    from dapple.runtime.step_metrics import StepMetrics
    from dapple.runtime.train_config import TrainConfig
    from dapple.runtime.transport import BoundarySpec, infer_boundary_specs

_HOMES = {
    "StepMetrics": "step_metrics",
    "TrainConfig": "train_config",
    "RankFailure": "launch.failure",
    "StageRun": "engine",
    "run_plan": "engine",
    "validate_run": "engine",
    "free_port": "launch.launcher",
    "init_distributed": "launch.launcher",
    "resolve_workload": "launch.launcher",
    "shutdown_distributed": "launch.launcher",
    "spawn": "launch.launcher",
    "train": "launch.launcher",
    "ActivationMeter": "memory",
    "BoundarySpec": "transport",
    "infer_boundary_specs": "transport",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dapple.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dapple.runtime.{home}"), name)


__all__ = [
    "ActivationMeter",
    "BoundarySpec",
    "RankFailure",
    "StageRun",
    "StepMetrics",
    "TrainConfig",
    "free_port",
    "infer_boundary_specs",
    "init_distributed",
    "resolve_workload",
    "run_plan",
    "shutdown_distributed",
    "spawn",
    "train",
    "validate_run",
]
