"""``dapple simulate``: run a plan's schedule through the discrete-event simulator."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from rich.table import Table

from dapple.cli._console import console, print_table
from dapple.cli._run_args import add_virtual_stages_argument
from dapple.core.cluster import describe_presets
from dapple.core.plan import Plan
from dapple.schedule.registry import check_virtual_stages, get_schedule, schedule_names

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="simulate one training step of a plan; Gantt chart, Chrome trace, memory plot",
    )
    p.add_argument("--plan", required=True, help="plan JSON (from `dapple plan`)")
    p.add_argument(
        "--profile", required=True, help="model profile JSON, or a paper profile: paper:bert48"
    )
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
        "--compare",
        action="store_true",
        help="also simulate the other schedule (GPipe vs DAPPLE; DAPPLE beside interleaved or "
        "zbh1) and stack both in the pictures",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple.core.cluster import load_cluster
    from dapple.profiler.paper_models import load_profile
    from dapple.simulate import simulate
    from dapple.simulate.schedules import baseline_first, compared_plan, with_schedule

    _check_outputs(args)
    plan = Plan.load(args.plan)
    profile = load_profile(args.profile)
    plan.check_fingerprint(profile.model_fingerprint, f"--profile {args.profile!r}")
    doubt = plan.profile_doubt(profile.model_name, profile.model_fingerprint)
    if doubt is not None:
        print(f"dapple: warning: --profile {args.profile!r}: {doubt}", file=sys.stderr)
    cluster = load_cluster(args.cluster, args.servers)
    if args.policy:
        plan = dataclasses.replace(plan, policy=args.policy)
    check_virtual_stages(args.virtual_stages, args.schedule, cli=True)
    if args.schedule:
        plan = with_schedule(plan, args.schedule, args.virtual_stages)
    runs = [(_title(plan), simulate(plan, profile, cluster))]
    if args.compare:
        other = compared_plan(plan)
        runs = baseline_first([*runs, (_title(other), simulate(other, profile, cluster))])

    con = console()
    for title, r in runs:
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
        over_mem = [
            d.devices_text for d in r.devices if d.peak_memory_bytes > cluster.device_memory_bytes
        ]
        if over_mem:
            con.print(
                f"[yellow]warning: peak memory exceeds the {cluster.device_memory_bytes / 2**30:.1f} GiB "
                f"device memory on device(s) {'; '.join(over_mem)}[/yellow]"
            )
    if args.gantt or args.memory:
        from dapple.simulate.plots import plot_gantt, plot_memory

        if args.gantt:
            plot_gantt(runs, args.gantt)
            con.print(f"wrote {args.gantt}")
        if args.memory:
            plot_memory(runs, args.memory)
            con.print(f"wrote {args.memory}")
    if args.layout:
        from dapple.simulate.layout import plot_layout

        plot_layout(plan, cluster, args.layout)
        con.print(f"wrote {args.layout}")
    if args.trace:
        from dapple.simulate.trace import write_trace

        write_trace(runs[0][1], args.trace)
        con.print(f"wrote {args.trace}")
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file asked for can be written, and each picture has a known format, before any
    simulation.

    Raises:
        ValidationError: naming the option and the path.
    """
    from dapple.core.output_path import check_output_file, check_picture_file

    for opt in ("gantt", "memory", "layout", "trace"):
        path = getattr(args, opt)
        if path is not None:
            check = check_output_file if opt == "trace" else check_picture_file
            check(path, f"--{opt} file")


def _title(plan: Plan) -> str:
    name = get_schedule(plan.schedule).title_of(plan)
    return f"{name}, {plan.replication}, M={plan.num_micro_batches}"
