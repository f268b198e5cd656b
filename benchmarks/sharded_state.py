"""Per-rank memory and step time of zero stage 0, 1 and 2 on 4 ranks (sharded training state).

The model is the zoo ``mlp`` with 7 layers of width 4096 (about 101M parameters, fp32, Adam).
Each plan (DP x4, 1:3, 2:2, and with ``--plans`` 2:2 interleaved with v=2) trains a few steps on 4 local gloo processes with ``zero_stage``
0, 1 and 2 in turn, for ``--rounds`` rounds. Every run reports, per stage and as the maximum
over the stage's replicas, the rank's peak resident memory (``StepMetrics.peak_resident_bytes``,
``VmHWM``) and what building and training its stage added to it
(``StepMetrics.stage_resident_bytes``). The estimate is the planner's per-replica state
(:func:`dapple.planner.memory.device_state_bytes`) plus the 128 MiB a CPU rank's runtime
adds besides its stage (``benchmarks/memory.md``); the MLP's activations (a few MiB) are left
out. CPU ranks keep freed memory for reuse (:func:`dapple.runtime.host_memory.keep_freed_memory`,
set by dapple's launcher).

Run: ``python benchmarks/sharded_state.py [--out benchmarks/sharded_state.md] [--rounds N]``
(about 15 minutes on 2 busy cores; 4 ranks of zero stage 0 hold about 9 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from _bench_common import HERE, header, load_note
from dapple import api
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.core.profile import AffineTime, LayerProfile, ModelProfile
from dapple.planner.memory import device_state_bytes

MODEL: dict[str, Any] = {"layers": 7, "in_features": 32, "hidden": 4096, "num_classes": 10}
G, M, STEPS = 24, 2, 6  # micro-batch 12: splits over 2, 3 and 4 replicas
WARMUP = 2
"""Steps left out of the step time: the first, and the second - the first optimizer update,
which allocates Adam's moments (zero stage 0: 7-8 s here, 3x a steady step)."""
MIB = 1024**2
RESERVED = 128 * MIB
"""What a CPU rank's runtime adds besides its stage (``benchmarks/memory.md``)."""


def _param_bytes() -> list[int]:
    wl = api.load("mlp", **MODEL)
    return [sum(p.numel() * 4 for p in f().parameters()) for f in wl.layer_factories]


def _profile(param_bytes: list[int]) -> ModelProfile:
    """Only parameter bytes matter for the state estimate (Adam: optimizer_state_factor 3)."""
    zero = AffineTime(fixed_ms=0.0, per_sample_ms=0.0)
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward=zero,
            backward=zero,
            output_bytes_per_sample=0.0,
            parameter_bytes=b,
            kept_activation_bytes_per_sample=0.0,
        )
        for i, b in enumerate(param_bytes)
    )
    return ModelProfile(model_name="mlp", layers=layers, batch_sizes=(1,))


def _plans(n: int) -> dict[str, Plan]:
    half = n // 2
    return {
        "DP x4": straight_plan(n, [0], global_batch_size=G, num_micro_batches=M, replicas=[4]),
        "1:3": straight_plan(n, [0, 2], global_batch_size=G, num_micro_batches=M, replicas=[1, 3]),
        "2:2": straight_plan(
            n, [0, half], global_batch_size=G, num_micro_batches=M, replicas=[2, 2]
        ),
        "2:2 v=2": interleave(
            straight_plan(n, [0, half], global_batch_size=G, num_micro_batches=M, replicas=[2, 2]),
            2,
        ),
    }


def _fmt(values: list[float], unit: str = " MiB", scale: float = MIB, nd: int = 0) -> str:
    return " / ".join(f"{v / scale:.{nd}f}{unit}" for v in values)


