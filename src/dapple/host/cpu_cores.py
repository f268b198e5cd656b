"""CPU cores a process may use, and the intra-op threads each of N local workers gets.

The cores are the process's CPU affinity (``os.sched_getaffinity``: what ``taskset``, a
container's cpuset or a batch scheduler grants), not ``os.cpu_count()`` (every core of the
host). Sizing threads by the host count oversubscribes a restricted process: 4 workers with
``16 // 4`` threads each on 12 granted cores run 16 OpenMP threads on 12 cores, and every
parallel region then waits, spinning, for a descheduled peer thread. On the first run with
dedicated cores (an H200 host, 4 workers on 12 of 16 cores) that, together with CPU-time
profiles summing every thread's CPU, put the cost model's step time 15-30x above the measured
one. Pure Python, no torch.
"""

from __future__ import annotations

import os

__all__ = ["threads_per_worker", "usable_cores"]


def usable_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Intra-op threads of each of ``workers`` local CPU processes: the usable cores over the
    workers, at least 1, so the workers' threads together never exceed the cores granted."""
    return max(1, usable_cores() // max(1, workers))
