"""The Python API's planning for this machine's CPU cores: one typed :class:`PlanLocalConfig`
behind ``dapple plan-local`` and :func:`plan_local`.

``dapple plan-local``'s flags are read once into a :class:`PlanLocalConfig`;
:func:`plan_local_candidates` profiles, calibrates and plans for each process count it names
(:func:`dapple.calibrate.local.plan_local`) and writes the best plan with its profile and
cluster, after :func:`check_plan_local` refused what it cannot do before anything is loaded or
measured; :func:`plan_local` returns the best plan, of a config or of keyword arguments. Torch
loads with the measurement, not with this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api.run_config import ModelConfig

if TYPE_CHECKING:
    from dapple.api._inputs import WorkloadLike
    from dapple.calibrate.local import LocalCandidate
    from dapple.core.plan import Plan
    from dapple.models.workload import Workload
    from dapple.profiler.measure import ProgressFn

__all__ = [
    "OUTPUT_FILES",
    "PlanLocalConfig",
    "check_plan_local",
    "plan_local",
    "plan_local_candidates",
]

OUTPUT_FILES = ("plan.json", "profile.json", "cluster.json")
"""The files :func:`plan_local_candidates` writes in ``out_dir``: the best plan, and the
profile and cluster it was made from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLocalConfig:
    """What ``dapple plan-local`` is asked for: the model, the batch, the process counts to
    try, and where to write the best plan."""

    model: ModelConfig
    """The model (``-m`` and its flags)."""
    global_batch_size: int
    """Samples per step."""
    nprocs: tuple[int, ...] = (2, 4)
    """Candidate numbers of local processes (each at least 2), each planned."""
    repeats: int = 5
    """Timed runs per layer (median kept)."""
    precision: str = "fp32"
    """The run's precision: the profile is measured under its autocast."""
    out_dir: str | None = None
    """Write :data:`OUTPUT_FILES` of the best count here (None: nothing written)."""


def check_plan_local(cfg: PlanLocalConfig, *, flags: bool = False) -> None:
    """What :func:`plan_local_candidates` refuses before it loads or measures anything: a batch
    below 1, ``repeats`` that is not a count from 1 to :data:`~dapple.api.profiling.MAX_RUNS`,
    an ``out_dir`` whose files it could not write, more local processes than this host's
    memory can start (:func:`dapple.profiler.host_fit.check_local_processes`); ``flags``:
    messages name ``dapple plan-local``'s flags.

    Raises:
        ValidationError: one line naming the option and the value.
    """
    from dapple.api.profiling import MAX_RUNS
    from dapple.errors import ValidationError, check_integer_fields
    from dapple.files.output_path import check_output_dir, check_output_file
    from dapple.profiler.host_fit import check_local_processes

    check_integer_fields(cfg)  # the keyword form passes counts through as given
    batch, out_dir, nprocs, repeats = (
        ("--global-batch-size", "--out-dir", "--nprocs", "--repeats") if flags
        else ("global_batch_size", "out_dir", "nprocs", "repeats")
    )  # fmt: skip
    if cfg.global_batch_size < 1:
        raise ValidationError(f"{batch} must be >= 1, got {cfg.global_batch_size}")
    if not 1 <= cfg.repeats <= MAX_RUNS:
        raise ValidationError(
            f"{repeats} must be an integer from 1 to {MAX_RUNS} (timed runs per layer), got "
            f"{cfg.repeats}"
        )
    if cfg.out_dir is not None:
        out = check_output_dir(cfg.out_dir, out_dir)
        for name in OUTPUT_FILES:
            check_output_file(out / name, f"{out_dir} file")
    most = _most_processes(cfg)
    if most is not None:
        check_local_processes(most, f"{nprocs} {','.join(map(str, cfg.nprocs))}")


def _most_processes(cfg: PlanLocalConfig) -> int | None:
    """The largest of ``cfg.nprocs`` (None where a count is not an integer or there is none:
    :func:`dapple.calibrate.local.plan_local` refuses those)."""
    counts = tuple(cfg.nprocs)
    return max(counts) if counts and all(isinstance(n, int) for n in counts) else None


def plan_local_candidates(
    cfg: PlanLocalConfig,
    workload: Workload | None = None,
    progress: ProgressFn | None = None,
    *,
    flags: bool = False,
) -> tuple[LocalCandidate, list[LocalCandidate]]:
    """The best of ``cfg``'s process counts and every count's plan
    (:func:`dapple.calibrate.local.plan_local`); the best one's plan, profile and cluster
    written to ``cfg.out_dir`` when given.

    Args:
        cfg: What to plan.
        workload: ``cfg.model`` already loaded (None: loaded here).
        progress: Called per profiled layer, calibration and plan (``done, total, what``).
        flags: Messages name ``dapple plan-local``'s flags.

    Raises:
        ValidationError: a bad model spec or a count below 2; before any measuring, what
            :func:`check_plan_local` refuses, or a model too large for the processes on this
            host (:func:`dapple.profiler.host_fit.check_host_memory`).
    """
    from dapple.api._inputs import as_workload
    from dapple.calibrate.local import plan_local as plan_counts
    from dapple.profiler.host_fit import check_host_memory

    check_plan_local(cfg, flags=flags)
    if workload is None:
        assert cfg.model.spec is not None  # -m is a required flag
        workload = as_workload(cfg.model.spec, cfg.model.overrides())
    most = _most_processes(cfg)
    if most is not None:
        check_host_memory(workload, most, what="planning")  # profiled with co-workers
    best, cands = plan_counts(
        workload,
        cfg.global_batch_size,
        cfg.nprocs,
        repeats=cfg.repeats,
        precision=cfg.precision,
        progress=progress,
    )
    if cfg.out_dir is not None:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        plan_file, profile_file, cluster_file = (out / name for name in OUTPUT_FILES)
        best.plan.save(plan_file)
        best.profile.save(profile_file)
        best.cluster.save(cluster_file)
    return best, cands


@overload
def plan_local(workload: PlanLocalConfig) -> Plan: ...
@overload
def plan_local(
    workload: WorkloadLike,
    global_batch_size: int,
    nprocs: Sequence[int] = (2, 4),
    *,
    overrides: Mapping[str, Any] | None = None,
    repeats: int = 5,
    precision: str = "fp32",
) -> Plan: ...
def plan_local(
    workload: PlanLocalConfig | WorkloadLike,
    global_batch_size: int | None = None,
    nprocs: Sequence[int] = (2, 4),
    *,
    overrides: Mapping[str, Any] | None = None,
    repeats: int = 5,
    precision: str = "fp32",
) -> Plan:
    """The best plan for this machine's CPU cores over local process counts ``nprocs``: each
    count is profiled as co-located workers (under ``precision``'s autocast, as ``dapple
    plan-local --precision``), calibrated and planned; the lowest predicted L wins
    (:func:`dapple.calibrate.local.plan_local`, which also returns every candidate).
    ``plan_local(cfg)`` plans a :class:`PlanLocalConfig` (:func:`plan_local_candidates`, which
    also writes its ``out_dir``).

    Raises:
        ValidationError: a bad model spec or a count below 2.
    """
    from dapple.api._inputs import as_workload
    from dapple.calibrate.local import plan_local as plan_counts
    from dapple.errors import ValidationError

    if isinstance(workload, PlanLocalConfig):
        return plan_local_candidates(workload)[0].plan
    if global_batch_size is None:
        raise ValidationError("plan_local needs a global_batch_size")
    best, _ = plan_counts(
        as_workload(workload, overrides),
        global_batch_size,
        nprocs,
        repeats=repeats,
        precision=precision,
    )
    return best.plan
