"""ZeRO-1 against ZeRO-2: the memory one replica's stage holds, measured, beside the planner's
per-replica state (:func:`dapple.cost.memory.device_state_bytes`), for stages of few gradient
buckets (issue #41: a ZeRO-2 bucket is staged only when all its gradients are final, so its
fresh gradients live beside its staging copy).

DP x2 (2 gloo processes) over the zoo ``mlp``, one stage, Adam, global batch 8, M = 2. Two
measurements:

1. **Tensor accounting** (:class:`tp_memory.LiveBytes`, a ``TorchDispatchMode`` around
   ``run_plan``: every tensor storage the rank's ops allocate, while it is alive): the step
   peak over the steady steps (all but the first), the largest over the 2 ranks, against the
   estimate. Shapes (:data:`COUNTED`): width 1024 x 4 (12.8 MB, one 25 MiB bucket), width 1024
   x 6 cut at 4.5 MiB (21.2 MB in 5 buckets: ``FlatShards`` reads the cap from
   ``dapple.runtime.parallel.zero.shards.BUCKET_BYTES``, set in the workers; the estimate is
   given the same cap), width 4096 x 2 (67.8 MB, one 67 MB weight: the shape of an MoE
   block in a small stage) and width 3072 x 4 (113.8 MB, three 37.7 MB layers above the cap:
   the runtime gives each layer's weight a bucket and its bias another, which the estimate
   cuts alike from the profile's parameters one by one). Each on gloo's reductions (in place: what a CPU run holds) and on
   the tensor collectives every other backend runs (``DAPPLE_TEST_ZERO_TENSOR_COLLECTIVES=1``:
   ``reduce_scatter_single`` into an output of ``1/r`` of the bucket, which the estimate
   prices); gloo's own ``reduce_scatter_single`` also allocates a temporary the size of its
   input (:mod:`dapple.runtime.parallel.zero`), which NCCL does not, so that row holds one
   bucket more than a GPU would.
2. **Resident memory** (``--rounds`` rounds, zero stages alternating; skipped with
   ``--rounds 0``): ``StepMetrics.stage_resident_bytes`` (``VmHWM`` growth from building and
   training the stage) of ``api.train`` on the first and last shape. It also holds the
   runtime's own allocations (about 60 MB), so compare the z2 - z1 difference, not the levels.

Run: ``python benchmarks/zero2_small_stage.py [--rounds N] [--out benchmarks/zero2_small_stage.md]``
(about a minute per round and one for the accounting on 2 busy cores). A section
``## Analysis`` already in ``--out`` is kept below the new results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from _bench_common import (
    HERE,
    header,
    join_worker_group,
    kept_section,
    load_note,
    run_worker_group,
)
from dapple import api
from dapple.core.buckets import BUCKET_BYTES
from dapple.core.plan import Plan, straight_plan
from dapple.cost.memory import device_state_bytes, zero2_bucket_bytes, zero2_in_flight_bytes
from sharded_state import _profile

SHAPES: dict[str, dict[str, Any]] = {
    "w1024 x 4": {"layers": 4, "in_features": 32, "hidden": 1024, "num_classes": 10},
    "w1024 x 6": {"layers": 6, "in_features": 32, "hidden": 1024, "num_classes": 10},
    "w4096 x 2": {"layers": 2, "in_features": 32, "hidden": 4096, "num_classes": 10},
    "w3072 x 4": {"layers": 4, "in_features": 32, "hidden": 3072, "num_classes": 10},
}
"""``mlp`` arguments of each measured shape."""
COUNTED: list[tuple[str, int]] = [
    ("w1024 x 4", BUCKET_BYTES),
    ("w1024 x 6", 9 * 2**19),
    ("w4096 x 2", BUCKET_BYTES),
    ("w3072 x 4", BUCKET_BYTES),
]
"""The tensor-accounting cases: a shape and its bucket cap in bytes."""
RSS_SHAPES = ("w1024 x 4", "w4096 x 2")
"""The resident-memory cases (at the runtime's own cap)."""
STEPS = 3
MB = 1e6
ANALYSIS = "## Analysis"


def plan_of(num_layers: int) -> Plan:
    """One stage of every layer on 2 replicas, global batch 8, M = 2."""
    return straight_plan(num_layers, [0], global_batch_size=8, num_micro_batches=2, replicas=[2])


def estimate(shape: str, zero: int, cap: float = BUCKET_BYTES) -> dict[str, Any]:
    """The planner's per-replica state of ``shape`` at ``zero`` with buckets cut at ``cap``
    (its gradients in flight included), and the buckets."""
    prof = _profile("mlp", SHAPES[shape])
    plan = plan_of(prof.num_layers)
    stages = [dataclasses.replace(s, zero_stage=zero) for s in plan.stages]
    layers, par = stages[0].layers, stages[0].parallel
    at_cap = zero2_in_flight_bytes(prof, layers, par, cap)  # 0 unless ZeRO-2
    state = device_state_bytes(prof, stages) - zero2_in_flight_bytes(prof, layers, par) + at_cap
    return {
        "state": state,
        "buckets": zero2_bucket_bytes(prof, layers, par, cap),
        "layers": [x.parameter_bytes for x in prof.layers],
    }


def _count_worker(
    rank: int, world: int, port: int, cases: list[Any], collectives: bool, out: str
) -> None:
    """Each case ``(shape, cap, zero)`` in turn under :class:`tp_memory.LiveBytes`; rank 0
    writes every rank's steady extremes."""
    import torch
    import torch.distributed as dist

    from dapple.runtime import shutdown_distributed
    from dapple.runtime.engine import run_plan
    from dapple.runtime.parallel.zero import TENSOR_COLLECTIVES_ENV, shards
    from dapple.runtime.train_config import TrainConfig
    from tp_memory import LiveBytes, steady_extremes

    if collectives:
        os.environ[TENSOR_COLLECTIVES_ENV] = "1"
    join_worker_group(rank, world, port)
    rows: list[Any] = []
    for shape, cap, zero in cases:
        shards.BUCKET_BYTES = cap  # read by FlatShards as it builds its buckets
        wl = api.load("mlp", **SHAPES[shape])
        cfg = TrainConfig(steps=STEPS, optimizer="adam", lr=1e-4, device="cpu", zero_stage=zero)
        with LiveBytes() as live:
            run_plan(plan_of(wl.num_layers), wl, cfg, device=torch.device("cpu"))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, steady_extremes(live))
        rows.append(gathered)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows}))
    shutdown_distributed()


