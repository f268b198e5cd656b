"""A lone CPU worker's wall ms per CPU ms under this machine's load, and the busy sweep in both
clocks, over time.

4 local gloo processes at the runtime's thread count run the calibration's sweep
(:func:`dapple.calibrate.compute_share.busy_sweep_clocks`, one sweep per sample: the matmul with
k = 1 .. 4 ranks busy, in wall and in CPU time) ``--samples`` times per round, ``--every``
seconds apart. Each round runs two worker groups one after the other: *own* - every worker in a
session of its own, as dapple's launcher starts them (``dapple.host.own_session``; under
``sched_autogroup`` each gets one session's share of the CPU) - and *shared* - all in the
benchmark's session (``DAPPLE_SHARED_SESSION=1``). Per footing: W = wall / CPU at k = 1
(``Cluster.lone_wall_per_cpu``), the wall ratios t_k / t_1 the sharing fit reads, the CPU per
matmul at k over k = 1 (co-located workers slowing each other beyond time-slicing), the
processor-sharing model's wall per CPU ms at k = 4 (``W / compute_rate(4)`` with (c, E)
fitted to the same sweep) against the measured ``wall_4 / cpu_4``, and how fast W moves (the
change between consecutive samples).

Usage: ``python benchmarks/lone_worker.py [--rounds 2 --samples 8 --every 1 --out F]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, join_worker_group, run_worker_group, write_report

FOOTINGS = ("own", "shared")
"""Worker sessions: one each (dapple's launcher), or the benchmark's one."""


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], out: str) -> None:
    from dapple.calibrate.compute_share import busy_sweep_clocks
    from dapple.runtime import shutdown_distributed

    join_worker_group(rank, world, port)
    samples = []
    for _ in range(opts["samples"]):
        wall, cpu = busy_sweep_clocks(rank, world, sweeps=1)
        if rank == 0:
            samples.append({"t": time.time(), "load": os.getloadavg()[0], "wall": wall, "cpu": cpu})
        time.sleep(opts["every"])
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": samples}))
    shutdown_distributed()


def measure(rounds: int, samples: int, every: float) -> dict[str, list[dict[str, Any]]]:
    """Samples of both footings, alternating over ``rounds``."""
    from dapple.host.own_session import SHARED_SESSION_ENV

    got: dict[str, list[dict[str, Any]]] = {f: [] for f in FOOTINGS}
    opts = {"samples": samples, "every": every}
    for r in range(rounds):
        for footing in FOOTINGS if r % 2 == 0 else FOOTINGS[::-1]:
            if footing == "shared":
                os.environ[SHARED_SESSION_ENV] = "1"
            else:
                os.environ.pop(SHARED_SESSION_ENV, None)
            rows = run_worker_group(_worker, 4, opts)["samples"]
            got[footing] += [{**x, "round": r} for x in rows]  # type: ignore[dict-item]
    os.environ.pop(SHARED_SESSION_ENV, None)
    return got


def _q(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def summary(rows: list[dict[str, Any]], cores: float) -> list[str]:
    """One footing's table cells (min / median / max over samples)."""
    from dapple.calibrate.compute_share import fit_sharing, lone_wall_per_cpu
    from dapple.core.cluster import Cluster

    w = [lone_wall_per_cpu(x["wall"], x["cpu"]) for x in rows]
    ratio = [[x["wall"][k] / x["wall"][0] for x in rows] for k in range(4)]
    cpu = [[x["cpu"][k] / x["cpu"][0] for x in rows] for k in range(4)]
    model, meas = [], []
    for x, wx in zip(rows, w, strict=True):
        c, e = fit_sharing(x["wall"], cores)
        cl = Cluster(name="fit", servers=1, devices_per_server=4, device_memory_bytes=1,
                     intra_server_bandwidth_gbps=1.0, inter_server_bandwidth_gbps=1.0,
                     compute_cores_per_server=c, background_load_per_server=e)  # fmt: skip
        model.append(wx / cl.compute_rate(4))
        meas.append(x["wall"][3] / x["cpu"][3])
    steps = [abs(b - a) / a for a, b in itertools.pairwise(w)]
    loads = [x["load"] for x in rows]
    return [
        f"{len(rows)}",
        _q(loads),
        _q(w),
        ", ".join(f"{statistics.median(r):.2f}" for r in ratio),
        ", ".join(f"{statistics.median(r):.2f}" for r in cpu),
        _q(model),
        _q(meas),
        f"{statistics.median(steps):.0%} / {max(steps):.0%}" if steps else "-",
    ]


def report(got: dict[str, list[dict[str, Any]]], cores: float, every: float) -> list[str]:
    lines = [
        "| footing | samples | load (1 min) | W = wall / CPU ms, k = 1 | wall t_k / t_1, k = 1..4 "
        "(median) | CPU per matmul at k / k = 1 (median) | model wall/CPU at k = 4: "
        "W / compute_rate(4) | measured wall/CPU at k = 4 | W's change between samples "
        "(median / max) |",
        "|---|---:|---|---|---|---|---|---|---|",
    ]
    for footing in FOOTINGS:
        lines.append(f"| {footing} | " + " | ".join(summary(got[footing], cores)) + " |")
    lines += [
        "",
        "Cells with three numbers: min / median / max over the samples. (c, E) fitted per sample "
        f"(`fit_sharing`, c at most {cores:g}); samples about {every:g} s + one sweep apart.",
        "",
        "Per sample (footing, round, seconds from the first, load, W, wall ms k = 1..4, CPU ms "
        "k = 1..4):",
        "",
    ]
    from dapple.calibrate.compute_share import lone_wall_per_cpu

    t0 = min(x["t"] for rows in got.values() for x in rows)
    for footing in FOOTINGS:
        for x in got[footing]:
            lines.append(
                f"- {footing} r{x['round']} +{x['t'] - t0:.0f} s load {x['load']:.1f}: W "
                f"{lone_wall_per_cpu(x['wall'], x['cpu']):.2f}; wall "
                + " ".join(f"{v:.2f}" for v in x["wall"])
                + "; CPU "
                + " ".join(f"{v:.2f}" for v in x["cpu"])
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    from dapple.calibrate.machine import runtime_threads
    from dapple.host.cpu_cores import usable_cores

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each footing once")
    ap.add_argument("--samples", type=int, default=8, help="sweeps per footing per round")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between sweeps")
    ap.add_argument("--out", default=None, help="markdown report")
    args = ap.parse_args(argv)
    command = "python benchmarks/lone_worker.py " + " ".join(sys.argv[1:] if argv is None else argv)
    title = "A lone CPU worker's wall per CPU ms, and the busy sweep in both clocks"
    lines = header(title, command.strip())
    got = measure(args.rounds, args.samples, args.every)
    lines += report(got, usable_cores() / runtime_threads(4), args.every)
    write_report(lines, args.out)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
