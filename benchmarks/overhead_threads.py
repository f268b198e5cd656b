"""The calibrated host CPU terms against the ranks' intra-op thread count.

``dapple calibrate`` measures the runtime's host CPU (``action_overhead_ms``,
``step_overhead_ms``; :mod:`dapple.calibrate.overheads`) as *process* CPU time. Two gloo ranks
on this machine run :func:`~dapple.calibrate.overheads.runtime_overheads` with their thread pool
started at T intra-op threads (a matmul before), measured two ways, in alternating rounds:

* *at T threads*: the pool left at T while measuring (how calibrate measured before);
* *one thread*: the measurement under ``calibrate.machine._one_thread`` (how it measures now).

On 12 dedicated cores (4 ranks x 3 threads) the first read 31 ms per step and made L 15-30x the
measured step (``../shared/evidence/h200-2026-11-28/run2-cpu-fidelity-12cores.md``).

    python benchmarks/overhead_threads.py --rounds 2 --out benchmarks/overhead_threads.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, load_note


def _rank(rank: int, port: int, threads: int, one: bool, q: Any) -> None:
    from dapple.calibrate.machine import _one_thread
    from dapple.calibrate.overheads import runtime_overheads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    torch.ones(256, 256) @ torch.ones(256, 256)  # the pool starts with `threads` workers
    if one:
        with _one_thread():
            a, o = runtime_overheads(rank, 2)
    else:
        a, o = runtime_overheads(rank, 2)
    if rank == 0:
        q.put((a, o))
    dist.destroy_process_group()


def measure(threads: int, one: bool, port: int) -> tuple[float, float]:
    """``(action_overhead_ms, step_overhead_ms)`` from one 2-rank run."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, port, threads, one, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = q.get(timeout=600)
    for p in ps:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cmd = "python benchmarks/overhead_threads.py " + " ".join(sys.argv[1:])
    rows: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    port = 29800
    for r in range(args.rounds):
        for t in args.threads:
            for one in (False, True) if r % 2 == 0 else (True, False):
                port += 1
                rows.setdefault((t, one), []).append(measure(t, one, port))
    lines = [
        *header("Calibrated host CPU terms against the intra-op thread count", cmd),
        f"2 gloo ranks, {args.rounds} alternating rounds; median over rounds (each round's "
        "value in brackets). End: " + load_note() + ".",
        "",
        "| intra-op threads per rank | measured | action_overhead_ms | step_overhead_ms |",
        "|---:|---|---:|---:|",
    ]
    for (t, one), v in sorted(rows.items()):
        how = "one thread (now)" if one else f"at {t} threads (before)"
        acts = ", ".join(f"{x[0]:.2f}" for x in v)
        steps = ", ".join(f"{x[1]:.2f}" for x in v)
        lines.append(
            f"| {t} | {how} | {statistics.median(x[0] for x in v):.2f} ({acts}) "
            f"| {statistics.median(x[1] for x in v):.2f} ({steps}) |"
        )
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
