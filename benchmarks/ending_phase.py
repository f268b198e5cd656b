"""L's error against the simulator on bounded_latency.py's random DAPPLE plans, per policy:
the numbers behind the ending phase's drain and backward-phase terms
(:func:`dapple.cost.latency.latency`, :func:`dapple.cost.latency.backward_phases`).

Prints one table row per group for the tree on ``PYTHONPATH`` (run it under two trees to
compare them) and, with ``--worst N``, the N plans L under-estimates most. Pure Python, no
torch timing; deterministic (seeded).

    PYTHONPATH=<tree>/src python benchmarks/ending_phase.py --cases 400 --seed 0 --worst 5
"""

from __future__ import annotations

import argparse
import random

from _bench_common import error_row
from bounded_latency import _case
from dapple.cost.pipeline import pipeline_latency
from dapple.simulate import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worst", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.cases):
        plan, profile, cluster = _case(rng)
        L = pipeline_latency(plan, profile, cluster).L_ms
        sim = simulate(plan, profile, cluster).step_ms
        rows.append((i, plan.policy, plan.num_micro_batches, L, sim, (L - sim) / sim))
    print("| plans | n | median abs. error | 90th pct abs. error | min / max error "
          "| within 10% | below -5% |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(error_row("all", [r[5] for r in rows]))
    for policy in ("A", "B"):
        print(error_row(f"policy {policy}", [r[5] for r in rows if r[1] == policy]))
    for i, policy, M, L, sim, err in sorted(rows, key=lambda r: r[5])[: args.worst]:
        print(
            f"- case {i}: policy {policy}, M = {M}: L {L:.1f}, simulated {sim:.1f} ({100 * err:+.1f}%)"
        )


if __name__ == "__main__":
    main()
