"""Per-rank memory and step time of zero stage 0 vs 1 (sharded optimizer state) on 4 ranks.

The model is the zoo ``mlp`` with 8 hidden layers of width 2048 (about 29M parameters, fp32,
Adam). Each plan (DP x4, 1:3, 2:2) trains a few steps on 4 local gloo processes, once with
``zero_stage=0`` and once with ``zero_stage=1``; every rank reports what building and
training its stage added to its resident memory (``StepMetrics.stage_resident_bytes``, the
maximum over each stage's replicas). The estimate is the planner's per-replica state
(:func:`dapple.planner.memory.parameter_state_bytes`: parameters, gradients, Adam moments -
divided by r_s under ZeRO-1 - and a replicated stage's AllReduce buffers) plus the 128 MiB a
CPU rank's runtime adds besides its stage (see ``benchmarks/memory.md``); the MLP's
activations (a few MiB) are left out.

Run: ``python benchmarks/sharded_state.py [--out benchmarks/sharded_state.md]`` (about 3
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from _bench_common import HERE, header, load_note
from dapple import api
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import AffineTime, LayerProfile, ModelProfile
from dapple.planner.memory import parameter_state_bytes

MODEL: dict[str, Any] = {"layers": 8, "in_features": 32, "hidden": 2048, "num_classes": 10}
G, M, STEPS = 24, 2, 6  # micro-batch 12: splits over 2, 3 and 4 replicas
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
    return {
        "DP x4": straight_plan(n, [0], global_batch_size=G, num_micro_batches=M, replicas=[4]),
        "1:3": straight_plan(n, [0, 2], global_batch_size=G, num_micro_batches=M, replicas=[1, 3]),
        "2:2": straight_plan(n, [0, 5], global_batch_size=G, num_micro_batches=M, replicas=[2, 2]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "sharded_state.md"))
    ap.add_argument("--rounds", type=int, default=3, help="runs per configuration, alternating")
    args = ap.parse_args()
    pb = _param_bytes()
    prof = _profile(pb)
    n_params = sum(pb) // 4
    lines = header(
        "Sharded optimizer state (ZeRO-1) per stage", "python benchmarks/sharded_state.py"
    )
    lines += [
        f"Model: zoo `mlp` {MODEL}, {n_params / 1e6:.1f}M parameters ({len(pb)} chain layers), "
        f"fp32, Adam (fused), lr 1e-4, global batch {G}, M = {M}, {STEPS} steps, 4 gloo "
        "processes on this machine. Each plan runs zero stage 0 and 1 alternately, "
        f"{args.rounds} times each; step time: median over the runs of the steps after each "
        "run's first; memory: the largest of the runs.",
        "",
        "| plan | zero stage | stage: replicas x layers | added by the stage, max over replicas "
        "| vs zero 0 | estimate (state + reserved) | estimate / added | step time | vs zero 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, plan in _plans(len(pb)).items():
        base: tuple[list[float], float] | None = None
        shape = ", ".join(f"{st.replicas} x {st.layers[1] - st.layers[0]}" for st in plan.stages)
        times: dict[int, list[float]] = {0: [], 1: []}
        mem: dict[int, list[float]] = {}
        for k in range(args.rounds):
            for zero in (0, 1):
                print(f"{name} zero {zero} round {k}: training", flush=True)
                metrics = api.train(
                    plan,
                    "mlp",
                    steps=STEPS,
                    overrides=MODEL,
                    optimizer="adam",
                    lr=1e-4,
                    zero_stage=zero,
                    device="cpu",
                )
                got = [float(a) for a in metrics[-1].stage_resident_bytes]
                mem[zero] = [max(a, b) for a, b in zip(mem.get(zero, got), got, strict=True)]
                times[zero] += [m.step_ms for m in metrics[1:]]
        for zero in (0, 1):
            added = mem[zero]
            step_ms = statistics.median(times[zero])
            est = [
                parameter_state_bytes(prof, st.layers, st.replicas, zero) + RESERVED
                for st in plan.stages
            ]
            if base is None:
                base = (added, step_ms)
            lines.append(
                f"| {name} | {zero} | {shape} | "
                f"{' / '.join(f'{a / MIB:.0f} MiB' for a in added)} | "
                f"{' / '.join(f'{a / b:.2f}x' for a, b in zip(added, base[0], strict=True))} | "
                f"{' / '.join(f'{e / MIB:.0f} MiB' for e in est)} | "
                f"{' / '.join(f'{e / a:.2f}' for e, a in zip(est, added, strict=True))} | "
                f"{step_ms:.0f} ms | {step_ms / base[1]:.2f}x |"
            )
            print(lines[-1], flush=True)
    lines += ["", f"End: {load_note()}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
