"""L's error against the simulator on random plans over devices that share compute cores
(CPU workers: :attr:`~dapple.core.cluster.Cluster.compute_cores_per_server`), where the
simulator runs processor sharing event by event and L stretches F_s, B_s analytically
(:func:`dapple.cost.sharing.shared_compute_scale`).

Prints one table row per group for the tree on ``PYTHONPATH`` (run it under two trees to
compare them) and, with ``--worst N``, the N plans with the largest absolute error. Pure
Python, no torch timing; deterministic (seeded).

    PYTHONPATH=<tree>/src python benchmarks/shared_compute.py --cases 300 --seed 0 --worst 5
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from _bench_common import error_row
from bounded_latency import _case
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.simulate import simulate


def shared_case(rng: random.Random) -> tuple[Plan, ModelProfile, Cluster]:
    """A random DAPPLE or GPipe plan of ``bounded_latency``'s kind on one server whose devices
    share c compute units (fewer than the devices) under a background load E, with or without
    the runtime's host CPU terms."""
    plan, profile, cluster = _case(rng)
    n = cluster.devices_per_server
    c = rng.choice([0.5, 0.75]) * n if n > 1 else 1.0
    host = rng.random() < 0.5
    cluster = dataclasses.replace(
        cluster,
        compute_cores_per_server=max(1.0, round(c, 2)),
        background_load_per_server=rng.choice([0.0, 0.0, 0.5, 2.0]),
        action_overhead_ms=0.05 if host else 0.0,
        step_overhead_ms=4.0 if host else 0.0,
        comm_cpu_ms_per_mb=0.19 if host else 0.0,
    )
    if rng.random() < 0.3:
        plan = dataclasses.replace(plan, schedule="gpipe")
    return plan, profile, cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worst", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.cases):
        plan, profile, cluster = shared_case(rng)
        L = pipeline_latency(plan, profile, cluster).L_ms
        sim = simulate(plan, profile, cluster).step_ms
        uneven = len({st.replicas for st in plan.stages}) > 1
        rows.append((i, plan.schedule, uneven, L, sim, (L - sim) / sim))
    print("| plans | n | median abs. error | 90th pct abs. error | min / max error "
          "| within 10% | below -5% |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(error_row("all", [r[5] for r in rows]))
    for sched in ("dapple", "gpipe"):
        print(error_row(sched, [r[5] for r in rows if r[1] == sched]))
    print(error_row("uneven replication", [r[5] for r in rows if r[2]]))
    print(error_row("even replication", [r[5] for r in rows if not r[2]]))
    for i, sched, _, L, sim, err in sorted(rows, key=lambda r: -abs(r[5]))[: args.worst]:
        print(f"- case {i}: {sched}: L {L:.1f}, simulated {sim:.1f} ({100 * err:+.1f}%)")


if __name__ == "__main__":
    main()
