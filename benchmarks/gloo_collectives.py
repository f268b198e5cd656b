"""What ZeRO's collectives cost on gloo beside the AllReduce they replace (4 CPU processes).

One 100M-float fp32 state (400 MB, a 100M-parameter stage's gradients or parameters) in
buckets of ``--bucket-mib``; each line times one way to move it across 4 local gloo
processes, asynchronously launched then waited for, best of 3 between barriers, with the
fused Adam update of the whole state and of one replica's quarter beside them. The ways are
those :mod:`dapple.runtime.parallel.zero` can choose from: an AllReduce (zero stage 0), a ``reduce``
per replica's chunk and ``reduce_scatter``/``reduce_scatter_tensor`` (the reduction half), a
``broadcast`` per chunk and ``all_gather``/``all_gather_into_tensor`` (the gather half).

Run: ``python benchmarks/gloo_collectives.py [--bucket-mib 25] [--out FILE]`` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _bench_common import header, join_worker_group, load_note, run_worker_group
from dapple.runtime import shutdown_distributed

N = 100_000_000
WORLD = 4


def _worker(rank: int, world: int, port: int, bucket_mib: int, out: str) -> None:
    join_worker_group(rank, world, port)  # as dapple's CPU ranks
    size = bucket_mib * 2**20 // 4
    chunk = size // world
    bufs = [torch.randn(size) for _ in range(-(-N // size))]
    rows: list[tuple[str, float]] = []

    def timed(name: str, launch: Callable[[], list[Any]]) -> None:
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for w in launch():
                if w is not None:
                    w.wait()
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        rows.append((name, best * 1e3))

    def part(b: torch.Tensor, j: int) -> torch.Tensor:
        return b[j * chunk : (j + 1) * chunk]

    timed("all_reduce per bucket (zero stage 0)",
          lambda: [dist.all_reduce(b, async_op=True) for b in bufs])  # fmt: skip
    timed("reduce per chunk, to its owner (ZeRO on gloo)",
          lambda: [dist.reduce(part(b, j), dst=j, async_op=True)
                   for b in bufs for j in range(world)])  # fmt: skip
    timed("reduce_scatter_tensor per bucket",
          lambda: [dist.reduce_scatter_tensor(torch.empty(chunk), b, async_op=True)
                   for b in bufs])  # fmt: skip
    timed("reduce_scatter (list of chunk views) per bucket",
          lambda: [dist.reduce_scatter(torch.empty(chunk), [part(b, j) for j in range(world)],
                                       async_op=True) for b in bufs])  # fmt: skip
    timed("broadcast per chunk, from its owner (ZeRO on gloo)",
          lambda: [dist.broadcast(part(b, j), src=j, async_op=True)
                   for b in bufs for j in range(world)])  # fmt: skip
    timed("all_gather_into_tensor per bucket",
          lambda: [dist.all_gather_into_tensor(b, part(b, rank).clone(), async_op=True)
                   for b in bufs])  # fmt: skip
    timed("all_gather (into chunk views) per bucket",
          lambda: [dist.all_gather([part(b, j) for j in range(world)], part(b, rank).clone(),
                                   async_op=True) for b in bufs])  # fmt: skip
    for name, share in (("whole", 1), ("a quarter", world)):
        ps = [torch.nn.Parameter(b[: b.numel() // share]) for b in bufs]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(ps, fused=True)
        opt.step()  # allocates the moments

        def step(opt: torch.optim.Optimizer = opt) -> list[Any]:
            opt.step()
            return []

        timed(f"fused Adam update of {name} of the state (every process)", step)
        del ps, opt
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows}))
    shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mib", type=int, default=25)
    ap.add_argument("--out", default=None, help="markdown file to write (default: print)")
    args = ap.parse_args()
    rows = run_worker_group(_worker, WORLD, args.bucket_mib)["rows"]
    base = float(rows[0][1])
    lines = header(
        "ZeRO's collectives on gloo beside the AllReduce",
        f"python benchmarks/gloo_collectives.py --bucket-mib {args.bucket_mib}",
    )
    lines += [
        f"{N / 1e6:.0f}M fp32 elements in {args.bucket_mib} MiB buckets, {WORLD} gloo processes "
        "on this machine, best of 3.",
        "",
        "| what | time | vs all_reduce |",
        "|---|---|---|",
        *(f"| {n} | {float(ms):.0f} ms | {float(ms) / base:.2f}x |" for n, ms in rows),
        "",
        f"End: {load_note()}.",
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
