"""The Python API's calibration side: one typed :class:`CalibrateConfig` behind ``dapple
calibrate`` and :func:`calibrate`.

``dapple calibrate``'s flags are read once into a :class:`CalibrateConfig`; ``calibrate(cfg)``
measures this machine's links and compute sharing with local gloo processes and fits a cluster
(:func:`dapple.calibrate.machine.calibrate`). Torch loads with the measurement, not with this
module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapple.calibrate.machine import CalibrationResult

__all__ = ["CalibrateConfig", "calibrate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrateConfig:
    """What ``dapple calibrate`` is asked for: how to measure, and the cluster file to write."""

    nproc: int = 4
    """Local processes (at least 2, to measure links)."""
    output: str | None = None
    """The cluster JSON to write (``dapple calibrate`` requires it; None: not saved)."""
    repeats: int = 5
    """Timed repetitions per message size (median kept)."""
    max_mb: float = 16.0
    """The largest message, in MiB."""


def calibrate(cfg: CalibrateConfig) -> CalibrationResult:
    """Measure point-to-point and AllReduce times at the message sizes up to ``cfg.max_mb``
    and compute sharing on ``cfg.nproc`` local processes, fit the cluster, and save it to
    ``cfg.output`` when given.

    Raises:
        ValidationError: as :func:`dapple.calibrate.machine.calibrate`; an output file that
            cannot be written (before any measuring).
    """
    from dapple.calibrate.machine import DEFAULT_SIZES
    from dapple.calibrate.machine import calibrate as measure
    from dapple.files.output_path import check_output_file

    if cfg.output is not None:  # before any measuring
        check_output_file(cfg.output, "output cluster file")
    sizes = tuple(s for s in DEFAULT_SIZES if s <= cfg.max_mb * (1 << 20))
    res = measure(cfg.nproc, sizes=sizes, repeats=cfg.repeats)
    if cfg.output is not None:
        res.cluster.save(cfg.output)
    return res