def count(
    cases: list[tuple[str, int]] = COUNTED, collectives: bool = False
) -> list[dict[str, Any]]:
    """Tensor accounting of each case at ZeRO-1 and ZeRO-2 in one 2-process group: per case
    and zero stage the step peak and the state peak (largest over the ranks) beside the
    estimate (:func:`estimate`)."""
    runs = [(shape, cap, zero) for shape, cap in cases for zero in (1, 2)]
    got = run_worker_group(_count_worker, 2, runs, collectives)["rows"]
    rows = []
    for (shape, cap, zero), ranks in zip(runs, got, strict=True):
        est = estimate(shape, zero, cap)
        rows.append({
            "shape": shape, "cap": cap, "zero": zero, "collectives": collectives,
            "step_peak": max(r["step_peak"] for r in ranks),
            "state_peak": max(r["state_peak"] for r in ranks),
            "estimate": est["state"], "buckets": est["buckets"],
        })  # fmt: skip
    return rows


def count_table(rows: list[dict[str, Any]]) -> list[str]:
    """The accounting rows as markdown, with each case's z2 - z1 measured and estimated."""
    lines = [
        "| shape | bucket cap (MiB) | buckets (MB) | reductions | zero | step peak (MB) "
        "| estimate (MB) | est - meas, % of est | z2 - z1 measured | z2 - z1 estimated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pair = [q for q in rows if (q["shape"], q["cap"], q["collectives"])
                == (r["shape"], r["cap"], r["collectives"])]  # fmt: skip
        one, two = sorted(pair, key=lambda q: q["zero"])
        dm = (two["step_peak"] - one["step_peak"]) / MB
        de = (two["estimate"] - one["estimate"]) / MB
        off = 100 * (r["estimate"] - r["step_peak"]) / r["estimate"]
        kind = "tensor collectives" if r["collectives"] else "gloo, in place"
        sizes = ", ".join(f"{b / MB:.2f}" for b in r["buckets"])
        lines.append(
            f"| {r['shape']} | {r['cap'] / 2**20:g} | {sizes} | {kind} | {r['zero']} "
            f"| {r['step_peak'] / MB:.2f} | {r['estimate'] / MB:.2f} | {off:+.1f} "
            f"| {dm:+.2f} | {de:+.2f} |"
        )
    return lines


def resident(rounds: int) -> list[str]:
    """``--rounds`` rounds of ``api.train`` per :data:`RSS_SHAPES` shape, zero stages
    alternating: the table of the resident memory each added."""
    lines = [
        "| shape | layers' parameters (MB) | zero | added per round (MB) | estimate (MB) |",
        "|---|---|---|---|---|",
    ]
    for name in RSS_SHAPES:
        over = SHAPES[name]
        prof = _profile("mlp", over)
        plan = plan_of(prof.num_layers)
        sizes = ", ".join(f"{x.parameter_bytes / MB:.2f}" for x in prof.layers)
        added: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(rounds):
            for z in (1, 2):
                m = api.train(plan, "mlp", steps=4, overrides=over, optimizer="adam", lr=1e-4,
                              zero_stage=z, device="cpu")  # fmt: skip
                added[z].append(max(m[-1].stage_resident_bytes) / MB)
                print(name, z, added[z][-1], flush=True)
        for z in (1, 2):
            got = ", ".join(f"{a:.1f}" for a in added[z])
            est = estimate(name, z)["state"] / MB
            lines.append(f"| {name} | {sizes} | {z} | {got} | {est:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "zero2_small_stage.md"))
    args = ap.parse_args()
    lines = header(
        "ZeRO-2 against ZeRO-1 on stages of few buckets (DP x2)",
        f"python benchmarks/zero2_small_stage.py --rounds {args.rounds}",
    )
    rows = count(COUNTED, collectives=False) + count(COUNTED, collectives=True)
    lines += [
        "## Tensor accounting",
        "",
        f"Step peak of tracked tensor bytes over steps 2-{STEPS}, the larger of the 2 ranks; "
        "estimate: `device_state_bytes` with the run's bucket cap (parameters, gradients, "
        "Adam state and the gradients in flight; the step's activations, under 0.3 MB here, "
        "are not in it).",
        "",
        *count_table(rows),
    ]
    if args.rounds:
        lines += ["", "## Resident memory (VmHWM growth)", "", *resident(args.rounds)]
    lines += ["", f"End: {load_note()}."]
    lines += kept_section(Path(args.out), ANALYSIS)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
