"""Profilers: analytic paper profiles, torch measurement, shape-and-datasheet profiles of GPU
runs, PipeDream graph import.

Import the sub-module you need; this package imports nothing eagerly so the pure planner can
use :mod:`dapple.profiler.paper_models` and :mod:`dapple.profiler.pipedream` without torch.
The torch profiler is :func:`dapple.profiler.measure.profile_workload`; the one that counts
FLOPs and bytes instead of running the model is
:func:`dapple.profiler.analytic.analytic_profile` (``dapple profile --analytic``).
"""

__all__ = [
    "analytic",
    "analytic_devices",
    "analytic_models",
    "analytic_ops",
    "analytic_presets",
    "layer_measure",
    "measure",
    "paper_models",
    "pipedream",
]
