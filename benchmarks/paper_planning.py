"""Plan the paper's six models on configs A/B/C and compare with its planning-results table.

Run: ``.venv/bin/python benchmarks/paper_planning.py [--output benchmarks/paper_planning.md]``.
Profiles are the analytic V100 ones shipped as ``paper:<name>``; clusters the presets
``paper-a`` (2 x 8, NVLink + 25 Gbps), ``paper-b`` (16 x 1, 25 Gbps), ``paper-c`` (16 x 1,
10 Gbps); global batch sizes as in the paper (section 7.2, table "DAPPLE planning results").
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

from dapple.cluster import PRESETS, Cluster
from dapple.errors import InfeasibleError
from dapple.plan import Plan
from dapple.planner import make_plan, pipeline_latency
from dapple.planner.cost import LatencyBreakdown
from dapple.planner.evaluate import Scorer, divisors
from dapple.profile import ModelProfile
from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, PAPER_MODELS, load_paper_profile

# The paper's table: (output plan, split position, ACR) per model and config.
PAPER: dict[tuple[str, str], tuple[str, str, str]] = {
    ("resnet50", "paper-a"): ("DP", "-", "-"),
    ("resnet50", "paper-b"): ("DP", "-", "-"),
    ("resnet50", "paper-c"): ("DP", "-", "-"),
    ("vgg19", "paper-a"): ("DP", "-", "-"),
    ("vgg19", "paper-b"): ("DP", "-", "-"),
    ("vgg19", "paper-c"): ("15:1", "13:6", "0.40"),
    ("gnmt16", "paper-a"): ("8:8", "9:7", "0.10"),
    ("gnmt16", "paper-b"): ("8:8", "9:7", "0.10"),
    ("gnmt16", "paper-c"): ("Straight", "-", "3.75"),
    ("bert48", "paper-a"): ("8:8", "23:25", "0.06"),
    ("bert48", "paper-b"): ("Straight", "-", "0.50"),
    ("bert48", "paper-c"): ("Straight", "-", "1.25"),
    ("xlnet36", "paper-a"): ("8:8", "18:18", "0.03"),
    ("xlnet36", "paper-b"): ("8:8", "18:18", "0.03"),
    ("xlnet36", "paper-c"): ("Straight", "-", "0.67"),
    ("amoebanet36", "paper-a"): ("8:8", "24:12", "0.18"),
    ("amoebanet36", "paper-b"): ("11:5", "27:9", "0.14"),
    ("amoebanet36", "paper-c"): ("11:5", "27:9", "0.35"),
}
CONFIG = {"paper-a": "2x8 (A)", "paper-b": "16x1 (B)", "paper-c": "16x1 (C)"}


def describe(plan: Plan, num_devices: int) -> tuple[str, str]:
    """Paper notation: DP, Straight or P:Q...; split position as layers per stage."""
    if plan.num_stages == 1:
        return (
            "DP" if plan.stages[0].replicas == num_devices else f"DP on {plan.stages[0].replicas}"
        ), "-"
    sizes = ":".join(str(st.layers[1] - st.layers[0]) for st in plan.stages)
    if all(st.replicas == 1 for st in plan.stages):
        return f"Straight ({plan.num_stages})", sizes
    return plan.replication, sizes


def paper_plan_ms(name: str, cname: str, prof: ModelProfile, c: Cluster, gbs: int) -> str:
    """L of the paper's plan under our cost model (best M), or why it cannot be scored.

    A ``P:Q`` plan with split ``a:b`` cuts our N layers at ``round(a / (a + b) * N)`` (our
    profiles count embedding/head layers the paper's layer counts may not) and places the
    first stage on devices 0..P-1; Straight and DP are our baselines of the same shape.
    """
    plan, split, _ = PAPER[(name, cname)]
    try:
        if plan == "DP":
            return f"{make_plan(prof, c, gbs, 'dp').predicted_step_ms:.0f}"
        if plan == "Straight":
            return f"{make_plan(prof, c, gbs, 'straight').predicted_step_ms:.0f}"
    except InfeasibleError:
        return "does not fit"
    p, q = (int(x) for x in plan.split(":"))
    a, b = (int(x) for x in split.split(":"))
    N = prof.num_layers
    cut = max(1, min(N - 1, round(a / (a + b) * N)))
    sc = Scorer(prof, c, gbs)
    stages = [(0, cut, tuple(range(p))), (cut, N, tuple(range(p, p + q)))]
    scores = [got.L_ms for M in divisors(gbs) if (got := sc.score(stages, M)) is not None]
    return f"{min(scores):.0f}" if scores else "does not fit"


def acr(r: LatencyBreakdown) -> float | None:
    """Average over cuts of (activation + gradient transfer) / (F + B of the stage before)."""
    vals = []
    for i, row in enumerate(r.stages):
        if row.kind == "comm":
            prev = r.stages[i - 1]
            vals.append((row.forward_ms + row.backward_ms) / (prev.forward_ms + prev.backward_ms))
    return sum(vals) / len(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    rows = [
        "| model (GBS) | config | paper plan | our plan | paper split | our split (layers/stage) "
        "| paper ACR | our ACR | M x b | L ms | paper plan's L ms | dp ms | speed-up | plan s |",
        "|---|---|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in PAPER_MODELS:
        prof = load_paper_profile(name)
        gbs = PAPER_GLOBAL_BATCH[name]
        for cname in ("paper-a", "paper-b", "paper-c"):
            c = PRESETS[cname]
            t = time.perf_counter()
            plan = make_plan(prof, c, gbs)
            sec = time.perf_counter() - t
            try:
                dp = f"{make_plan(prof, c, gbs, 'dp').predicted_step_ms:.0f}"
                speed = f"{float(dp) / plan.predicted_step_ms:.2f}x"
            except Exception:
                dp, speed = "does not fit", "-"
            r = pipeline_latency(plan, prof, c)
            ours, split = describe(plan, c.num_devices)
            a = acr(r)
            pp, ps, pa = PAPER[(name, cname)]
            rows.append(
                f"| {name} ({gbs}) | {CONFIG[cname]} | {pp} | {ours} | {ps} | {split} | {pa} | "
                f"{'-' if a is None else f'{a:.2f}'} | {plan.num_micro_batches} x "
                f"{plan.micro_batch_size} | {plan.predicted_step_ms:.0f} | "
                f"{paper_plan_ms(name, cname, prof, c, gbs)} | {dp} | {speed} | {sec:.2f} |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    header = (
        "<!-- generated by: .venv/bin/python benchmarks/paper_planning.py --output "
        f"benchmarks/paper_planning.md on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC -->\n"
    )
    if args.output:
        with open(args.output, "w") as f:
            f.write(header + text)
    print(text)


if __name__ == "__main__":
    main()
