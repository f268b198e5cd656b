"""Profilers: analytic paper profiles, torch measurement, PipeDream graph import.

Import the sub-module you need; this package imports nothing eagerly so the pure planner can
use :mod:`dapple.profiler.paper_models` and :mod:`dapple.profiler.pipedream` without torch.
The torch profiler is :func:`dapple.profiler.measure.profile_workload`.
"""

__all__ = ["measure", "paper_models", "pipedream"]
