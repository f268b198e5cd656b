"""Why the CPU cost model read 15-30x high on dedicated cores: threads and CPU-time clocks.

On a 16-core host with 12 cores granted (4 workers x 3 pinned cores), the cost model predicted
4,301-7,078 ms for steps measured at 170-381 ms (``../shared/evidence/h200-2026-11-28``). Two
mechanisms, both measured here on whatever cores this process is granted:

1. *Threads sized by the host, not the grant.* Each worker got ``os.cpu_count() // 4`` = 4
   intra-op threads on 3 cores; OpenMP regions then wait, spinning, for descheduled threads.
   Here: N workers train the model's whole chain at once with t threads each, for t = the
   granted cores // N (the fix) and t = 2x that (the oversubscription the host count caused).
2. *CPU time of the process, not of the timing thread.* Co-worker profiles (one process timing
   each layer while N - 1 others train) read ``time.process_time``, which sums every thread of
   the process, spinning ones included: about t times the layer's time. Here: the same profile
   with the process's CPU time (the old clock) and the timing thread's (``time.thread_time``,
   the fix), beside the wall time each worker measured in (1).

The table gives each worker's forward + backward of the whole chain at batch ``--batch`` (ms):
measured with N workers computing at once, and the co-worker profile's sum under each clock.

Usage: ``python benchmarks/cpu_threads.py [--workers 2 --batch 8 --out benchmarks/cpu_threads.md]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import BENCH_MODEL, HERE, bench_transformer, header, load_note
from dapple.host.cpu_cores import threads_per_worker, usable_cores


def _chain_ms(threads: int, batch: int, steps: int, start: Any, out: Any) -> None:
    """One worker: forward + backward of the whole chain, wall ms per step (median)."""
    torch.set_num_threads(threads)
    wl = bench_transformer()
    layers = [wl.build_layer(i, 0).train() for i in range(wl.num_layers)]
    x0, y = wl.make_batch(batch, 0)

    def step() -> None:
        x = x0
        for layer in layers:
            x = layer(x)
        wl.loss_fn(x, y).backward()
        for layer in layers:
            layer.zero_grad(set_to_none=True)

    step()
    start.wait(timeout=120)  # every worker computes at once
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    out.put(statistics.median(times))


def measured_ms(workers: int, threads: int, batch: int, steps: int) -> float:
    """Median over workers of each one's median step while all ``workers`` compute at once."""
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_chain_ms, args=(threads, batch, steps, start, out))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(got)


def profiled_ms(workers: int, threads: int, batch: int, clock: Any) -> float:
    """The co-worker profile's forward + backward sum at ``batch`` with the given CPU clock."""
    from dapple.profiler import layer_measure
    from dapple.profiler.measure import profile_workload

    real = layer_measure.time.thread_time
    layer_measure.time.thread_time = clock  # type: ignore[assignment]
    try:
        prof = profile_workload(
            bench_transformer(), [batch], repeats=5, num_threads=threads, co_workers=workers
        )
    finally:
        layer_measure.time.thread_time = real  # type: ignore[assignment]
    return sum(x.forward.at(batch) + x.backward.at(batch) for x in prof.layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(HERE / "cpu_threads.md"))
    args = ap.parse_args(argv)
    command = "python benchmarks/cpu_threads.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = header("CPU threads and CPU-time clocks: profile vs measured", command.strip())
    n, b = args.workers, args.batch
    fixed = threads_per_worker(n)
    rows = []
    for t, what in ((fixed, "granted cores // N (the fix)"), (2 * fixed, "2x: oversubscribed")):
        meas = measured_ms(n, t, b, args.steps)
        proc = profiled_ms(n, t, b, time.process_time)
        thread = profiled_ms(n, t, b, time.thread_time)
        rows.append(
            f"| {t} ({what}) | {meas:.1f} | {proc:.1f} ({proc / meas:.2f}x) "
            f"| {thread:.1f} ({thread / meas:.2f}x) |"
        )
        print(rows[-1], flush=True)
    lines += [
        f"Model: zoo `transformer` {BENCH_MODEL}, forward + backward of the whole chain at batch "
        f"{b}; {n} workers on {usable_cores()} granted cores (`os.sched_getaffinity`; the host "
        f"has {__import__('os').cpu_count()}). Measured: each worker's median step while all "
        f"{n} compute at once ({args.steps} steps, median over workers). Profiled: "
        f"`profile_workload(co_workers={n})`'s sum over layers, timed by each clock. A profile "
        "is right when it reads the measured time before time-slicing, which the cost model "
        "adds from the calibrated sharing (c, E); with N workers on fewer than N x t cores "
        "the measured time includes that slicing.",
        "",
        "| threads per worker | measured ms | profile, process CPU time (old) | profile, "
        "thread CPU time (new) |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"End: {load_note()}.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
