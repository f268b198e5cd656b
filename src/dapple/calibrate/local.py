"""Plan for this machine's CPU cores: the number of local worker processes is part of the plan.

On a GPU server every device is a worker. On a CPU host the "devices" are processes that share
the cores, and more of them is not always faster: 4 processes on 2 cores each get half a core,
slow each other down (caches, memory bandwidth) and add runtime overhead. :func:`plan_local`
therefore plans once per candidate process count k: it profiles the model as one of k
co-located workers (``profile_workload(co_workers=k)``), measures this machine with k
processes (:func:`dapple.calibrate.calibrate`), runs the planner for k devices, and keeps the
plan with the lowest predicted L. Measured on 2 cores (``benchmarks/vs_torch_pipelining.md``):
pure DP on 2 processes is 12% faster than on 4, and this procedure picks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload

__all__ = ["LocalCandidate", "ProgressFn", "default_batch_sizes", "plan_local"]

ProgressFn = Callable[[int, int, str], None]
"""``progress(done, total, description)``: after each profiled (batch size, layer), each
calibration and each plan."""


@dataclass(frozen=True)
class LocalCandidate:
    """The plan for one process count, with the profile and cluster it was made from."""

    processes: int
    plan: Plan
    profile: ModelProfile
    cluster: Cluster

    @property
    def predicted_ms(self) -> float:
        """The planner's L of :attr:`plan`."""
        return self.plan.predicted_step_ms


def default_batch_sizes(global_batch_size: int, nprocs: Sequence[int]) -> list[int]:
    """Powers of two up to the largest per-process batch (``G / min(nprocs)``, at most 64), so
    the affine fit covers pure data parallelism without extrapolating."""
    top = max(1, min(64, global_batch_size // max(1, min(nprocs))))
    sizes, b = [], 1
    while b <= top:
        sizes.append(b)
        b *= 2
    return sizes


def plan_local(
    workload: Workload,
    global_batch_size: int,
    nprocs: Sequence[int] = (2, 4),
    *,
    batch_sizes: Sequence[int] | None = None,
    repeats: int = 5,
    planner: str = "dapple",
    precision: str = "fp32",
    progress: ProgressFn | None = None,
) -> tuple[LocalCandidate, list[LocalCandidate]]:
    """The best plan over local process counts (module docstring).

    Args:
        workload: the model.
        global_batch_size: samples per step.
        nprocs: candidate numbers of local processes (each >= 2: calibration needs a pair).
        batch_sizes: profiled batch sizes (default :func:`default_batch_sizes`).
        repeats: timed runs per layer and batch size.
        planner: planner name (``dapple`` or a baseline).
        precision: the run's ``--precision`` (``fp32`` or ``bf16`` on the CPU): the profile
            is measured under that autocast.
        progress: optional callback ``(done, total, description)``: per count, one step per
            profiled (batch size, layer), one for the calibration, one for the plan.

    Returns:
        ``(best, every candidate in nprocs order)``.

    Raises:
        ValidationError: an empty ``nprocs`` or a count below 2; errors of the planner.
    """
    from dapple.calibrate.machine import calibrate, runtime_threads
    from dapple.planner import make_plan
    from dapple.profiler.measure import profile_workload

    counts = list(nprocs)
    if not counts or any(not isinstance(k, int) or k < 2 for k in counts):
        raise ValidationError(f"nprocs must be integers >= 2, got {counts}")
    sizes = list(batch_sizes) if batch_sizes else default_batch_sizes(global_batch_size, counts)
    steps = workload.num_layers * len(set(sizes))  # profiled (batch size, layer) per count
    total = (steps + 2) * len(counts)
    out = []
    for j, k in enumerate(counts):
        report = _Steps(progress, j * (steps + 2), total, f"{k} processes: ")
        prof = profile_workload(
            workload,
            sizes,
            repeats=repeats,
            num_threads=runtime_threads(k),
            co_workers=k,
            precision=precision,
            progress=report.profiled,
        )
        report(steps, "calibrate")
        cluster = calibrate(k).cluster
        report(steps + 1, "plan")
        out.append(
            LocalCandidate(k, make_plan(prof, cluster, global_batch_size, planner), prof, cluster)
        )
        report(steps + 2, "planned")
    return min(out, key=lambda c: c.predicted_ms), out


@dataclass(frozen=True)
class _Steps:
    """One process count's steps reported to :func:`plan_local`'s ``progress``: step ``done`` of
    this count is step ``base + done`` of ``total``."""

    progress: ProgressFn | None
    base: int
    total: int
    prefix: str

    def __call__(self, done: int, what: str) -> None:
        if self.progress is not None:
            self.progress(self.base + done, self.total, self.prefix + what)

    def profiled(self, done: int, _total: int, what: str) -> None:
        """``profile_workload``'s callback."""
        self(done, f"profile {what}")
