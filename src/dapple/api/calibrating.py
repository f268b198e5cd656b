"""The Python API's calibration side: one typed :class:`CalibrateConfig` behind ``dapple
calibrate`` and :func:`calibrate`.

``dapple calibrate``'s flags are read once into a :class:`CalibrateConfig`; ``calibrate(cfg)``
measures this machine's links and compute sharing with local gloo processes and fits a cluster
(:func:`dapple.calibrate.machine.calibrate`), once :func:`check_calibrate` has refused what it
cannot measure or write. Torch loads with the measurement, not with this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapple.calibrate.machine import CalibrationResult

__all__ = ["CalibrateConfig", "calibrate", "check_calibrate"]


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


def check_calibrate(cfg: CalibrateConfig, *, flags: bool = False) -> None:
    """What :func:`calibrate` refuses before any process starts: an output file it could not
    write, a count that is not an integer, a largest message below two sizes to fit a line
    through, ``repeats`` outside 1 to :data:`~dapple.api.profiling.MAX_RUNS`, ``nproc`` below 2
    or more local processes than this host's memory can start
    (:func:`dapple.profiler.host_fit.check_local_processes`); ``flags``: messages name
    ``dapple calibrate``'s flags.

    Raises:
        ValidationError: one line naming the option and the value.
    """
    from dapple.api.profiling import MAX_RUNS
    from dapple.calibrate.machine import DEFAULT_SIZES
    from dapple.errors import ValidationError, check_integer_fields
    from dapple.files.output_path import check_output_file
    from dapple.profiler.host_fit import check_local_processes

    check_integer_fields(cfg)  # nproc=2.0, repeats=1.5 reached the processes

    def opt(name: str) -> str:
        return "--" + name.replace("_", "-") if flags else name

    if cfg.output is not None:
        check_output_file(cfg.output, f"{opt('output')} cluster file")
    least = DEFAULT_SIZES[1] / (1 << 20)
    if not (math.isfinite(cfg.max_mb) and cfg.max_mb >= least):
        raise ValidationError(
            f"{opt('max_mb')} must be a number >= {least:g} (two message sizes to fit a line "
            f"through), got {cfg.max_mb}"
        )
    if not 1 <= cfg.repeats <= MAX_RUNS:
        raise ValidationError(
            f"{opt('repeats')} must be from 1 to {MAX_RUNS} (timed repetitions per message "
            f"size), got {cfg.repeats}"
        )
    if cfg.nproc < 2:
        raise ValidationError(
            f"calibrate needs {opt('nproc')} >= 2 to measure links, got {cfg.nproc}"
        )
    check_local_processes(cfg.nproc, f"{opt('nproc')} {cfg.nproc}")


def calibrate(cfg: CalibrateConfig, *, flags: bool = False) -> CalibrationResult:
    """Measure point-to-point and AllReduce times at the message sizes up to ``cfg.max_mb``
    and compute sharing on ``cfg.nproc`` local processes, fit the cluster, and save it to
    ``cfg.output`` when given.

    Args:
        cfg: What to measure and where to write it.
        flags: Messages name ``dapple calibrate``'s flags.

    Raises:
        ValidationError: what :func:`check_calibrate` refuses, before any measuring; as
            :func:`dapple.calibrate.machine.calibrate`.
    """
    from dapple.calibrate.machine import DEFAULT_SIZES
    from dapple.calibrate.machine import calibrate as measure

    check_calibrate(cfg, flags=flags)
    sizes = tuple(s for s in DEFAULT_SIZES if s <= cfg.max_mb * (1 << 20))
    res = measure(cfg.nproc, sizes=sizes, repeats=cfg.repeats)
    if cfg.output is not None:
        res.cluster.save(cfg.output)
    return res
