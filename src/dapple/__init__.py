"""dapple: synchronous pipeline + data parallel training (Fan et al., DAPPLE).

Architecture: ``profile`` (torch, measures layers) -> ``planner`` (pure; cost model, DAPPLE
search, baselines) -> ``schedule`` (pure; schedules as data) -> ``simulate`` (pure; discrete
events) -> ``runtime`` (torch.distributed; interprets the same schedules), with ``cli`` on top.
The pure data model lives in :mod:`dapple.profile`, :mod:`dapple.cluster`, :mod:`dapple.plan`.
"""

from dapple.cluster import PRESETS, Cluster, load_cluster
from dapple.errors import DappleError, InfeasibleError, ValidationError
from dapple.plan import Plan, StagePlan
from dapple.profile import AffineTime, LayerProfile, ModelProfile

__version__ = "0.1.0"

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
    "load_cluster",
]
