"""The pure data model (no torch): model profiles, cluster topology and execution plans."""

from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import PRESETS, load_cluster
from dapple.core.layer_profile import AffineTime, LayerProfile, fit_affine
from dapple.core.plan import (
    Plan,
    StagePlan,
    interleave,
    slice_bounds,
    split_sizes,
    straight_plan,
    transfers,
)
from dapple.core.profile import ModelProfile

__all__ = [
    "GIB",
    "PRESETS",
    "AffineTime",
    "Cluster",
    "LayerProfile",
    "ModelProfile",
    "Plan",
    "StagePlan",
    "fit_affine",
    "interleave",
    "load_cluster",
    "slice_bounds",
    "split_sizes",
    "straight_plan",
    "transfers",
]
