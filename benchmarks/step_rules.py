"""The cost model's step time of interleaved 1F1B, ZB-H1, ZB-V and DualPipeV against the simulator.

Draws random plans per schedule: P = 2-8 device groups, uneven per-layer times (or equal ones),
activations of 0-4 MB per sample on links of 8 or 80 GB/s, M in {P, 2P, 4P}, and one replica
per stage (straight) or 1-3 replicas per group (split-concat). Each is priced by
:func:`dapple.cost.schedules.schedule_latency` and run by :func:`dapple.simulate.simulate`.
Pure Python, deterministic (seeded); run it under two checkouts (``PYTHONPATH=.../src``) to
compare step rules, since it reads only ``schedule_latency``.

    python benchmarks/step_rules.py --cases 100 --out benchmarks/step_rules.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
from pathlib import Path

import dapple
from _bench_common import error_spread, load_note, random_server, write_report
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost import schedule_latency
from dapple.errors import ValidationError
from dapple.schedule.registry import get_schedule
from dapple.simulate import simulate

MB = 10**6
SCHEDULES = ("interleaved", "zbh1", "zbv", "dualpipev")


def _case(
    rng: random.Random, name: str, equal: bool, replicated: bool
) -> tuple[Plan, ModelProfile, Cluster]:
    P = rng.randint(2, 8)
    v = {"interleaved": rng.choice([2, 4]), "zbh1": 1}.get(name, 2)
    n = P * v * rng.choice([1, 2])
    f0, b0 = rng.uniform(0.5, 3.0), rng.uniform(1.0, 6.0)
    out = rng.choice([0.0, 0.2, 1.0, 4.0]) * MB
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward=AffineTime(fixed_ms=0.0, per_sample_ms=f0 if equal else rng.uniform(0.5, 3.0)),
            backward=AffineTime(fixed_ms=0.0, per_sample_ms=b0 if equal else rng.uniform(1.0, 6.0)),
            output_bytes_per_sample=out,
            parameter_bytes=rng.choice([0, 10**6, 10**7]),
            kept_activation_bytes_per_sample=MB,
        )
        for i in range(n)
    )
    reps = [rng.choice([1, 1, 2, 3]) if replicated else 1 for _ in range(P)]
    cluster = random_server(rng, sum(reps))
    M = rng.choice([P, 2 * P, 4 * P]) * (2 if name == "dualpipev" else 1)
    b = 6 if replicated else 1
    plan = straight_plan(
        n,
        list(range(0, n, n // P)),
        global_batch_size=M * b,
        num_micro_batches=M,
        replicas=reps,
        schedule=name,
    )
    if v > 1:
        plan = (get_schedule(name).cut or interleave)(plan, v)
    return plan, ModelProfile(model_name="rand", layers=layers), cluster


def _row(label: str, errs: list[float]) -> str:
    spread, within = error_spread(errs)
    return (
        f"| {label} | {len(errs)} | {100 * statistics.median(errs):+.1f}% | {spread} | {within} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--cases", type=int, default=100, help="plans per schedule and kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(dapple.__file__).parent,
    ).stdout.strip()
    lines = [
        "# Step time of the chunked and split-backward schedules: cost model against simulator",
        "",
        f"- command: `python benchmarks/step_rules.py --cases {args.cases} --seed {args.seed}`"
        f" with the dapple of {rev}",
        f"- {load_note()}; pure Python (no torch, no timing): the numbers do not depend on the load",
        "- error = (schedule_latency - simulated step) / simulated step, per plan",
        "",
        "| schedule, plans | plans | median error | 90th pct abs. error | min / max error "
        "| within 10% |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in SCHEDULES:
        for replicated in (False, True):
            for equal in (True, False):
                rng = random.Random(f"{args.seed}-{name}-{replicated}-{equal}")
                errs = []
                for _ in range(args.cases):
                    try:
                        plan, profile, cluster = _case(rng, name, equal, replicated)
                        sim = simulate(plan, profile, cluster).step_ms
                    except ValidationError:
                        continue  # a draw the schedule refuses (e.g. too few layers per group)
                    errs.append((schedule_latency(plan, profile, cluster) - sim) / sim)
                kind = ("replicated" if replicated else "straight") + (
                    ", equal stages" if equal else ", uneven stages"
                )
                lines.append(_row(f"{name}, {kind}", errs))
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
