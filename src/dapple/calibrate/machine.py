"""Measure the cluster instead of guessing it: point-to-point and AllReduce cost on the real
backend, fitted to the cost model's link parameters (latency + bytes / bandwidth).

Design: N local processes (or a torchrun job) time a ping-pong between ranks 0 and 1 and an
AllReduce over all ranks at several message sizes (median of repeats). The p2p one-way time
``t(n) = latency + n / bandwidth`` is fitted by least squares; the AllReduce fit inverts the ring
model ``2(N-1)/N * n / bw + 2(N-1) * latency`` used by :func:`dapple.cost.comm.allreduce_ms`,
and the bandwidth the cost model should use is the smaller of the two estimates' fits so both
kinds of traffic are predicted from one link.

Compute sharing (processor sharing in the simulator, :func:`dapple.cost.sharing.
shared_compute_scale` in the cost model). The profile is taken in ONE process at
``runtime_threads(N)`` intra-op threads (``profile_workload(num_threads=runtime_threads(N))``),
the thread count each of the N local workers runs with, so a worker computing *alone* runs at
the profile's speed: ``compute_slowdown = 1.0``. Sharing is the separate term
``compute_cores_per_server`` = c, the compute units in full-speed workers, at most
``len(os.sched_getaffinity(0)) / runtime_threads(N)`` (2 with 4 one-thread workers on 2
cores), and ``background_load_per_server`` = E. Other programs on a shared machine compete for
those cores, and how depends on the scheduler: Linux with autogroup shares the CPU fairly
between *sessions* first, so our N workers together get a fixed share (c below the core count,
E = 0); plain per-thread fair sharing looks like E competing threads. ``busy_sweep`` times a
fixed matmul with k = 1 .. N workers computing at once and ``fit_sharing`` fits (c, E) of
``t_k / t_1 = max(1, (k + E) / c) / max(1, (1 + E) / c)`` (an idle machine gives c = cores,
E = 0). The workers time a long run of matmuls after a barrier and keep the wall time per matmul of its
middle half (:mod:`dapple.calibrate.compute_share`). Those ratios are relative to a lone
worker; the same sweep's CPU time gives ``lone_wall_per_cpu`` = W, the lone worker's wall ms
per CPU ms (1 on idle cores; 4-8 on 2 cores at load 15-28), which turns a CPU-time profile and
the host terms into wall time (:mod:`dapple.cost.cpu_clock`). (``_fit`` without ``cores``, the
older calibration, puts the all-busy ratio ``t_shared / t_alone`` into ``compute_slowdown`` and
leaves c unset.)

Launch: the local processes are started by :func:`dapple.runtime.spawn`, as training's are, so
they end with the calling process however it ends (SIGKILL included), SIGTERM or SIGINT to it
stops them first, and they meet on loopback only (rank 0's TCPStore on the launcher's
``127.0.0.1`` socket, gloo on the loopback interface; :mod:`dapple.runtime.launch.local`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

from dapple.calibrate.compute_share import (
    _matmul_ms,
    busy_sweep,
    busy_sweep_clocks,
    fit_sharing,
    lone_wall_per_cpu,
)
from dapple.calibrate.overheads import comm_cpu_fit, runtime_overheads
from dapple.core.cluster import GIB, Cluster
from dapple.core.layer_profile import fit_affine
from dapple.host.cpu_cores import threads_per_worker, usable_cores

__all__ = [
    "DEFAULT_SIZES",
    "CalibrationResult",
    "busy_sweep",
    "busy_sweep_clocks",
    "calibrate",
    "fit_sharing",
    "runtime_threads",
    "usable_cores",
]

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
"""Message sizes in bytes (1 KiB .. 16 MiB)."""


@dataclass(frozen=True)
class CalibrationResult:
    """What was measured (ms per message size) and the fitted cluster."""

    nproc: int
    backend: str
    sizes_bytes: tuple[int, ...]
    p2p_ms: tuple[float, ...]
    allreduce_ms: tuple[float, ...]
    matmul_alone_ms: float
    matmul_shared_ms: float
    cluster: Cluster
    notes: list[str] = field(default_factory=list)


def runtime_threads(nproc: int) -> int:
    """Intra-op threads the runtime gives each of ``nproc`` local CPU workers (the usable cores
    over ``nproc``, :func:`dapple.host.cpu_cores.threads_per_worker`, as
    :func:`dapple.runtime.launch.launcher.init_distributed`); profile CPU workloads with this
    count."""
    return threads_per_worker(nproc)


def _matmul_alone_ms(nproc: int) -> float:
    """:func:`_matmul_ms` in this process at the runtime's per-worker thread count."""
    old = torch.get_num_threads()
    torch.set_num_threads(runtime_threads(nproc))
    try:
        return _matmul_ms()
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread while the host CPU terms are measured (process CPU time,
    :mod:`dapple.calibrate.overheads`). With more, the pool's idle workers spin between the
    runtime's small ops and their spinning counts as CPU time: 2 threads per rank read 22.9 ms
    per step against 1.1 ms with one (``benchmarks/overhead_threads.md``); 3 per rank read the
    31 ms per step that made L 15-30x the measured step on 12 dedicated cores. The runtime gives each worker at
    most its share of the cores (:func:`runtime_threads`), so that spinning takes no core another
    rank computes on: it is no host cost."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _measure(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Runs on every rank inside an initialised process group; rank 0's result is used."""
    with _one_thread():
        p2p, comm_cpu = _point_to_point(rank, world, sizes, repeats)
    ar: list[float] = []
    for n in sizes:
        t = torch.zeros(max(1, n // 4), dtype=torch.float32)
        times = []
        for it in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if it > 0:
                times.append((time.perf_counter() - t0) * 1e3)
        ar.append(statistics.median(times))
    sweep, sweep_cpu = busy_sweep_clocks(rank, world)
    with _one_thread():
        action, step = runtime_overheads(rank, world)
    return {
        "p2p": p2p,
        "ar": ar,
        "shared": sweep[-1],
        "sweep": sweep,
        "sweep_cpu": sweep_cpu,
        "host": (action, step, comm_cpu),
    }


def _point_to_point(
    rank: int, world: int, sizes: tuple[int, ...], repeats: int
) -> tuple[list[float], float]:
    """Ping-pong between ranks 0 and 1 at each size: the one-way times (ms, 0 on other ranks)
    and ``comm_cpu_ms_per_mb`` from both ends' CPU time (:func:`comm_cpu_fit`)."""
    p2p: list[float] = []
    cpu: list[float] = []  # CPU ms of this end per message (ranks 0 and 1)
    for n in sizes:
        t = torch.zeros(max(1, n // 4), dtype=torch.float32)
        times = []
        used = 0.0
        for it in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            c0 = time.process_time()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
            if it > 0:
                times.append((time.perf_counter() - t0) * 1e3 / 2)
                used += (time.process_time() - c0) * 1e3 / 2
        p2p.append(statistics.median(times) if rank in (0, 1) else 0.0)
        cpu.append(used / repeats)
    both = [torch.tensor(cpu, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(both, torch.tensor(cpu, dtype=torch.float64))
    return p2p, comm_cpu_fit(sizes, [float(x) for x in both[0] + both[1]])


def _measure_and_leave(
    rank: int, world: int, sizes: tuple[int, ...], repeats: int
) -> dict[str, Any]:
    """:func:`_measure` on the initialised default group, then leave it: cleanly
    (``shutdown_distributed``) after a measurement, bare ``destroy_process_group`` after a
    failure (peers may be gone)."""
    from dapple.runtime import shutdown_distributed

    try:
        res = _measure(rank, world, sizes, repeats)
    except BaseException:
        dist.destroy_process_group()
        raise
    shutdown_distributed()
    return res


def _worker(rank: int, world: int, sizes: tuple[int, ...], repeats: int, out: Any) -> None:
    """One rank started by :func:`dapple.runtime.spawn`: join the gloo group at rank 0's store on
    loopback (torch's default timeout), measure, and rank 0 sends the result on ``out`` (the
    write end of a pipe)."""
    from dapple.runtime.launch.local import local_store
    from dapple.runtime.launch.refusal import end_rank

    try:
        torch.set_num_threads(runtime_threads(world))  # as the runtime's workers
        store = local_store(default_pg_timeout)
        if store is None:
            raise RuntimeError("calibration worker not started by dapple.runtime.spawn")
        dist.init_process_group("gloo", **store)
        res = _measure_and_leave(rank, world, sizes, repeats)
        if rank == 0:
            out.send(res)
    except Exception as e:
        end_rank(e, rank)  # a refusal: the launcher's one line; else this rank's, no traceback


def _link_fit(sizes: Sequence[float], times_ms: Sequence[float]) -> tuple[float, float]:
    """``(bandwidth bytes/ms, latency ms)`` of ``t = latency + bytes / bandwidth``.

    Least squares first; when noise makes the slope non-positive (a slow small message), the
    bandwidth falls back to the best observed throughput ``bytes / t`` over all sizes.
    """
    line = fit_affine(sizes, times_ms)
    if line.per_sample_ms > 0:
        return 1.0 / line.per_sample_ms, line.fixed_ms
    best = max(n / t for n, t in zip(sizes, times_ms, strict=True) if t > 0)
    return best, min(times_ms)


def _fit(
    nproc: int,
    sizes: tuple[int, ...],
    p2p: list[float],
    ar: list[float],
    alone: float,
    shared: float,
    backend: str,
    memory_bytes: int,
    cores: float | None = None,
    sweep: Sequence[float] = (),
    host: Sequence[float] = (0.0, 0.0, 0.0),
    sweep_cpu: Sequence[float] = (),
) -> CalibrationResult:
    """Fits links; ``cores`` (usable cores / threads per worker) selects the sharing model
    (module docstring), None the older all-busy ``compute_slowdown``; ``sweep`` is the
    :func:`busy_sweep` the background load is fitted to (none: E = 0) and ``sweep_cpu`` the
    same sweep's CPU times, whose k = 1 gives ``lone_wall_per_cpu`` (none: 1); ``host`` the
    runtime's host CPU overheads ``(action ms, step ms, comm CPU ms per MiB)``
    (:mod:`dapple.calibrate.overheads`)."""
    notes = []
    p2p_bw, latency = _link_fit(sizes, p2p)
    if nproc > 1:
        k = 2 * (nproc - 1) / nproc
        ar_bw, _ = _link_fit([k * s for s in sizes], ar)
        notes.append(
            f"p2p fit: {latency:.4f} ms + bytes / {p2p_bw * 8e3 / 1e9:.2f} Gbps; "
            f"AllReduce ring fit: bytes / {ar_bw * 8e3 / 1e9:.2f} Gbps"
        )
        bw = min(p2p_bw, ar_bw)
    else:
        bw = p2p_bw
    gbps = bw * 8e3 / 1e9
    slowdown = max(1.0, shared / alone) if alone > 0 else 1.0
    capacity: float | None = None
    load, lone = 0.0, 1.0
    if cores is not None:
        capacity, load = fit_sharing(sweep, cores) if len(sweep) > 1 else (float(cores), 0.0)
        lone = lone_wall_per_cpu(sweep, sweep_cpu)
        ratios = ", ".join(f"{t / sweep[0]:.2f}" for t in sweep) if sweep else "-"
        notes.append(
            f"compute: {cores:g} usable core(s) per server in worker units; matmul with "
            f"k = 1..{len(sweep)} busy: {ratios} x one alone -> compute_cores_per_server "
            f"{capacity:.2f}, background load {load:.2f}; compute_slowdown 1.0; a lone "
            f"worker's wall ms per CPU ms {lone:.2f}"
        )
        slowdown = 1.0
    action, step, comm_cpu = host
    if any(host):
        notes.append(
            f"runtime host CPU: {action:.3f} ms per action, {step:.2f} ms per step, "
            f"{comm_cpu:.3f} ms per MiB sent or received"
        )
    cluster = Cluster(
        name=f"calibrated-{backend}-{nproc}",
        servers=1,
        devices_per_server=nproc,
        device_memory_bytes=memory_bytes,
        intra_server_bandwidth_gbps=gbps,
        inter_server_bandwidth_gbps=gbps,
        intra_server_latency_ms=latency,
        inter_server_latency_ms=latency,
        compute_slowdown=slowdown,
        compute_cores_per_server=capacity,
        background_load_per_server=load,
        lone_wall_per_cpu=lone,
        action_overhead_ms=action,
        step_overhead_ms=step,
        comm_cpu_ms_per_mb=comm_cpu,
        device_name=f"cpu-process ({backend})",
    )
    return CalibrationResult(
        nproc, backend, sizes, tuple(p2p), tuple(ar), alone, shared, cluster, notes
    )


def _memory_per_process(nproc: int) -> int:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover
        pages = 8 * GIB
    return int(pages // nproc)


def calibrate(
    nproc: int = 4, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5
) -> CalibrationResult:
    """Spawn ``nproc`` local gloo processes (:func:`dapple.runtime.spawn`), measure and fit;
    under torchrun (RANK and WORLD_SIZE in the env) the job's ranks are measured instead.

    Args:
        nproc: number of local processes (>= 2 to measure links).
        sizes: message sizes in bytes.
        repeats: timed repetitions per size (median).

    Raises:
        ValidationError: ``nproc < 2``, ``repeats < 1`` or fewer than 2 sizes, or a bad
            ``DAPPLE_SLOWDOWN``, before any process starts; a worker
            failed (the message names every failed rank's exit code or signal), or the
            workers were stopped by SIGTERM or SIGINT and the
            caller's own handler of it returned.
        DappleError: a worker's refusal (:mod:`dapple.runtime.launch.refusal`), as it raised it.
    """
    from dapple.errors import ValidationError
    from dapple.runtime.slowdown import slowdown_factor

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValidationError(f"calibrate needs --repeats >= 1, got {repeats!r}")
    if len(sizes) < 2:
        raise ValidationError(f"calibrate needs at least 2 message sizes to fit, got {len(sizes)}")
    slowdown_factor(0)  # the variable the runtime's tiny runs read, before any process starts
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _calibrate_under_torchrun(sizes, repeats)
    if nproc < 2:
        raise ValidationError(f"calibrate needs --nproc >= 2 to measure links, got {nproc}")
    from dapple.runtime.launch.failure import RankFailure
    from dapple.runtime.launch.launcher import spawn

    alone = _matmul_alone_ms(nproc)
    # A pipe, not a queue: a queue's locks are named semaphores that Python's resource tracker
    # reports as leaked when SIGTERM ends this process while the workers run.
    results, sender = mp.get_context("spawn").Pipe(duplex=False)
    try:  # after a failure, ranks still alive the group's timeout (+ a grace) later are killed
        spawn(_worker, nproc, sizes, repeats, sender, timeout_s=default_pg_timeout.total_seconds())
    except RankFailure as e:
        raise ValidationError(f"calibration: {e}") from e
    finally:
        sender.close()
    with results:
        try:
            res = results.recv()
        except EOFError as e:  # every rank exited 0 and rank 0 sent nothing
            raise ValidationError("calibration: rank 0 ended without its measurements") from e
    return _fit_measured(res, nproc, nproc, sizes, alone)


def _fit_measured(
    res: dict[str, Any], world: int, local: int, sizes: tuple[int, ...], alone: float
) -> CalibrationResult:
    """:func:`_fit` of what :func:`_measure` returned on ``world`` ranks, ``local`` per machine."""
    return _fit(
        world,
        sizes,
        res["p2p"],
        res["ar"],
        alone,
        res["shared"],
        "gloo",
        _memory_per_process(local),
        cores=usable_cores() / runtime_threads(local),
        sweep=res["sweep"],
        host=res.get("host", (0.0, 0.0, 0.0)),
        sweep_cpu=res.get("sweep_cpu", ()),
    )


def _calibrate_under_torchrun(sizes: tuple[int, ...], repeats: int) -> CalibrationResult:
    """Inside a torchrun job: the job's ranks are the devices; servers = nodes.

    The ping-pong pair is ranks 0 and 1, so with one process per node it measures the
    inter-server link; with several per node, the intra-server one (both fields get it).
    """
    from dapple.runtime.launch.refusal import end_if_refused

    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    alone = _matmul_alone_ms(local)
    torch.set_num_threads(runtime_threads(local))  # as the runtime's workers
    dist.init_process_group("gloo")
    try:
        res = _measure_and_leave(dist.get_rank(), world, sizes, repeats)
    except Exception as e:
        end_if_refused(e)  # the job's one line, or a peer's
        raise
    out = _fit_measured(res, world, local, sizes, alone)
    servers = max(1, world // local)
    c = out.cluster
    import dataclasses

    cluster = dataclasses.replace(c, servers=servers, devices_per_server=world // servers)
    return dataclasses.replace(out, cluster=cluster)
