"""Runtime: run any plan on ``torch.distributed`` - uneven replication, split-concat, DAPPLE or
GPipe schedules - by interpreting the same lowered schedule the simulator runs (section 6).

Entry points: :func:`train` (Python API; spawns local workers or joins a ``torchrun`` group),
:func:`run_plan` (one rank, on an already initialised process group) and ``dapple train``.
"""

from dapple.runtime.config import StepMetrics, TrainConfig
from dapple.runtime.engine import RankFailure, StageRun, run_plan, validate_run
from dapple.runtime.launch.launcher import (
    free_port,
    init_distributed,
    resolve_workload,
    shutdown_distributed,
    spawn,
    train,
)
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.transport import BoundarySpec, infer_boundary_specs

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
