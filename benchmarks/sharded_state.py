"""Per-rank memory and step time of zero stage 0, 1 and 2 on 4 ranks (sharded training state).

The model is the zoo ``mlp`` with 7 layers of width 4096 (about 101M parameters, fp32, Adam), or
with ``--model gpt2`` a 4-block GPT-2 of width 768 with GPT-2's vocabulary of 50257 tokens and
tied embeddings (67M parameters, 39M of them the embedding its first and last layer each hold a
copy of), 16 tokens a sample.
Each plan (DP x4, 1:3, 2:2, and with ``--plans`` 2:2 interleaved with v=2) trains a few steps on 4 local gloo processes with ``zero_stage``
0, 1 and 2 in turn, for ``--rounds`` rounds. Every run reports, per stage and as the maximum
over the stage's replicas, the rank's peak resident memory (``StepMetrics.peak_resident_bytes``,
``VmHWM``) and what building and training its stage added to it
(``StepMetrics.stage_resident_bytes``). The estimate is the planner's per-replica state
(:func:`dapple.cost.memory.device_state_bytes`) plus the 128 MiB a CPU rank's runtime
adds besides its stage (``benchmarks/memory.md``); the MLP's activations (a few MiB) are left
out. CPU ranks keep freed memory for reuse (:func:`dapple.runtime.host_memory.keep_freed_memory`,
set by dapple's launcher).

Run: ``python benchmarks/sharded_state.py [--out benchmarks/sharded_state.md] [--rounds N]
[--model mlp|gpt2]``
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
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.memory import device_state_bytes
from dapple.profiler.measure import bucketed_parameter_sizes, tied_layer_bytes

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("mlp", {"layers": 7, "in_features": 32, "hidden": 4096, "num_classes": 10}),
    "gpt2": (
        "dapple.models.hf:gpt2",
        {"layers": 4, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 16},
    ),
}
"""``--model``: the workload spec and its arguments."""
G, M, STEPS = 24, 2, 6  # micro-batch 12: splits over 2, 3 and 4 replicas
WARMUP = 2
"""Steps left out of the step time: the first, and the second - the first optimizer update,
which allocates Adam's moments (zero stage 0: 7-8 s here, 3x a steady step)."""
MIB = 1024**2
RESERVED = 128 * MIB
"""What a CPU rank's runtime adds besides its stage (``benchmarks/memory.md``)."""


def _profile(spec: str, args: dict[str, Any]) -> ModelProfile:
    """The layers' parameter bytes, tied copies and parameters one by one, as the profiler
    records them: all the state estimate reads (Adam: optimizer_state_factor 3); no times or
    activations."""
    wl = api.load(spec, **args)
    zero = AffineTime(fixed_ms=0.0, per_sample_ms=0.0)
    layers = []
    for i in range(wl.num_layers):
        module = wl.build_layer(i, 0)
        tied, partners = tied_layer_bytes(wl, i, module)
        layers.append(
            LayerProfile(
                name=wl.name_of(i),
                forward=zero,
                backward=zero,
                output_bytes_per_sample=0.0,
                parameter_bytes=sum(p.numel() * 4 for p in module.parameters()),
                kept_activation_bytes_per_sample=0.0,
                tied_parameter_bytes=tied,
                tied_layers=partners,
                parameter_sizes=bucketed_parameter_sizes(wl, i, module),
            )
        )
    return ModelProfile(model_name=wl.name, layers=tuple(layers), batch_sizes=(1,))


def _plans(n: int, names: list[str]) -> dict[str, Plan]:
    """The plans of ``names`` over ``n`` layers, in this order: DP x4, 1:3, 2:2, 2:2 v=2."""
    half = n // 2

    def two_two() -> Plan:
        return straight_plan(
            n, [0, half], global_batch_size=G, num_micro_batches=M, replicas=[2, 2]
        )

    make = {
        "DP x4": lambda: straight_plan(
            n, [0], global_batch_size=G, num_micro_batches=M, replicas=[4]
        ),
        "1:3": lambda: straight_plan(
            n, [0, 2], global_batch_size=G, num_micro_batches=M, replicas=[1, 3]
        ),
        "2:2": two_two,
        "2:2 v=2": lambda: interleave(two_two(), 2),
    }
    return {name: build() for name, build in make.items() if name in names}


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
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp")
    args = ap.parse_args()
    zeros = tuple(int(z) for z in args.zeros.split(","))
    steps = args.steps
    if steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps; got {steps}")
    spec, model_args = MODELS[args.model]
    prof = _profile(spec, model_args)
    held = prof.parameter_bytes
    copies = sum(  # each tied parameter's second and later copies
        x.tied_parameter_bytes
        for i, x in enumerate(prof.layers)
        if min(x.tied_layers, default=i) < i
    )
    tied = (
        f", {sum(x.tied_parameter_bytes for x in prof.layers) / 4e6:.1f}M of the layers' "
        f"{held / 4e6:.1f}M in copies of tied parameters"
        if copies
        else ""
    )
    lines = header(
        "Sharded training state (ZeRO-1/2) per stage",
        f"python benchmarks/sharded_state.py --rounds {args.rounds} --plans '{args.plans}' "
        f"--zeros {args.zeros} --steps {steps} --model {args.model}",
    )
    lines += [
        f"Model: `{spec}` {model_args}, {(held - copies) / 4e6:.1f}M parameters "
        f"({prof.num_layers} chain layers{tied}), "
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
    for name, plan in _plans(prof.num_layers, args.plans.split(",")).items():
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
                metrics = api.train(plan, spec, steps=steps, overrides=model_args, optimizer="adam",
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
