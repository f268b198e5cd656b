"""``dapple demo``: the whole flow on one CPU machine, end to end.

Profile a small built-in transformer, measure this machine's links (``calibrate``), plan it for
4 local processes with DAPPLE beside the baselines, simulate the chosen plan (Gantt, memory and
trace files), train it for real across 4 gloo processes, and print predicted vs measured step
time and the loss curve. Everything is written under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dapple.cli._model_args import add_model_argument

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo", help="profile, plan, simulate and train a small transformer on 4 CPU processes"
    )
    p.add_argument("--out-dir", default="out/demo", help="output directory (default out/demo)")
    p.add_argument("--nproc", type=int, default=4, help="local processes / devices (default 4)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument(
        "--global-batch-size", type=int, default=32, help="samples per step (default 32)"
    )
    add_model_argument(p, default="transformer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple.calibrate.machine import calibrate
    from dapple.models.zoo import load_workload
    from dapple.planner import make_plan
    from dapple.profiler.measure import profile_workload
    from dapple.runtime import train
    from dapple.simulate import simulate
    from dapple.simulate.plots import plot_gantt, plot_memory
    from dapple.simulate.trace import write_trace

    con = Console()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wl = load_workload(args.model)

    con.rule(
        f"1. profile {wl.name} ({wl.num_layers} layers) on cpu, as one of {args.nproc} workers"
    )
    batch_sizes = [1, 2, 4, 8]
    with Progress(console=con, transient=True) as bar:
        task = bar.add_task("profiling", total=wl.num_layers * len(batch_sizes))
        profile = profile_workload(
            wl,
            batch_sizes,
            device="cpu",
            num_threads=1,
            co_workers=args.nproc,  # CPU time while the other workers train: they share cores
            progress=lambda done, total, _label: bar.update(task, completed=done, total=total),
        )
    profile.save(out / "profile.json")
    con.print(
        f"{profile.num_layers} layers, {profile.parameter_bytes / 2**20:.2f} MiB of parameters -> {out / 'profile.json'}"
    )

    con.rule(f"2. calibrate {args.nproc} local gloo processes")
    with con.status("measuring links and compute share..."):
        cal = calibrate(args.nproc, repeats=3, sizes=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22))
    cluster = cal.cluster
    cluster.save(out / "cluster.json")
    con.print(
        f"{cluster.intra_server_bandwidth_gbps:.1f} Gbps, latency {cluster.intra_server_latency_ms:.3f} ms, "
        f"compute slowdown {cluster.compute_slowdown:.2f} -> {out / 'cluster.json'}"
    )

    con.rule(f"3. plan for {cluster.num_devices} devices, global batch {args.global_batch_size}")
    plans = {}
    for name in ("dapple", "dp", "straight", "gpipe", "pipedream"):
        try:
            plans[name] = make_plan(profile, cluster, args.global_batch_size, name)
        except Exception as e:  # a baseline may be infeasible; show why
            con.print(f"[yellow]{name}: {e}[/yellow]")
    t = Table(title="planners under the same cost model")
    for col in (
        "planner",
        "stages",
        "replication",
        "M",
        "schedule",
        "predicted L ms",
        "speed-up vs dp",
    ):
        t.add_column(col, justify="right")
    dp_ms = plans["dp"].predicted_step_ms if "dp" in plans else float("nan")
    for name, p in plans.items():
        t.add_row(
            name,
            str(p.num_stages),
            p.replication,
            str(p.num_micro_batches),
            f"{p.schedule}/{p.policy}",
            f"{p.predicted_step_ms:.2f}",
            f"{dp_ms / p.predicted_step_ms:.2f}x",
        )
    con.print(t)
    plan = plans["dapple"]
    plan.save(out / "plan.json")
    con.print(
        f"chosen: {plan.replication} split at {list(plan.split_positions)}, M={plan.num_micro_batches} -> {out / 'plan.json'}"
    )

    con.rule("4. simulate")
    sim = simulate(plan, profile, cluster)
    other = dataclasses.replace(plan, schedule="gpipe" if plan.schedule == "dapple" else "dapple")
    runs = sorted(
        [(f"{plan.schedule} (chosen)", sim), (other.schedule, simulate(other, profile, cluster))],
        key=lambda r: r[1].schedule != "gpipe",
    )
    plot_gantt(runs, out / "gantt.png")
    plot_memory(runs, out / "memory.png")
    write_trace(sim, out / "trace.json")
    con.print(
        f"simulated step {sim.step_ms:.2f} ms (planner L {sim.L_ms:.2f} ms); "
        f"{out / 'gantt.png'}, {out / 'memory.png'}, {out / 'trace.json'} (open in ui.perfetto.dev)"
    )

    con.rule(f"5. train {args.steps} steps on {len(plan.devices)} processes")
    metrics = train(
        plan,
        args.model,
        steps=args.steps,
        optimizer="adam",
        lr=1e-3,
        echo=True,
        predicted_step_ms=sim.step_ms,
        metrics_path=str(out / "metrics.jsonl"),
    )
    losses = [m.loss for m in metrics]
    measured = statistics.median(m.step_ms for m in metrics[min(3, len(metrics) - 1) :])

    con.rule("6. predicted vs measured")
    t = Table()
    for col in ("", "step ms", "vs measured"):
        t.add_column(col, justify="right")
    t.add_row(
        "planner L (eq. 2)",
        f"{plan.predicted_step_ms:.2f}",
        f"{plan.predicted_step_ms / measured - 1:+.1%}",
    )
    t.add_row("simulator", f"{sim.step_ms:.2f}", f"{sim.step_ms / measured - 1:+.1%}")
    t.add_row("measured (median after 3 warm-up steps)", f"{measured:.2f}", "")
    con.print(t)
    _plot_loss(losses, out / "loss.png")
    con.print("loss: " + " ".join(f"{x:.3f}" for x in losses))
    con.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; curve in {out / 'loss.png'}")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "plan": plan.to_dict(),
                "simulated_step_ms": sim.step_ms,
                "measured_step_ms": measured,
                "losses": losses,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


def _plot_loss(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("dapple demo: training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
