"""How local CPU workers share the cores: a matmul timed in wall and CPU time with k busy.

:func:`busy_sweep_clocks` times a fixed matmul with k = 1 .. N ranks computing at once, in wall
time and in the computing thread's CPU time. :func:`fit_sharing` fits the processor-sharing
terms (c, E) of :meth:`dapple.core.cluster.Cluster.compute_rate` to the wall-time ratios
``t_k / t_1``; :func:`lone_wall_per_cpu` reads W, a lone worker's wall ms per CPU ms
(``Cluster.lone_wall_per_cpu``), from k = 1: 1.0 on idle cores, and what other programs' load
costs a worker that computes alone, which the ratios leave out.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "MATMUL_WINDOW_MS",
    "busy_sweep",
    "busy_sweep_clocks",
    "fit_sharing",
    "lone_wall_per_cpu",
]

MATMUL_WINDOW_MS = 160.0
"""How long each worker of :func:`busy_sweep_clocks` (and the lone timing) runs matmuls back to
back. A window of wall time, not a count of matmuls: with more busy workers than cores, a fixed
count lets the first-scheduled workers finish early and the rest run on freed cores, so the
timed stretches overlap only partly and every ratio above the core count reads low (1.47 for 4
workers on 2 cores where they share at 2.0; :func:`fit_sharing` then fits a background load
E of about 5 that the machine does not have, ``benchmarks/fidelity.md``)."""


def _matmul_times(
    window_ms: float = MATMUL_WINDOW_MS,
    n: int = 384,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.thread_time,
) -> tuple[float, float]:
    """``(wall ms, CPU ms)`` per ``n x n`` matmul over the middle half of a ``window_ms``
    stretch (of ``clock``) of back-to-back runs; the CPU time is this thread's
    (``cpu_clock``) over the same matmuls.

    Wall time of the whole middle stretch, not per-matmul medians: a process descheduled by the
    OS (cores shared) loses that time between matmuls. The edges are dropped because workers
    started together may not all be running yet (or any more); every worker runs for the same
    window, so their middle halves overlap whatever share of a core each one gets.
    """
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b  # warm-up
    start = clock()
    end = start + window_ms / 1e3
    stamps, cpu = [start], [cpu_clock()]
    while stamps[-1] < end:
        a @ b
        stamps.append(clock())
        cpu.append(cpu_clock())
    lo = bisect.bisect_left(stamps, start + window_ms / 4e3)
    hi = bisect.bisect_right(stamps, start + 3 * window_ms / 4e3) - 1
    if hi - lo < 1:  # matmuls longer than a quarter of the window: the whole stretch
        lo, hi = 0, len(stamps) - 1
    return (stamps[hi] - stamps[lo]) * 1e3 / (hi - lo), (cpu[hi] - cpu[lo]) * 1e3 / (hi - lo)


def _matmul_ms(
    window_ms: float = MATMUL_WINDOW_MS,
    n: int = 384,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Wall ms per matmul of :func:`_matmul_times`."""
    return _matmul_times(window_ms, n, clock)[0]


def busy_sweep_clocks(
    rank: int, world: int, window_ms: float = MATMUL_WINDOW_MS, sweeps: int = 3
) -> tuple[list[float], list[float]]:
    """Matmul wall and CPU ms (each the median over the busy ranks) when k = 1 .. world ranks
    compute at once (the others wait in a barrier, which takes no CPU). Call on every rank.

    The sweep runs ``sweeps`` times and keeps each k's median: one load spike from another
    program in a single measurement - say the k = 1 time, which would compress every ratio
    and fake a background load E in :func:`fit_sharing` - does not move a median of three.
    (Not the minimum: the fastest of several runs is biased low for large k, where a rank
    that starts late after the barrier shares less of its window.) Every busy rank times the
    same ``window_ms`` of wall time (:func:`_matmul_times`), so their timed middles overlap.

    Returns:
        ``(wall, cpu)``: per k = 1 .. world, ms per matmul.
    """
    runs: list[list[tuple[float, float]]] = []
    for _ in range(max(1, sweeps)):
        out = []
        for k in range(1, world + 1):
            dist.barrier()
            mine = _matmul_times(window_ms) if rank < k else (0.0, 0.0)
            dist.barrier()
            gathered: list[tuple[float, float]] = [(0.0, 0.0)] * world
            dist.all_gather_object(gathered, mine)
            busy = gathered[:k]
            out.append(
                (statistics.median(w for w, _ in busy), statistics.median(c for _, c in busy))
            )
        runs.append(out)
    per_k = list(zip(*runs, strict=True))
    return (
        [statistics.median(w for w, _ in ts) for ts in per_k],
        [statistics.median(c for _, c in ts) for ts in per_k],
    )


def busy_sweep(
    rank: int, world: int, window_ms: float = MATMUL_WINDOW_MS, sweeps: int = 3
) -> list[float]:
    """The wall times of :func:`busy_sweep_clocks`."""
    return busy_sweep_clocks(rank, world, window_ms, sweeps)[0]


def lone_wall_per_cpu(wall_ms: Sequence[float], cpu_ms: Sequence[float]) -> float:
    """W of a :func:`busy_sweep_clocks`: its k = 1 wall ms over CPU ms, at least 1 (a thread
    cannot run longer than the wall clock; a ratio below 1 is the clocks' resolution); 1 when
    the CPU time is missing or 0."""
    if not wall_ms or not cpu_ms or cpu_ms[0] <= 0:
        return 1.0
    return max(1.0, wall_ms[0] / cpu_ms[0])


def fit_sharing(sweep_ms: Sequence[float], max_cores: float) -> tuple[float, float]:
    """``(c, E)`` (``compute_cores_per_server``, ``background_load_per_server``) that best explain
    a :func:`busy_sweep`: ``t_k / t_1 = max(1, (k + E) / c) / max(1, (1 + E) / c)`` by least
    squares on the logs over a grid (c in [1, max_cores] step 0.01, E in [0, 8] step 0.05).

    c below 1 is not needed: with a lone worker already sharing, ``(c, E)`` and ``(1, E')``
    give the same ratios. Ties keep the largest c, then the smallest E (an idle machine gives
    ``(max_cores, 0)``).
    """
    t1 = sweep_ms[0]
    obs = [(k, math.log(t / t1)) for k, t in enumerate(sweep_ms, start=1) if t > 0 and t1 > 0]
    top = max(1.0, float(max_cores))
    best_c, best_e, best = top, 0.0, math.inf
    steps = round((top - 1.0) / 0.01)
    for i in range(steps + 1):
        c = 1.0 + (top - 1.0) * i / steps if steps else top
        for j in range(161):
            e = j * 0.05
            base = math.log(max(1.0, (1 + e) / c))
            err = sum((y - (math.log(max(1.0, (k + e) / c)) - base)) ** 2 for k, y in obs)
            if err < best - 1e-9 or (abs(err - best) <= 1e-9 and c > best_c):
                best_c, best_e, best = c, e, err
    return best_c, best_e
