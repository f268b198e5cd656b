"""Measure the cluster instead of guessing it: point-to-point and AllReduce cost on the real
backend, fitted to the cost model's link parameters (latency + bytes / bandwidth).

Design: N local processes (or a torchrun job) time a ping-pong between ranks 0 and 1 and an
AllReduce over all ranks at several message sizes (median of repeats). The p2p one-way time
``t(n) = latency + n / bandwidth`` is fitted by least squares; the AllReduce fit inverts the ring
model ``2(N-1)/N * n / bw + 2(N-1) * latency`` used by :func:`dapple.planner.cost.allreduce_ms`,
and the bandwidth the cost model should use is the smaller of the two estimates' fits so both
kinds of traffic are predicted from one link. ``compute_slowdown`` is the time of a fixed matmul
in each worker while all N run at once, over its time in one process alone, both at the thread
count the runtime gives each of N local CPU workers (``cores // N``, see
:func:`runtime_threads`; profile with ``profile_workload(num_threads=runtime_threads(N))``): the
per-process compute share when processes share cores. The workers time a long run of matmuls
after a barrier and keep the wall time per matmul of its middle half, when all N run.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapple.core.cluster import GB, Cluster
from dapple.core.profile import fit_affine

__all__ = ["DEFAULT_SIZES", "CalibrationResult", "calibrate", "runtime_threads"]

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runtime_threads(nproc: int) -> int:
    """Intra-op threads the runtime gives each of ``nproc`` local CPU workers (``cores // nproc``,
    as :func:`dapple.runtime.launch.init_distributed`); profile CPU workloads with this count."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def _matmul_ms(repeats: int = 80, n: int = 384) -> float:
    """Wall time per ``n x n`` matmul over the middle half of ``repeats`` back-to-back runs.

    Wall time of the whole stretch, not per-matmul medians: a process descheduled by the OS
    (cores shared) loses that time between matmuls. The edges are dropped because concurrently
    started workers may not all be running yet (or any more).
    """
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b  # warm-up
    stamps = [time.perf_counter()]
    for _ in range(repeats):
        a @ b
        stamps.append(time.perf_counter())
    q = repeats // 4
    lo, hi = (q, repeats - q) if repeats - 2 * q > 0 else (0, repeats)
    return (stamps[hi] - stamps[lo]) * 1e3 / (hi - lo)


def _matmul_alone_ms(nproc: int) -> float:
    """:func:`_matmul_ms` in this process at the runtime's per-worker thread count."""
    old = torch.get_num_threads()
    torch.set_num_threads(runtime_threads(nproc))
    try:
        return _matmul_ms()
    finally:
        torch.set_num_threads(old)


def _measure(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Runs on every rank inside an initialised process group; rank 0's result is used."""
    p2p: list[float] = []
    for n in sizes:
        t = torch.zeros(max(1, n // 4), dtype=torch.float32)
        times = []
        for it in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
            if it > 0:
                times.append((time.perf_counter() - t0) * 1e3 / 2)
        p2p.append(statistics.median(times) if rank in (0, 1) else 0.0)
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
    dist.barrier()
    shared = _matmul_ms()
    dist.barrier()
    gathered = [0.0] * world
    dist.all_gather_object(gathered, shared)
    return {"p2p": p2p, "ar": ar, "shared": statistics.median(gathered)}


def _worker(rank: int, world: int, port: int, sizes: tuple[int, ...], repeats: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(runtime_threads(world))  # as the runtime's workers
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = _measure(rank, world, sizes, repeats)
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


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
) -> CalibrationResult:
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
        device_name=f"cpu-process ({backend})",
    )
    return CalibrationResult(
        nproc, backend, sizes, tuple(p2p), tuple(ar), alone, shared, cluster, notes
    )


def _memory_per_process(nproc: int) -> int:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover
        pages = 8 * GB
    return int(pages // nproc)


def calibrate(
    nproc: int = 4, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5
) -> CalibrationResult:
    """Spawn ``nproc`` local gloo processes, measure and fit.

    Args:
        nproc: number of local processes (>= 2 to measure links).
        sizes: message sizes in bytes.
        repeats: timed repetitions per size (median).

    Raises:
        ValidationError: ``nproc < 2``.
    """
    from dapple.errors import ValidationError

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _calibrate_under_torchrun(sizes, repeats)
    if nproc < 2:
        raise ValidationError(f"calibrate needs --nproc >= 2 to measure links, got {nproc}")
    alone = _matmul_alone_ms(nproc)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, sizes, repeats, q)) for r in range(nproc)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise ValidationError(f"calibration worker(s) failed: {bad} (rank, exit code)")
    res = q.get()
    return _fit(
        nproc,
        sizes,
        res["p2p"],
        res["ar"],
        alone,
        res["shared"],
        "gloo",
        _memory_per_process(nproc),
    )


def _calibrate_under_torchrun(sizes: tuple[int, ...], repeats: int) -> CalibrationResult:
    """Inside a torchrun job: the job's ranks are the devices; servers = nodes.

    The ping-pong pair is ranks 0 and 1, so with one process per node it measures the
    inter-server link; with several per node, the intra-server one (both fields get it).
    """
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    alone = _matmul_alone_ms(local)
    torch.set_num_threads(runtime_threads(local))  # as the runtime's workers
    dist.init_process_group("gloo")
    try:
        res = _measure(dist.get_rank(), world, sizes, repeats)
    finally:
        dist.destroy_process_group()
    out = _fit(
        world,
        sizes,
        res["p2p"],
        res["ar"],
        alone,
        res["shared"],
        "gloo",
        _memory_per_process(local),
    )
    servers = max(1, world // local)
    c = out.cluster
    import dataclasses

    cluster = dataclasses.replace(c, servers=servers, devices_per_server=world // servers)
    return dataclasses.replace(out, cluster=cluster)
