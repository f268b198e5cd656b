"""ZeRO-1 against ZeRO-2: the resident memory one replica's stage adds, measured, beside the
planner's per-replica state (:func:`dapple.cost.memory.device_state_bytes`), for stages of few
gradient buckets (issue #41: the planner had ZeRO-2 above ZeRO-1 on such stages).

DP x2 (2 gloo processes) over the zoo ``mlp`` in two shapes: width 1024 (a 12.8 MB stage, one
25 MiB bucket) and width 4096 with one hidden layer (a 67.8 MB stage that one 67 MB weight
dominates, as an MoE block does a small stage). Zero stages 1 and 2 alternate, ``--rounds``
rounds; "added" is ``StepMetrics.stage_resident_bytes`` (``VmHWM`` growth from building and
training the stage), so it also holds the runtime's own allocations: compare the z2 - z1
difference, not the levels.

Run: ``python benchmarks/zero2_small_stage.py [--rounds N] [--out benchmarks/zero2_small_stage.md]``
(about a minute per round on 2 busy cores).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from _bench_common import HERE, header, load_note
from dapple import api
from dapple.core.plan import straight_plan
from dapple.cost.memory import device_state_bytes
from sharded_state import _profile

SHAPES: dict[str, dict[str, Any]] = {
    "w1024 x 4": {"layers": 4, "in_features": 32, "hidden": 1024, "num_classes": 10},
    "w4096 x 2": {"layers": 2, "in_features": 32, "hidden": 4096, "num_classes": 10},
}
"""``mlp`` arguments of each measured shape."""
MB = 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "zero2_small_stage.md"))
    args = ap.parse_args()
    lines = header(
        "ZeRO-2 against ZeRO-1 on stages of few buckets (DP x2)",
        f"python benchmarks/zero2_small_stage.py --rounds {args.rounds}",
    )
    lines += [
        "",
        "| shape | layers' parameters (MB) | zero | added per round (MB) | estimate (MB) |",
        "|---|---|---|---|---|",
    ]
    for name, over in SHAPES.items():
        prof = _profile("mlp", over)
        plan = straight_plan(prof.num_layers, [0], global_batch_size=8, num_micro_batches=2,
                             replicas=[2])  # fmt: skip
        sizes = ", ".join(f"{x.parameter_bytes / MB:.2f}" for x in prof.layers)
        added: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for z in (1, 2):
                m = api.train(plan, "mlp", steps=4, overrides=over, optimizer="adam", lr=1e-4,
                              zero_stage=z, device="cpu")  # fmt: skip
                added[z].append(max(m[-1].stage_resident_bytes) / MB)
                print(name, z, added[z][-1], flush=True)
        for z in (1, 2):
            st = [dataclasses.replace(s, zero_stage=z) for s in plan.stages]
            est = device_state_bytes(prof, st) / MB
            got = ", ".join(f"{a:.1f}" for a in added[z])
            lines.append(f"| {name} | {sizes} | {z} | {got} | {est:.1f} |")
    lines += ["", f"End: {load_note()}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
