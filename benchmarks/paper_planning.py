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

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import LatencyBreakdown, pipeline_latency
from dapple.errors import InfeasibleError
from dapple.planner import make_plan
from dapple.planner.batches import divisors
from dapple.planner.scorer import Scorer
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
NOTES = """
## Reading the table

- *paper plan / split / ACR*: the paper's planning-results table (section 7.2). The paper
  writes the split position as layers per stage (`23:25` = 23 layers, then 25).
- *our plan*: `DP` (one stage on all 16 devices), `Straight (S)` (S stages, no replication) or
  the replica counts per stage; *our split*: layers per stage of our profile. Our analytic
  profiles count embedding/stem and head layers as layers of their own (BERT-48 has 50
  layers, GNMT-16 18, XLNet-36 38, AmoebaNet-36 42), so layer counts are off by one or two.
- *our ACR*: mean over cuts of (activation transfer + gradient transfer) / (F + B of the
  stage before the cut), from our comm-stage model.
- *L ms*: our pipeline latency (equations 1-2) of our plan; *paper plan's L ms*: the
  paper's plan scored by the same cost model (its split mapped proportionally onto our
  layers, best M); *dp ms*: pure data parallelism (gradient accumulation) under the same
  model; *speed-up* = dp / L; *plan s*: planning time (DAPPLE search, includes the process
  being shared with other jobs on 2 cores).

## Where we differ from the paper, and why

In every row our plan's L is at most the paper plan's L under our cost model, so each
difference comes from the cost model and profiles, not from the search missing the paper's
plan:

1. **No overlap of gradient AllReduce with backward computation.** The paper's DP (and the
   AllReduce of replicated stages) overlaps gradient synchronisation with the backward pass
   (the paper credits this for DP winning VGG-19 on configs A and B). Equation 1 as we
   implement it adds AR(P_s, g_s) after the stage's last backward. Replication across the
   25/10 Gbps networks is therefore more expensive for us, which explains VGG-19 on B
   (we put the last 3 layers, the fully connected ones holding most parameters, on 1
   device: `15:1`, the very plan the paper picks on C; it is only 3% faster than DP for us) and our preference
   for more stages on B and C.
2. **Splitting parameters across stages divides the AllReduce time.** T_e takes the maximum
   over stages of their AllReduce, which run in parallel. With no overlap modelled, a plan
   with k replicated stages each holding 1/k of the parameters finishes its gradient
   synchronisation about k times sooner, so on the flat networks B/C our search prefers
   several replicated stages (`2:2:4:4:4` for GNMT-16, `4:4:4:4` and `2:...:2` for XLNet-36,
   `4:5:6:1` for VGG-19 on C) where the paper has two stages or a straight pipeline. The
   paper's plans score 3-83% slower than ours under our model (column *paper plan's L*).
3. **Free choice of M.** We choose M among the divisors of the global batch size (e.g.
   64 micro-batches of 16 samples for GNMT-16 on B/C, 64 x 1 for BERT-48 on B/C); with
   larger M the bubbles of deeper pipelines shrink, which again favours more stages. The
   paper's planner appears to fix the micro-batch size near the profiling batch size.
4. **Analytic profiles.** Our per-layer times, activation and parameter sizes are analytic
   V100 estimates (`dapple.profiler.paper_models`), not the paper's measurements. Our
   cross-stage traffic is much smaller than the paper's for GNMT-16 (ACR 0.21-0.51 against
   the paper's 3.75 on C), which removes the reason the paper gives for a straight GNMT
   pipeline on C. As in the paper, AmoebaNet-36's DP does not fit a 16 GB V100. In our
   profile its 0.94 G parameters take 16 B each of training state plus 4 B of AllReduce
   buffers, 17.5 GiB. Our AmoebaNet cells are more uniform than the real ones, so its uneven `11:5` split
   is not reproduced (we find `8:8` on A like the paper, a straight pipeline on B, and
   `8:2:2:2:2` on C).
5. **Matches.** ResNet-50 (DP on A/B/C), VGG-19 on A (DP), BERT-48 on A (`8:8`, 25:25
   against 23:25), B and C (straight), XLNet-36 on A (`8:8`, 19:19 against 18:18),
   GNMT-16 on A (`8:8`) and AmoebaNet-36 on A (`8:8`) agree with the paper's table.
"""

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
        "# DAPPLE planning results on the paper's models (section 7.2)\n\n"
        "- command: `.venv/bin/python benchmarks/paper_planning.py --output "
        "benchmarks/paper_planning.md`\n"
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n"
        "- clusters: presets `paper-a` (2 servers x 8 V100, NVLink, 25 Gbps), `paper-b` "
        "(16 x 1 V100, 25 Gbps), `paper-c` (16 x 1 V100, 10 Gbps); profiles `paper:<model>`\n\n"
    )
    if args.output:
        with open(args.output, "w") as f:
            f.write(header + text + NOTES)
    print(text)


if __name__ == "__main__":
    main()
