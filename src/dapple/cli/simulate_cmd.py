"""``dapple simulate``: run a plan's schedule through the discrete-event simulator.

The flags are read once into a :class:`~dapple.api.simulating.SimulateConfig`; :func:`run_config`
simulates it (:func:`dapple.api.simulating.simulate_runs`), prints each run and writes the files
asked for.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from dapple.api.simulating import SIMULATE_SECTIONS, SimulateConfig
from dapple.cli._config_args import ConfigFile, add_config_arguments, config_of, one
from dapple.cli._console import console, print_table
from dapple.cli._profile_arg import add_profile_argument
from dapple.cli._renamed import renamed
from dapple.cli._run_args import add_on_nonfinite_argument, add_virtual_stages_argument
from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import describe_presets
from dapple.errors import ValidationError
from dapple.schedule.registry import schedule_names

if TYPE_CHECKING:
    from dapple.simulate import SimResult

__all__ = ["register", "run", "run_config", "simulate_config_of"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="simulate one training step of a plan; Gantt chart, Chrome trace, memory plot",
    )
    p.add_argument("--plan", required=True, help="plan JSON (from `dapple plan`)")
    add_profile_argument(p)
    p.add_argument(
        "--cluster", required=True, help=f"a JSON/TOML file or a preset: {describe_presets()}"
    )
    p.add_argument("--servers", type=int, default=None, help="override the number of servers")
    p.add_argument(
        "--schedule",
        choices=schedule_names(),
        default=None,
        help="override the plan's",
    )
    add_virtual_stages_argument(p)
    p.add_argument("--policy", choices=("A", "B"), default=None, help="override the plan's")
    p.add_argument("--gantt", default=None, help="write a Gantt chart image (PNG/SVG/PDF)")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--memory", default=None, help="write a memory-over-time plot image")
    p.add_argument(
        "--layout",
        default=None,
        help="write a picture of the plan's stages on the cluster's servers and devices "
        "(replicas and tensor groups framed)",
    )
    p.add_argument(
        "--other-schedule",
        action="store_true",
        help="also simulate the plan under the schedule its own is measured against (GPipe "
        "beside DAPPLE; DAPPLE beside interleaved or zbh1) and stack both in the pictures",
    )
    p.add_argument("--compare", action=renamed("--other-schedule"), help=argparse.SUPPRESS)
    add_on_nonfinite_argument(p)
    add_config_arguments(p, _REQUIRED_DESTS, "its [simulate] section")
    p.set_defaults(func=run)


_FLAGS = tuple(one("", f.name) for f in fields(SimulateConfig))
"""Every flag of ``dapple simulate`` but ``--config`` and ``--print-config``, one per field."""
_REQUIRED_DESTS = ("plan", "profile", "cluster")
"""The flags ``dapple simulate`` needs unless the ``--config`` file gives them."""


def simulate_config_of(args: argparse.Namespace) -> SimulateConfig | None:
    """The simulation ``--config FILE``'s ``[simulate]`` section and the flags the command line
    gave on top (those win) ask for; with ``--print-config`` that printed as TOML instead
    (None).

    Raises:
        ValidationError: a bad file or value, or no plan, profile or cluster.
    """
    from dapple.api.simulating import dump_simulate_config, load_simulate_config

    file = ConfigFile(
        SimulateConfig,
        SIMULATE_SECTIONS,
        lambda path, over: load_simulate_config(path, over=over),
        dump_simulate_config,
        {("", d): f"--{d}" for d in _REQUIRED_DESTS},
    )
    return config_of(args, _FLAGS, file)


def run(args: argparse.Namespace) -> int:
    cfg = simulate_config_of(args)  # --config FILE, --print-config
    return 0 if cfg is None else run_config(cfg)


def run_config(cfg: SimulateConfig) -> int:
    """Simulate what ``cfg`` asks for, print each run and write the files asked for
    (``dapple simulate`` once its flags are read)."""
    from dapple.api.simulating import check_files, simulate_runs, write_files

    if cfg.servers is not None and cfg.servers < 1:  # before the plan and profile are read
        raise ValidationError(f"--servers must be >= 1, got {cfg.servers}")
    check_files(cfg, flags=True)
    done = simulate_runs(cfg, flags=True)
    if done.doubt is not None:
        print(f"dapple: warning: --profile {cfg.profile!r}: {done.doubt}", file=sys.stderr)
    plan, cluster, runs = done.plan, done.cluster, done.runs
    con = console()
    for title, r in runs:
        _print_run(con, title, r, cluster)
    from dapple.cli._plan_show import expert_line

    experts = expert_line(plan)
    if experts is not None:
        con.print(experts)
    for path in write_files(cfg, done):
        con.print(f"wrote {path}")
    return 0


def _print_run(con: Console, title: str, r: SimResult, cluster: Cluster) -> None:
    """One simulated run: its per-device table, the step time against L, and a warning for the
    devices over their memory."""
    t = Table(title=f"{title} on {cluster.name} ({cluster.num_devices} devices)")
    for col in ("device", "stage.replica", "busy ms", "bubble %", "peak in flight", "peak MiB"):
        t.add_column(col, justify="right")
    for d in r.devices:
        t.add_row(
            d.devices_text,  # a tensor group: one row, its devices
            f"{d.stage}.{d.replica}",
            f"{d.busy_ms:.2f}",
            f"{100 * d.bubble_fraction:.1f}",
            str(d.peak_in_flight),
            f"{d.peak_memory_bytes / 2**20:.1f}",
        )
    print_table(con, t)
    L = "n/a" if math.isnan(r.L_ms) else f"{r.L_ms:.3f} ms"
    gap = "" if math.isnan(r.L_ms) else f" (simulated / L = {r.step_ms / r.L_ms:.3f})"
    con.print(f"step time {r.step_ms:.3f} ms, planner L {L}{gap}")
    if r.on_nonfinite == "off":
        con.print(
            f"(--on-nonfinite off: consecutive steps overlap; one step from a common start "
            f"takes {r.span_ms:.3f} ms)"
        )
    over = [  # each device against its own kind's memory on a mixed cluster
        (d.devices_text, m)
        for d in r.devices
        if d.peak_memory_bytes
        > (m := cluster.usable_memory_of(d.device) + cluster.reserved_memory_bytes)
    ]
    if over:
        gib = " / ".join(f"{m / 2**30:.3g}" for m in sorted({m for _, m in over}))
        con.print(
            f"[yellow]warning: peak memory exceeds the {gib} GiB device memory on device(s) "
            f"{'; '.join(t for t, _ in over)}[/yellow]"
        )
