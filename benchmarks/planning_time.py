"""Planning time of the DAPPLE search: BERT-48 on 2 x 8 V100, a layers x devices sweep and
tensor widths on 512 H100s (:mod:`planning_time_tp`).

Run: ``.venv/bin/python benchmarks/planning_time.py [--quick] [--output benchmarks/planning_time.md]``.
The sweep model repeats BERT-48's analytic encoder layer (``paper:bert48``) to N layers; the
cluster is ``paper-a`` (8 V100 per server) with S servers. Times are wall-clock seconds of
``dapple_search`` in this (single-threaded) process, best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from datetime import datetime, timezone

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.profile import ModelProfile
from dapple.errors import InfeasibleError
from dapple.planner.search import dapple_search
from dapple.profiler.paper_models import load_paper_profile
from planning_time_tp import table as tensor_width_table

TENSOR_WIDTHS_INTRO = [
    "## Tensor widths: 80 shardable blocks on 512 H100s (`h100-8x`, 64 servers of 8), "
    "global batch 1024",
    "",
    "From `benchmarks/planning_time_tp.py` (one run each; its docstring describes the profiles). "
    "`{1}`: no tensor parallelism; `uniform`: one DAPPLE search per width t with every stage of "
    "width t (`dapple_search(..., stage_widths=False)`), each search pruned by its own incumbent "
    "only (until 2026-12-01 also by the best L of the narrower widths); `per stage`: each "
    "width's plan then refined stage by stage to its own width t_i, re-split of a stage's devices, cut moves and merges (`dapple.planner.stage_widths`), "
    "the default; `interleaved`: also interleaved 1F1B, the search's plans and the grid's "
    "interleaved points (`dapple_search(..., interleaved=True)`, `dapple.planner.interleaving`); "
    "`ZeRO-3`: `zero_stage=3` (the grid's FSDP points join). CPU s: this process's CPU time "
    "(the seconds column is wall-clock, inflated by other jobs on the 2 cores).",
]
"""The heading and notes of the tensor-width rows (:func:`planning_time_tp.table`)."""


def repeated_bert(n: int) -> ModelProfile:
    """BERT-48's embedding and head around ``n - 2`` copies of its encoder layer."""
    b = load_paper_profile("bert48")
    enc = b.layers[1:-1]
    body = tuple(dataclasses.replace(enc[i % len(enc)], name=f"enc{i}") for i in range(n - 2))
    return dataclasses.replace(b, layers=(b.layers[0], *body, b.layers[-1]), model_name=f"bert-{n}")


def timed(profile: ModelProfile, cluster: Cluster, gbs: int, repeat: int) -> tuple[float, str]:
    best = float("inf")
    desc = ""
    for _ in range(repeat):
        t = time.perf_counter()
        plan = dapple_search(profile, cluster, gbs)
        best = min(best, time.perf_counter() - t)
        desc = f"{plan.replication if plan.num_stages <= 8 else f'{plan.num_stages} stages'}, M={plan.num_micro_batches}"
    return best, desc


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, Python {platform.python_version()}"


