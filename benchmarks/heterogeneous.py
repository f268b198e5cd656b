"""Analytic comparison on mixed H100 + A100 clusters (issue #43): dapple's plan with device kinds
against the plan that treats every device as the slowest kind, the same plan split evenly, and
the best plan on each homogeneous subset.

Run: ``.venv/bin/python benchmarks/heterogeneous.py [--quick] [--output benchmarks/heterogeneous.md]``.
Profiles are analytic (``dapple profile --analytic``) on the H100; the A100's speed is the
ratio of the two analytic profiles' F + B over all layers at 1 sample (the datasheets' peaks
and each device's fitted or prior efficiencies), and its memory its own. Every plan is priced by
the cost model on the mixed cluster as given (:func:`dapple.cost.schedule_step.schedule_latency`);
no GPU runs here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import PRESETS, load_cluster
from dapple.core.device_kinds import DATASHEET_TFLOPS, DeviceKind
from dapple.core.kind_profiles import with_kind_profiles
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedule_step import schedule_latency
from dapple.errors import InfeasibleError
from dapple.planner import make_plan
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.paper_models import load_paper_profile

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixed.json"

CASES = [  # model, H100 servers, A100 servers, A100 memory GiB, global batch (sequences)
    ("llama3-8b", 1, 1, 40, 64),
    ("llama3-8b", 1, 3, 80, 128),
    ("llama3-70b", 2, 2, 80, 128),
]
QUICK = CASES[:1]

NOTES = """Columns: *step ms* is the cost model's step time of the plan on the mixed cluster as it is
(its replicas at their own kinds' speeds); *vs dapple* that over dapple's plan with device kinds;
*fits* whether every replica's share fits its own kind's memory. Plans: **dapple, device kinds**
(`dapple plan --cluster` a file with `kinds`: the search prices a stage spanning kinds at its
slowest replica on balanced shares, each kind's memory its own); **slowest kind**: the plan made
for the cluster with every device as slow and as small as the slowest kind (what planning without
kinds gives), priced on the real cluster; **even split**: dapple's plan with its shares replaced by
the even split; **X only**: the best plan on one kind's servers alone. Zero stage `auto` in every
search."""


def speed_ratio(model: str) -> float:
    """F + B of every layer at 1 sample on the H100 over that on the A100."""
    h, a = (analytic_profile(model, d) for d in ("h100", "a100"))

    def total(p: ModelProfile) -> float:
        return float(sum(x.forward.at(1) + x.backward.at(1) for x in p.layers))

    return total(h) / total(a)


def mixed(h_servers: int, a_servers: int, a_gib: int, a_speed: float) -> Cluster:
    """H100 servers then A100 servers of 8 devices, NVLink 3's 300 GB/s, 400 Gbps between."""
    base = PRESETS["h100-8x"]
    kinds = (
        DeviceKind(name="H100", servers=h_servers, speed=1.0, device_memory_bytes=80 * GIB),
        DeviceKind(
            name=f"A100-{a_gib}GB", servers=a_servers, speed=a_speed,
            device_memory_bytes=a_gib * GIB,
        ),
    )  # fmt: skip
    return dataclasses.replace(
        base,
        name=f"{h_servers}x8 H100 + {a_servers}x8 A100-{a_gib}GB",
        servers=h_servers + a_servers,
        device_memory_bytes=min(80, a_gib) * GIB,
        intra_server_bandwidth_gbps=300 * 8,
        device_name="H100+A100",
        kinds=kinds,
    )


def subset(c: Cluster, kind: int) -> Cluster:
    """The servers of one kind alone, as a cluster without kinds."""
    k = c.kinds[kind]
    return dataclasses.replace(
        c,
        name=k.name,
        servers=k.servers,
        device_memory_bytes=k.device_memory_bytes,
        compute_slowdown=c.compute_slowdown / k.speed,
        kinds=(),
    )


def even(plan: Plan) -> Plan:
    return dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, shares=None) for s in plan.stages)
    )


