"""L against the simulator on DAPPLE plans whose stages keep fewer micro-batches in flight
than their schedule count (a memory bound D), before and after the counts share a binding D.

Draws straight and replicated pipelines with uneven per-layer times, activations to send and
gradients to all-reduce, bounds one or more stages' in-flight count D, and runs each plan twice
in the discrete-event simulator (:func:`dapple.simulate.simulate`, the lowered schedule action
by action): with the counts as a running minimum of each stage's own count and D (the schedule
before :func:`dapple.schedule.early_backward.warmup_counts` shared a binding D), costed by
Little's law alone (``max(F_s + B_s, RT_s / K_s)``, evaluated here from the plan's arrays), and
with this tree's counts and L (:func:`dapple.cost.pipeline.pipeline_latency`). Pure Python, no
torch; deterministic (seeded).

    python benchmarks/bounded_latency.py --cases 400 --out benchmarks/bounded_latency.md
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from _bench_common import error_spread, load_note, random_server, spearman
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.latency import cycle_paced, latency, steady_periods
from dapple.cost.pipeline import pipeline_latency
from dapple.schedule import lower
from dapple.schedule.early_backward import early_backward_order
from dapple.simulate import simulate

MB = 10**6


def _case(rng: random.Random) -> tuple[Plan, ModelProfile, Cluster]:
    S = rng.randint(2, 8)
    per = rng.randint(1, 3)
    n = S * per
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward=AffineTime(fixed_ms=0.0, per_sample_ms=rng.uniform(0.5, 3.0)),
            backward=AffineTime(fixed_ms=0.0, per_sample_ms=rng.uniform(1.0, 6.0)),
            output_bytes_per_sample=rng.choice([0.0, 0.2, 1.0, 4.0]) * MB,
            parameter_bytes=rng.choice([0, 10**6, 10**7]),
            kept_activation_bytes_per_sample=MB,
        )
        for i in range(n)
    )
    profile = ModelProfile(model_name="rand", layers=layers)
    replicas = [rng.choice([1, 1, 2]) for _ in range(S)]
    cluster = random_server(rng, sum(replicas))
    M = rng.choice([S, 2 * S, 4 * S])
    b = max(replicas)
    plan = straight_plan(
        n,
        list(range(0, n, per)),
        global_batch_size=M * b,
        num_micro_batches=M,
        replicas=replicas,
        schedule="dapple",
        policy=rng.choice(["A", "B"]),
    )
    bounds: list[int | None] = [None] * S
    for s in rng.sample(range(S), rng.randint(1, S)):
        bounds[s] = rng.randint(1, max(1, S - s))
    stages = tuple(
        dataclasses.replace(st, max_in_flight=d) for st, d in zip(plan.stages, bounds, strict=True)
    )
    return dataclasses.replace(plan, stages=stages), profile, cluster


def running_minimum(plan: Plan) -> list[int]:
    """K_i as the schedule made them before the share: ``min(own_i, D_i, K_{i-1})``."""
    S, M = plan.num_stages, plan.num_micro_batches
    ks: list[int] = []
    for i, st in enumerate(plan.stages):
        own = min(S - i if plan.policy == "A" else 2 * (S - i) - 1, M)
        d = st.max_in_flight
        ks.append(min([own, *([d] if d else []), *ks[-1:]]))
    return ks


def _little_l(F: list[float], B: list[float], AR: list[float], ks: list[int], M: int) -> float:
    """L with the steady period ``max(F_s + B_s, RT_s / K_s)`` (Little's law alone)."""
    K: list[int | None] = [x for k in ks for x in (k, None)][:-1]
    period = [F[s] + B[s] for s in range(len(F))]
    rt = 0.0
    for s in range(len(F) - 1, -1, -1):
        rt += F[s] + B[s]
        k = K[s]
        if k:
            period[s] = max(period[s], rt / k)
    return latency(F, B, AR, M, period).L_ms


class Case(NamedTuple):
    """One plan, before (running-minimum counts, Little's law) and after (this tree)."""

    bounded: bool  # policy A with some K_i below S - i after the share
    sim_before: float
    L_before: float
    sim_after: float
    L_after: float


def measure(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Case:
    """Simulated step and L of ``plan`` under both count rules (:class:`Case`)."""
    M = plan.num_micro_batches
    r = pipeline_latency(plan, profile, cluster)
    F = [x.forward_ms for x in r.stages]
    B = [x.backward_ms for x in r.stages]
    AR = [x.allreduce_ms + x.host_step_ms for x in r.stages]  # host step included
    old = running_minimum(plan)
    sim_before = simulate(plan, profile, cluster, lower(plan, early_backward_order(old, M))).step_ms
    ks = [x.in_flight for x in r.stages if x.kind == "compute"]
    K: list[int | None] = [x for k in ks for x in (k, None)][:-1]
    period = steady_periods(F, B, K, M)
    assert latency(F, B, AR, M, period, cycle_paced(F, B, K, M, period), K).L_ms == r.L_ms
    natural = [min(plan.num_stages - i, M) for i in range(plan.num_stages)]
    return Case(
        bounded=plan.policy == "A" and ks != natural,
        sim_before=sim_before,
        L_before=_little_l(F, B, AR, old, M),
        sim_after=simulate(plan, profile, cluster).step_ms,
        L_after=r.L_ms,
    )


def _row(name: str, errs: list[float], pred: list[float], sim: list[float]) -> str:
    spread, within = error_spread(errs)
    return (
        f"| {name} | {100 * statistics.median(errs):+.1f}% "
        f"| {100 * statistics.median(abs(e) for e in errs):.1f}% "
        f"| {spread} | {within} of {len(errs)} | {spearman(pred, sim):.3f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cases = [measure(*_case(rng)) for _ in range(args.cases)]
    lines = [
        "# L against the simulator when stages keep fewer micro-batches in flight than K_i",
        "",
        f"- command: `python benchmarks/bounded_latency.py --cases {args.cases} --seed {args.seed}"
        + (f" --out {args.out}`" if args.out else "`"),
        f"- {load_note()}; pure Python (no torch, no timing): the numbers do not depend on the load",
        f"- {args.cases} random DAPPLE plans (2-8 stages of 1-3 uneven layers, 1 or 2 replicas, "
        "activations of 0-4 MB per sample to send, 0-10 MB of gradients, M in {S, 2S, 4S}, "
        "policy A or B), each with 1..S stages bounded to D in [1, S - s] micro-batches in flight",
        "- before: the counts K_i as a running minimum of each stage's own count and D, L paced "
        "by Little's law (max(F_s + B_s, RT_s / K_s)); after: the counts share a binding D "
        "(`warmup_counts`), L paced by every cycle of the early-backward order "
        "(`steady_periods`). Each L against the simulator running its own counts.",
        "- error = (L - simulated) / simulated",
        "",
        "| plans | L | median error | median abs. error | 90th pct abs. error | min / max error "
        "| within 10% | Spearman vs simulated |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, group in (
        ("all", cases),
        ("policy A, some K_i below S - i", [c for c in cases if c.bounded]),
    ):
        for label, pred, sim in (
            ("before", [c.L_before for c in group], [c.sim_before for c in group]),
            ("after", [c.L_after for c in group], [c.sim_after for c in group]),
        ):
            errs = [(p - x) / x for p, x in zip(pred, sim, strict=True)]
            lines.append(f"| {name} " + _row(label, errs, pred, sim))
    speed = [c.sim_before / c.sim_after for c in cases]
    changed = [x for x in speed if x != 1.0]
    lines += [
        "",
        "Simulated step, before over after (above 1: the shared counts run faster): "
        f"geometric mean {statistics.geometric_mean(speed):.3f} over all {len(speed)} plans; "
        f"{len(changed)} plans changed, geometric mean {statistics.geometric_mean(changed):.3f}, "
        f"min {min(changed):.3f}, max {max(changed):.3f}."
        if changed
        else "Simulated step: no plan changed.",
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
