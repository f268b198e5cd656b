"""Simulated step time and peak memory of every schedule for the paper's six models.

Run: ``.venv/bin/python benchmarks/schedules.py [--output benchmarks/schedules.md]``.

Simulated only: the runtime runs GPipe and DAPPLE, not interleaved 1F1B or ZB-H1 yet. For each
model (the shipped analytic V100 profiles ``paper:<name>`` at the paper's global batch size)
and cluster (``paper-a``, ``paper-b``, ``h100-8x`` with 2 servers = 16 devices), the DAPPLE
planner's plan, the straight pipeline and balanced pipelines of every depth
(:func:`dapple.planner.schedule_choice.balanced_pipelines`) give the partitions, replication
and placement; :func:`dapple.planner.schedule_choice.best_per_schedule` then tries every
schedule and number of micro-batches on them and keeps the fastest simulated plan under the
memory limit.
"""

from __future__ import annotations

import argparse
import time

from _bench_common import header
from dapple.core.cluster_presets import load_cluster
from dapple.errors import DappleError
from dapple.planner import make_plan
from dapple.planner.schedule_choice import SCHEDULE_VARIANTS, balanced_pipelines, best_per_schedule
from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, PAPER_MODELS, load_paper_profile

CLUSTERS = (("paper-a", None), ("paper-b", None), ("h100-8x", 2))

NOTES = """
## Reading the tables

- Each cell: simulated step time in ms / peak device memory in GiB of the best plan found for
  that schedule, and its M (micro-batches) and replication. `n/a`: no plan of that schedule
  fits; the reason is listed under the table (for several partitions, the last one tried):
  interleaving needs each device group to hold a multiple of v layers and M a multiple of the
  device groups, and every plan must fit the memory limit.
- The partitions come from the DAPPLE planner (which optimises for DAPPLE's own latency L), the
  straight pipeline and balanced pipelines of every depth P dividing the device count (P groups
  of D/P devices, layers cut at equal shares of forward + backward time); the interleaved
  variants also try those cuts moved to multiples of v. This is not a joint search of
  partition x replication x schedule: each schedule's best here is what these partitions reach.
- ZB-H1 holds a micro-batch's activations until its W, up to min(S, M) micro-batches on
  every stage (1F1B holds min(S - i, M) on stage i), so on a later stage that is close to the
  memory limit under DAPPLE it may not fit where DAPPLE does and takes another partition or M
  (e.g. AmoebaNet-36 on paper-a: 4:4:4:4 instead of DAPPLE's 8:8).
- ZB-H1's input/weight-gradient split is not measured for these analytic profiles: it is the
  documented assumption of `LayerProfile.backward_split` (an even split for layers with
  parameters, all input gradient for layers without).
- `h100-8x` keeps the V100 compute times of the analytic profiles (no H100 profile ships);
  only its links and 80 GiB memory differ.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output", default="benchmarks/schedules.md")
    args = ap.parse_args()
    lines = header(
        "Schedules compared by simulation (GPipe, DAPPLE A/B, interleaved 1F1B, ZB-H1)",
        "python benchmarks/schedules.py --output benchmarks/schedules.md",
    )
    labels = [
        "gpipe"
        if s == "gpipe"
        else f"dapple/{p}"
        if s == "dapple"
        else f"interleaved v={v}"
        if s == "interleaved"
        else s
        for s, p, v in SCHEDULE_VARIANTS
    ]
    start = time.perf_counter()
    for cname, servers in CLUSTERS:
        cluster = load_cluster(cname, servers)
        lines += [
            f"## {cname} ({cluster.num_devices} devices)",
            "",
            "| model | " + " | ".join(labels) + " |",
            "|---|" + "---|" * len(labels),
        ]
        reasons: list[str] = []
        for name in PAPER_MODELS:
            prof = load_paper_profile(name)
            gbs = PAPER_GLOBAL_BATCH[name]
            bases = []
            for planner in ("dapple", "straight"):
                try:
                    bases.append(make_plan(prof, cluster, gbs, planner))
                except DappleError as e:
                    reasons.append(f"{name}: {planner} planner: {str(e).splitlines()[0]}")
            bases += balanced_pipelines(prof, cluster, gbs)
            cells = []
            for ch in best_per_schedule(bases, prof, cluster) if bases else []:
                if ch.plan is None or ch.result is None:
                    cells.append("n/a")
                    reasons.append(f"{name}, {ch.label}: {ch.note}")
                    continue
                cells.append(
                    f"{ch.result.step_ms:.0f} / {ch.result.peak_memory_bytes / 2**30:.1f} "
                    f"(M={ch.plan.num_micro_batches}, {ch.plan.replication})"
                )
            lines.append(
                f"| {name} (batch {gbs}) | " + " | ".join(cells or ["n/a"] * len(labels)) + " |"
            )
        lines.append("")
        lines += [f"- {r}" for r in reasons]
        lines.append("")
    lines.append(f"Simulation and search took {time.perf_counter() - start:.0f} s in all.")
    lines += NOTES.splitlines()
    with open(args.output, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