def timed_plan(profile: ModelProfile, c: Cluster, gbs: int) -> tuple[Plan | None, float]:
    """dapple's plan under ``--zero-stage auto`` (None where none fits) and its CPU seconds."""
    t = time.process_time()
    try:
        p: Plan | None = make_plan(profile, c, gbs, zero_stage="auto")
    except InfeasibleError:
        p = None
    return p, time.process_time() - t


def describe(plan: Plan) -> str:
    parts = []
    for st in plan.stages:
        lo, hi = st.layers
        sh = (
            f" shares {':'.join(map(str, sorted(set(st.shares), reverse=True)))}"
            if st.shares
            else ""
        )
        t = f"x{st.tensor_width}" if st.tensor_width > 1 else ""
        parts.append(f"[{lo},{hi}) r{st.replicas}{t}{sh}")
    z = max(s.zero_stage for s in plan.stages)
    return f"{'; '.join(parts)}; M={plan.num_micro_batches}" + (f", ZeRO-{z}" if z else "")


def case_rows(model: str, hs: int, as_: int, gib: int, gbs: int) -> list[str]:
    speed = speed_ratio(model)
    c = mixed(hs, as_, gib, speed)
    profile = analytic_profile(model, "h100")
    title = f"{model}, {c.name}, global batch {gbs} sequences of {profile.seq_len} tokens"
    note = (
        f"A100 speed {speed:.3f} of the H100 (analytic profiles; datasheet peak ratio "
        f"{DATASHEET_TFLOPS['a100'] / DATASHEET_TFLOPS['h100']:.3f})."
    )
    rows, plans = compare(profile, c, gbs, title, note)
    return rows + per_kind_rows(model, profile, c, gbs, plans)


PER_KIND_NOTE = """Per-kind profiles: each kind computes at its own analytic profile
(`--profile H100=h.json --profile A100=a.json`, `dapple.core.kind_profiles`), layer by layer,
instead of the H100 profile scaled by one speed. Every plan above is priced again that way
(*step ms, per-kind*); **dapple, per-kind profiles** is the plan searched with them, **slowest
kind, per-kind profiles** the plan searched on the same cluster's slowest-kind view (every device
at each layer's slower kind's own times and the smaller memory, `Cluster.slowest_kind`)."""


def per_kind_rows(
    model: str, profile: ModelProfile, c: Cluster, gbs: int, plans: dict[str, Plan]
) -> list[str]:
    """The plans of one case priced with each kind's own analytic profile, beside the plan
    searched with them (:data:`PER_KIND_NOTE`)."""
    a = analytic_profile(model, "a100")
    own = with_kind_profiles(c, {c.kinds[0].name: profile, c.kinds[1].name: a})

    def per_layer(p: ModelProfile) -> list[float]:
        return [x.forward.at(1) + x.backward.at(1) for x in p.layers]

    ratios = [y / x for x, y in zip(per_layer(profile), per_layer(a), strict=True) if x > 0]
    rows = [
        PER_KIND_NOTE,
        "",
        f"A100 over H100 time per layer at 1 sample: {min(ratios):.2f}x to {max(ratios):.2f}x "
        f"(one speed: {1 / c.kinds[1].speed:.2f}x).",
        "",
        "| plan | step ms (speed-scaled) | step ms, per-kind | vs per-kind plan | stages | "
        "planning s |",
        "|---|---|---|---|---|---|",
    ]

    best, secs = timed_plan(profile, own, gbs)
    base = schedule_latency(best, profile, own) if best is not None else float("nan")
    entries = [("dapple, per-kind profiles", best, secs)]
    entries += [(n, plans[n], 0.0) for n in ("dapple, device kinds", "slowest kind") if n in plans]
    entries.append(
        ("slowest kind, per-kind profiles", *timed_plan(profile, own.slowest_kind(), gbs))
    )
    for name, plan, s in entries:
        if plan is None:
            rows.append(f"| {name} | - | infeasible | - | - | {s:.1f} |")
            continue
        scaled, truth = schedule_latency(plan, profile, c), schedule_latency(plan, profile, own)
        rows.append(
            f"| {name} | {scaled:,.0f} | {truth:,.0f} | {truth / base:.2f}x | {describe(plan)} "
            f"| {s:.1f} |"
        )
    rows.append("")
    return rows