def _plot(curve: dict[int, list[tuple[int, float]]], path: str) -> None:
    """Log-log planning time vs devices, one line per layer count, with both goals marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, pts in sorted(curve.items()):
        ax.plot([g for g, _ in pts], [t for _, t in pts], marker="o", label=f"N = {n} layers")
    ax.axhline(0.5, color="tab:green", ls="--", lw=1)
    ax.axhline(10.0, color="tab:red", ls="--", lw=1)
    ax.annotate(
        "goal: BERT-48 on 2x8 < 0.5 s",
        (8, 0.5),
        textcoords="offset points",
        xytext=(0, 4),
        color="tab:green",
        fontsize=8,
    )
    ax.annotate(
        "goal: 400 layers on 64x8 < 10 s",
        (8, 10.0),
        textcoords="offset points",
        xytext=(0, 4),
        color="tab:red",
        fontsize=8,
    )
    for g, t in curve.get(400, []):
        if g == 512:
            ax.scatter([g], [t], s=120, facecolors="none", edgecolors="tab:red", zorder=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices G (servers of 8)")
    ax.set_ylabel("planning time, s (one core)")
    ax.set_title("DAPPLE planner scaling")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sweep")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--output", default=None, help="write the markdown report here")
    ap.add_argument("--plot", default=None, help="write the log-log scaling plot (PNG) here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    lines = [
        "# DAPPLE planning time",
        "",
        f"- command: `.venv/bin/python benchmarks/planning_time.py{' --quick' if args.quick else ''}"
        f" --repeat {args.repeat}{' --plot ' + args.plot if args.plot else ''}`",
        f"- machine: {machine()}; process pinned to CPUs {sorted(os.sched_getaffinity(0))} "
        "(run under `taskset -c 0` for one core)",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- load average before (1/5/15 min): {load_before[0]:.2f} {load_before[1]:.2f} "
        f"{load_before[2]:.2f} (2 cores shared with other jobs: times are upper bounds)",
        "",
        "## BERT-48 (`paper:bert48`, 50 layers) on `paper-a` (2 servers x 8 V100)",
        "",
        "| global batch | plan | seconds (best of runs) |",
        "|---:|---|---:|",
    ]
    bert = load_paper_profile("bert48")
    for gbs in (64, 128):
        s, desc = timed(bert, PRESETS["paper-a"], gbs, args.repeat)
        lines.append(f"| {gbs} | {desc} | {s:.3f} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "## Scaling: N layers x G devices (`paper-a` servers of 8), global batch 1024",
        "",
        "| layers N | servers | devices G | N x G | plan | seconds |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    ns = (50, 100, 400) if args.quick else (50, 100, 200, 400, 1000)
    servers = (2, 8, 64) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    curve: dict[int, list[tuple[int, float]]] = {}
    for n in ns:
        prof = repeated_bert(n)
        for s in servers:
            c = PRESETS["paper-a"].with_servers(s)
            try:
                sec, desc = timed(prof, c, 1024, 1 if n * c.num_devices > 20000 else args.repeat)
            except InfeasibleError:
                lines.append(
                    f"| {n} | {s} | {c.num_devices} | {n * c.num_devices} | "
                    "does not fit in memory (infeasible, reported as such) | - |"
                )
                print(lines[-1], flush=True)
                continue
            lines.append(
                f"| {n} | {s} | {c.num_devices} | {n * c.num_devices} | {desc} | {sec:.3f} |"
            )
            curve.setdefault(n, []).append((c.num_devices, sec))
            print(lines[-1], flush=True)
    if args.plot:
        _plot(curve, args.plot)
        lines += ["", f"![planning time, log-log]({os.path.basename(args.plot)})"]
    lines += ["", *TENSOR_WIDTHS_INTRO, "", *tensor_width_table()]
    load_after = os.getloadavg()
    lines += [
        "",
        f"Load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}.",
        "",
        "The plans are deterministic; the seconds depend on the machine and on its load during "
        "the run, so compare times only between runs on one machine.",
        "",
        "How the search stays fast (see `dapple.planner.search`): states keyed by per-server "
        "occupancy up to a permutation of servers; beyond 32 devices replica counts 1..8 and "
        "whole servers (up to 128 devices) or powers of two and 3 x powers of two (beyond); the DP cuts only at <= 64 equal-time cut points, then the "
        "best plan's cuts are refined one layer at a time; a beam of 4 states per cut point; "
        "new cuts within 2 cut points of the two-stage balance point; the DP runs for the 3 "
        "most promising M (ranked by regular candidates), and the final M is re-picked among "
        "all divisors; the lower bound L >= M (F_s + B_s) prunes stages. Small instances "
        "(N x G <= 128) run the full DP over every M without beam or window.",
    ]
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
