"""dapple: synchronous pipeline + data parallel training (Fan et al., DAPPLE).

Architecture, one package per concept, each importing only those below it: ``cli`` > ``api``
> ``calibrate`` > ``runtime`` | ``simulate`` | ``profiler`` > ``planner`` | ``models`` >
``schedule`` > ``core`` > ``files`` | ``host``. ``core`` is the pure data model (profile,
cluster, plan), ``files`` the files dapple reads and writes, ``host`` this machine and its
processes; ``planner``, ``schedule`` and ``simulate`` are pure Python; ``runtime`` interprets the
same lowered schedules the simulator runs. ``lint-imports`` checks the layering.

The Python API (:mod:`dapple.api`) is re-exported lazily, so ``import dapple`` stays torch-free::

    import dapple
    prof = dapple.profile("transformer", batch_sizes=[1, 2, 4])
    plan = dapple.plan(prof, "local-cpu", global_batch_size=32)
    dapple.train(plan, "transformer", steps=10)
"""

from __future__ import annotations

import importlib
from typing import Any

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS, load_cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.errors import DappleError, InfeasibleError, ValidationError
from dapple.schedule import registry as _schedule_registry  # noqa: F401  (Plan's schedule rules)

__version__ = "0.1.0"

_API = ("load", "plan", "plan_local", "profile", "simulate", "train", "verify", "verify_many")

__all__ = [
    "PRESETS",
    "AffineTime",
    "Cluster",
    "DappleError",
    "InfeasibleError",
    "LayerProfile",
    "ModelProfile",
    "Plan",
    "StagePlan",
    "ValidationError",
    "load",
    "load_cluster",
    "plan",
    "plan_local",
    "profile",
    "simulate",
    "train",
    "verify",
    "verify_many",
]


def __getattr__(name: str) -> Any:
    """Lazy access to :mod:`dapple.api` functions (PEP 562): importing torch only when used."""
    if name in _API:
        return getattr(importlib.import_module("dapple.api"), name)
    raise AttributeError(f"module 'dapple' has no attribute {name!r}")