def example_rows(gbs: int = 64) -> list[str]:
    """BERT-48 (the paper's profile) on ``examples/mixed.json``, at its datasheet speeds."""
    c = load_cluster(str(EXAMPLE))
    title = f"BERT-48 (paper profile), examples/mixed.json ({c.device_name}), global batch {gbs}"
    note = (
        f"Speeds from the file's datasheets: A100 {c.kinds[1].speed:.3f} of the H100. The "
        "profile is the paper's (V100) taken as the H100's: only the ratios between rows count."
    )
    return compare(load_paper_profile("bert48"), c, gbs, title, note)[0]


def compare(
    profile: ModelProfile, c: Cluster, gbs: int, title: str, note: str
) -> tuple[list[str], dict[str, Plan]]:
    """The rows of one cluster and model (module docstring), and the plans on all devices by
    row name."""
    rows = [
        f"### {title}",
        "",
        note,
        "",
        "| plan | on | step ms (mixed cluster) | vs dapple | fits | stages | planning s |",
        "|---|---|---|---|---|---|---|",
    ]
    got: dict[str, float] = {}
    plans: dict[str, Plan] = {}

    def add(name: str, on: str, plan: Plan | None, priced_on: Cluster, secs: float) -> None:
        if plan is None:
            rows.append(f"| {name} | {on} | infeasible | - | - | - | {secs:.1f} |")
            return
        ms = schedule_latency(plan, profile, priced_on)
        fits = pipeline_latency(plan, profile, priced_on).fits_memory if plan.schedule in (
            "dapple", "gpipe") else "-"  # fmt: skip
        got[name] = ms
        if on == "all":
            plans[name] = plan
        ratio = ms / got["dapple, device kinds"] if "dapple, device kinds" in got else 1.0
        rows.append(
            f"| {name} | {on} | {ms:,.0f} | {ratio:.2f}x | {fits} | {describe(plan)} | {secs:.1f} |"
        )

    aware, secs = timed_plan(profile, c, gbs)
    add("dapple, device kinds", "all", aware, c, secs)
    slow, secs = timed_plan(profile, c.slowest_kind(), gbs)
    add("slowest kind", "all", slow, c, secs)
    if aware is not None and any(s.shares for s in aware.stages):
        add("dapple's plan, even split", "all", even(aware), c, 0.0)
    for i, k in enumerate(c.kinds):
        sub = subset(c, i)
        p, secs = timed_plan(profile, sub, gbs)
        add(f"{k.name} only", f"{k.servers * 8} {k.name}", p, sub, secs)
    rows.append("")
    return rows, plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the first case only")
    ap.add_argument("--output", help="write the markdown here too")
    args = ap.parse_args()
    cmd = "python benchmarks/heterogeneous.py" + (" --quick" if args.quick else "")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    one, five, fifteen = os.getloadavg()
    lines = [
        "# Mixed H100 + A100 clusters, analytic (issue #43)",
        "",
        f"- command: `{cmd}{' --output ' + args.output if args.output else ''}`",
        f"- machine: {platform.node()} ({os.cpu_count()} cores), Python {sys.version.split()[0]};"
        f" commit {commit}",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; load average "
        f"{one:.1f} {five:.1f} {fifteen:.1f} (planning seconds are CPU seconds of this process)",
        "",
        NOTES,
        "",
    ]
    lines += example_rows()
    for case in QUICK if args.quick else CASES:
        lines += case_rows(*case)
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
