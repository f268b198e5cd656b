"""``dapple calibrate``: measure links and compute share, write a cluster file."""

from __future__ import annotations

import argparse
import math

from rich.table import Table

from dapple.cli._console import StepProgress, console, print_table
from dapple.core.output_path import check_output_file
from dapple.errors import ValidationError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "calibrate", help="measure p2p/AllReduce cost on gloo and write a cluster JSON"
    )
    p.add_argument("--nproc", type=int, default=4, help="local processes (default 4)")
    p.add_argument("-o", "--output", required=True, help="cluster JSON to write")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per message size")
    p.add_argument("--max-mb", type=float, default=16.0, help="largest message in MiB")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple.calibrate.machine import DEFAULT_SIZES, calibrate
    from dapple.profiler.host_fit import check_local_processes

    check_output_file(args.output, "--output cluster file")
    least = DEFAULT_SIZES[1] / (1 << 20)
    if not (math.isfinite(args.max_mb) and args.max_mb >= least):
        raise ValidationError(
            f"--max-mb must be a number >= {least:g} (two message sizes to fit a line through), "
            f"got {args.max_mb}"
        )
    if args.repeats < 1:
        raise ValidationError(f"--repeats must be >= 1, got {args.repeats}")
    if args.nproc < 2:
        raise ValidationError(f"calibrate needs --nproc >= 2 to measure links, got {args.nproc}")
    check_local_processes(args.nproc, f"--nproc {args.nproc}")
    sizes = tuple(s for s in DEFAULT_SIZES if s <= args.max_mb * (1 << 20))
    con = console()
    with StepProgress("calibrate", detail=f"measuring {args.nproc} gloo processes", console=con):
        res = calibrate(args.nproc, sizes=sizes, repeats=args.repeats)
    t = Table(title=f"calibration: {res.nproc} processes, {res.backend}")
    for col in ("bytes", "p2p one-way ms", f"AllReduce({res.nproc}) ms"):
        t.add_column(col, justify="right")
    for n, a, b in zip(res.sizes_bytes, res.p2p_ms, res.allreduce_ms, strict=True):
        t.add_row(f"{n:,}", f"{a:.3f}", f"{b:.3f}")
    print_table(con, t)
    c = res.cluster
    for note in res.notes:
        con.print(note)
    con.print(
        f"fitted: bandwidth {c.intra_server_bandwidth_gbps:.2f} Gbps, latency {c.intra_server_latency_ms:.4f} ms, "
        f"compute_slowdown {c.compute_slowdown:.2f} (matmul {res.matmul_alone_ms:.2f} ms alone, "
        f"{res.matmul_shared_ms:.2f} ms with {res.nproc} processes)"
    )
    if c.compute_cores_per_server is not None:
        con.print(
            f"CPU sharing: {c.compute_cores_per_server:.2f} compute units per server, background "
            f"load {c.background_load_per_server:.2f} (k busy workers each run at "
            "min(1, c/(k+E)) / min(1, c/(1+E)) of a lone worker's speed)"
        )
    c.save(args.output)
    con.print(f"wrote {args.output}")
    return 0
