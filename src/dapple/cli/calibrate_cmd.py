"""``dapple calibrate``: measure links and compute share, write a cluster file."""

from __future__ import annotations

import argparse

from rich.table import Table

from dapple.api.calibrating import CalibrateConfig
from dapple.cli._console import StepProgress, console, print_table

__all__ = ["calibrate_config_of", "register", "run_config"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "calibrate", help="measure p2p/AllReduce cost on gloo and write a cluster JSON"
    )
    p.add_argument("--nproc", type=int, default=4, help="local processes (default 4)")
    p.add_argument("-o", "--output", required=True, help="cluster JSON to write")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per message size")
    p.add_argument("--max-mb", type=float, default=16.0, help="largest message in MiB")
    p.set_defaults(func=run)


def calibrate_config_of(args: argparse.Namespace) -> CalibrateConfig:
    """The :class:`~dapple.api.calibrating.CalibrateConfig` of ``dapple calibrate``'s flags."""
    return CalibrateConfig(
        nproc=args.nproc, output=args.output, repeats=args.repeats, max_mb=args.max_mb
    )


def run(args: argparse.Namespace) -> int:
    return run_config(calibrate_config_of(args))


def run_config(cfg: CalibrateConfig) -> int:
    """Calibrate as ``cfg`` asks (:func:`dapple.api.calibrate`), print the measurements and the
    fit, and write the cluster file (``dapple calibrate`` once its flags are read)."""
    from dapple import api
    from dapple.api.calibrating import check_calibrate

    assert cfg.output is not None  # -o is a required flag
    check_calibrate(cfg, flags=True)  # before the progress line
    con = console()
    with StepProgress("calibrate", detail=f"measuring {cfg.nproc} gloo processes", console=con):
        res = api.calibrate(cfg, flags=True)  # writes cfg.output
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
            "min(1, c/(k+E)) / min(1, c/(1+E)) of a lone worker's speed); a lone worker: "
            f"{c.lone_wall_per_cpu:.2f} ms of wall time per ms of CPU time (1 on idle cores; "
            "it scales CPU-time profiles and host terms, and moves with the machine's load)"
        )
    con.print(f"wrote {cfg.output}")
    return 0