def _ratio(a: list[float], b: list[float]) -> str:
    return " / ".join(f"{x / y:.2f}x" for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "sharded_state.md"))
    ap.add_argument("--rounds", type=int, default=2, help="runs per configuration, alternating")
    ap.add_argument(
        "--plans", default="DP x4,1:3,2:2", help="comma-separated plan names (also: 2:2 v=2)"
    )
    ap.add_argument("--zeros", default="0,1,2", help="comma-separated zero stages (0 first)")
    ap.add_argument("--steps", type=int, default=STEPS, help="steps per run")
    args = ap.parse_args()
    zeros = tuple(int(z) for z in args.zeros.split(","))
    steps = args.steps
    if steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps; got {steps}")
    pb = _param_bytes()
    prof = _profile(pb)
    n_params = sum(pb) // 4
    lines = header(
        "Sharded training state (ZeRO-1/2) per stage",
        f"python benchmarks/sharded_state.py --rounds {args.rounds} --plans '{args.plans}' "
        f"--zeros {args.zeros} --steps {steps}",
    )
    lines += [
        f"Model: zoo `mlp` {MODEL}, {n_params / 1e6:.1f}M parameters ({len(pb)} chain layers), "
        f"fp32, Adam (fused), lr 1e-4, global batch {G}, M = {M}, {steps} steps, 4 gloo "
        f"processes on this machine. Each plan runs zero stage {args.zeros} in turn, "
        f"{args.rounds} rounds; step time: median over the runs of the steps after each run's "
        f"first {WARMUP} (the first and the first optimizer update, which allocates Adam's "
        "moments); memory: the largest of the runs, per stage the largest over its replicas.",
        "",
        "| plan | zero stage | stage: replicas x layers | peak resident per rank | vs zero 0 "
        "| added by the stage | vs zero 0 | estimate (state + reserved) | estimate / added "
        "| step time | vs zero 0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, plan in _plans(len(pb)).items():
        if name not in args.plans.split(","):
            continue
        groups = [plan.stages[g :: plan.num_groups] for g in range(plan.num_groups)]
        shape = ", ".join(
            f"{grp[0].replicas} x " + " + ".join(str(st.layers[1] - st.layers[0]) for st in grp)
            for grp in groups
        )
        times: dict[int, list[float]] = {z: [] for z in zeros}
        peak: dict[int, list[float]] = {}
        added: dict[int, list[float]] = {}
        for k in range(args.rounds):
            for zero in zeros:
                print(f"{name} zero {zero} round {k}: training", flush=True)
                metrics = api.train(plan, "mlp", steps=steps, overrides=MODEL, optimizer="adam",
                                    lr=1e-4, zero_stage=zero, device="cpu")  # fmt: skip
                last = metrics[-1]
                for store, got in ((peak, last.peak_resident_bytes),
                                   (added, last.stage_resident_bytes)):  # fmt: skip
                    vals = [float(a) for a in got]
                    store[zero] = [
                        max(a, b) for a, b in zip(store.get(zero, vals), vals, strict=True)
                    ]
                times[zero] += [m.step_ms for m in metrics[WARMUP:]]
                print(f"  peak {_fmt(peak[zero])}, added {_fmt(added[zero])}, steps "
                      f"{[round(m.step_ms) for m in metrics]} ms", flush=True)  # fmt: skip
        base_ms = statistics.median(times[0])
        for zero in zeros:
            step_ms = statistics.median(times[zero])
            est = [  # a device group's chunks (interleaved: v of them)
                device_state_bytes(prof, [dataclasses.replace(st, zero_stage=zero) for st in grp])
                + RESERVED
                for grp in groups
            ]
            lines.append(
                f"| {name} | {zero} | {shape} | {_fmt(peak[zero])} | {_ratio(peak[zero], peak[0])} "
                f"| {_fmt(added[zero])} | {_ratio(added[zero], added[0])} | {_fmt(est)} "
                f"| {_ratio(est, added[zero]).replace('x', '')} | {step_ms:.0f} ms "
                f"| {step_ms / base_ms:.2f}x |"
            )
            print(lines[-1], flush=True)
    lines += ["", f"End: {load_note()}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
