"""Memory per rank of a ~330M-parameter LLaMA-style model under pipeline plans, measured and
predicted.

The model is built from a ``transformers`` LLaMA config (``hf:DIR``, random weights, fp32, Adam).
Each plan trains a few steps on 4 local gloo processes; every rank reports its process's peak
resident memory (``VmHWM``) and what building and training its stage added
(``StepMetrics.stage_resident_bytes``). The single-process reference is the same model under a
1-device plan. The planner's per-replica estimate (parameters, gradients, Adam state, the
activations of the K_i micro-batches in flight) comes from a profile of the model taken one
layer at a time. Start-up is the wall time of a run less its steps: spawning, imports, tracing
the model on the meta device, building the stage, teardown.

Run: ``python benchmarks/memory.py [--out benchmarks/memory.md]`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench_common import HERE, header, load_note
from dapple import api
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, straight_plan
from dapple.cost.pipeline import pipeline_latency
from dapple.runtime.train_config import OPTIMIZER_STATE_FACTOR

CONFIG: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 8192,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
SEQ = 16
G, M = 6, 2  # micro-batch 3: splits over 3 replicas (3:1) and 2 (2:2)
STEPS = 3
GIB = 1024**3
MIB = 1024**2
RESERVED = 128 * MIB
"""The cluster's ``reserved_memory_bytes``: what a CPU rank's runtime adds besides its stage
(gloo groups, threads, allocator), about 120 MiB measured on small models under fused Adam."""


def _cuts(param_bytes: list[int], parts: list[float]) -> list[int]:
    """Stage starts splitting the layers' parameter bytes at the cumulative fractions."""
    total, run, cuts = sum(param_bytes), 0.0, [0]
    targets = iter(parts)
    goal = next(targets, None)
    for i, b in enumerate(param_bytes):
        if goal is not None and run >= goal * total and i > cuts[-1]:
            cuts.append(i)
            goal = next(targets, None)
        run += b
    return cuts


def _plans(param_bytes: list[int]) -> dict[str, Plan]:
    n = len(param_bytes)
    return {
        "single process": straight_plan(n, [0], global_batch_size=G, num_micro_batches=M),
        "straight 4": straight_plan(
            n, _cuts(param_bytes, [0.25, 0.5, 0.75]), global_batch_size=G, num_micro_batches=M
        ),
        "3:1": straight_plan(
            n, _cuts(param_bytes, [0.75]), global_batch_size=G, num_micro_batches=M, replicas=[3, 1]
        ),
        "2:2": straight_plan(
            n, _cuts(param_bytes, [0.5]), global_batch_size=G, num_micro_batches=M, replicas=[2, 2]
        ),
        "DP x4": straight_plan(n, [0], global_batch_size=G * 2, num_micro_batches=1, replicas=[4]),
    }


def _run(plan: Plan, spec: str) -> tuple[Any, float]:
    t0 = time.perf_counter()
    metrics = api.train(plan, spec, steps=STEPS, overrides={"seq": SEQ}, optimizer="adam", lr=1e-4)
    wall = time.perf_counter() - t0
    return metrics[-1], wall - sum(m.step_ms for m in metrics) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "memory.md"))
    ap.add_argument("--machine-gib", type=float, default=22.0, help="skip plans predicted above")
    args = ap.parse_args()
    import transformers as tf

    lines = header("Memory per rank: measured vs predicted", "python benchmarks/memory.py")
    root = Path(tempfile.mkdtemp(prefix="dapple-memory-"))
    tf.LlamaConfig(**CONFIG).save_pretrained(root)  # config.json only: weights are random
    spec = f"hf:{root}"
    wl = api.load(spec, seq=SEQ)
    t0 = time.perf_counter()
    prof = api.profile(wl, batch_sizes=[1, 3], device="cpu", repeats=1, warmup=0)
    prof = dataclasses.replace(prof, optimizer_state_factor=OPTIMIZER_STATE_FACTOR["adam"])
    profile_s = time.perf_counter() - t0
    n_params = sum(layer.parameter_bytes for layer in prof.layers) // 4
    cluster = Cluster(name="local-4", servers=1, devices_per_server=4,
                      device_memory_bytes=int(args.machine_gib * GIB),
                      reserved_memory_bytes=RESERVED,
                      intra_server_bandwidth_gbps=10.0, inter_server_bandwidth_gbps=10.0)  # fmt: skip
    lines += [
        f"Model: LLaMA from config {CONFIG}, {n_params / 1e6:.0f}M parameters "
        f"({len(prof.layers)} chain layers), fp32, Adam (16 bytes of training state per "
        f"parameter: {n_params * 16 / GIB:.2f} GiB), sequence {SEQ}, global batch {G}, "
        f"M = {M}, {STEPS} steps. Profile (one layer at a time, batch sizes 1 and 3): "
        f"{profile_s:.0f} s.",
        "",
        "| plan | stage: replicas x layers | peak resident per rank (VmHWM), max over "
        "replicas | added by the stage | planner estimate (stage + reserved) | estimate / "
        "added | peak / single-process peak | start-up + teardown |",
        "|---|---|---|---|---|---|---|---|",
    ]
    single_peak = 0.0
    results: dict[str, Any] = {}
    for name, plan in _plans([layer.parameter_bytes for layer in prof.layers]).items():
        est = [r.memory_bytes + RESERVED for r in pipeline_latency(plan, prof, cluster).stages
               if r.kind == "compute"]  # fmt: skip
        total_est = sum(e * st.replicas for e, st in zip(est, plan.stages, strict=True))
        shape = ", ".join(f"{st.replicas} x {st.layers[1] - st.layers[0]}" for st in plan.stages)
        if 1.25 * total_est + 0.6 * GIB * len(plan.devices) > args.machine_gib * GIB:
            lines.append(
                f"| {name} | {shape} | not run: 1.25 x the planner's {total_est / GIB:.1f} GiB of "
                f"training state plus ~0.6 GiB per process exceeds this machine's "
                f"{args.machine_gib:.0f} GiB | | {' / '.join(f'{e / GIB:.2f} GiB' for e in est)}"
                " | | | |"
            )
            continue
        print(f"{name}: training", flush=True)
        last, startup = _run(plan, spec)
        results[name] = last
        peaks, added = last.peak_resident_bytes, last.stage_resident_bytes
        if name == "single process":
            single_peak = float(peaks[0])
        lines.append(
            f"| {name} | {shape} | {' / '.join(f'{p / GIB:.2f} GiB' for p in peaks)} | "
            f"{' / '.join(f'{a / GIB:.2f} GiB' for a in added)} | "
            f"{' / '.join(f'{e / GIB:.2f} GiB' for e in est)} | "
            f"{' / '.join(f'{e / a:.2f}' for e, a in zip(est, added, strict=True))} | "
            f"{' / '.join(f'{p / single_peak:.2f}x' for p in peaks)} | {startup:.0f} s |"
        )
        print(lines[-1], flush=True)
    lines += ["", f"End: {load_note()}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
