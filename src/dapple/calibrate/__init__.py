"""Calibration: measure this machine so the cost model predicts what the runtime does.

- :mod:`~dapple.calibrate.machine`: gloo/NCCL links (p2p and AllReduce fits), how local
  processes share the CPU cores, and the :func:`calibrate` entry point that writes a cluster;
- :mod:`~dapple.calibrate.compute_share`: the busy sweep in wall and CPU time, the sharing fit
  (c, E) and a lone worker's wall ms per CPU ms;
- :mod:`~dapple.calibrate.overheads`: the runtime's own host CPU per action, step and MiB,
  measured by running the runtime;
- :mod:`~dapple.calibrate.local`: plan for this machine's cores over local process counts.

Runs the runtime and the profiler; imported by the API and the CLI only.
"""

from dapple.calibrate.local import LocalCandidate, plan_local
from dapple.calibrate.machine import DEFAULT_SIZES, CalibrationResult, calibrate

__all__ = ["DEFAULT_SIZES", "CalibrationResult", "LocalCandidate", "calibrate", "plan_local"]
