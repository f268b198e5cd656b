"""A tiny Hugging Face Mixtral on 4 local CPU processes: the planner's predicted step time and
memory beside ``dapple train``'s measured ones, for the plan the planner picks and its twin:
the same stages with every expert whole (e_s = 1) when the planner sharded experts, else with
the widest expert-parallel width each stage allows.

Everything goes through the CLI, as a user would run it, in a work folder:

1. ``config.json`` of a ``MixtralForCausalLM`` built locally (:data:`CONFIG`; no download);
2. ``dapple calibrate --nproc 4`` (links, core sharing, the runtime's host CPU terms);
3. ``dapple profile -m hf:DIR --co-workers 4`` (layer CPU times as one of 4 workers, the
   expert blocks' router / experts / rest and their load, :mod:`dapple.profiler.moe_measure`);
4. ``dapple plan`` at global batch :data:`BATCH` (the planner's own choice: no width forced);
5. ``dapple train`` of that plan and of its twin, alternating over rounds
   (``--optimizer adamw``, ``--metrics``): the measured step is the median of each run's steps
   after the first :data:`DROP`, then the median over rounds.

Predicted: L (:func:`~dapple.cost.pipeline.pipeline_latency`), the simulated step
(:func:`~dapple.simulate.simulate`, what ``train`` prints as "predicted") and the planner's
memory per replica (the cost model's peak at K_i) beside what ``train`` measured: the held
activations' peak and the resident memory the stage added (VmHWM after building less before).

Usage: ``python benchmarks/moe_cpu.py [--rounds 3 --steps 10 --out benchmarks/moe_cpu.md]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _bench_common import header, load_note, write_report
from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.moe import expert_widths
from dapple.cost.pipeline import pipeline_latency
from dapple.simulate import simulate

CONFIG: dict[str, Any] = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                              max_position_embeddings=64, num_local_experts=8,
                              num_experts_per_tok=2)  # fmt: skip
"""The tiny Mixtral: 4 blocks of 8 experts (top-2), 32 tokens per sample."""
BATCH = 16
"""Global batch (samples per step)."""
DROP = 2
"""Steps of each run left out of its median (start-up, first allocations)."""
MIB = 2**20


def _dapple(*args: str) -> str:
    """``python -m dapple ARGS``; its stdout, raising on failure."""
    done = subprocess.run([sys.executable, "-m", "dapple", *args], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"dapple {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _prepare(work: Path) -> tuple[Path, Path, Path]:
    """The model folder, the calibrated cluster and the co-worker profile."""
    import transformers as tf

    model = work / "mixtral"
    tf.MixtralConfig(**CONFIG).save_pretrained(model)
    cluster, profile = work / "cpu4.json", work / "profile.json"
    _dapple("calibrate", "--nproc", "4", "-o", str(cluster))
    _dapple("profile", "-m", f"hf:{model}", "--co-workers", "4", "--batch-sizes",
            "1,2,4,8,16", "-o", str(profile))  # fmt: skip
    return model, cluster, profile


def _twin(plan: Plan, prof: ModelProfile, cl: Cluster, widest: bool) -> Plan:
    """``plan`` with every stage at e_s = 1, or (``widest``) at the largest width its replicas
    and experts allow (:func:`~dapple.cost.moe.expert_widths`); its L re-costed."""
    stages = tuple(
        dataclasses.replace(
            st, expert_width=expert_widths(prof, st.layers, st.replicas)[-1] if widest else 1
        )
        for st in plan.stages
    )
    twin = dataclasses.replace(plan, stages=stages)
    return dataclasses.replace(twin, predicted_step_ms=pipeline_latency(twin, prof, cl).L_ms)


def _plans(work: Path, profile: Path, cluster: Path) -> dict[str, Path]:
    """The planner's plan and its twin: every e_s = 1 when the planner sharded experts, else
    the widest e_s on each stage."""
    planned = work / "plan.json"
    _dapple("plan", "--profile", str(profile), "--cluster", str(cluster),
            "--global-batch-size", str(BATCH), "-o", str(planned))  # fmt: skip
    plan = Plan.load(planned)
    prof, cl = ModelProfile.load(profile), load_cluster(str(cluster))
    sharded = any(st.expert_width > 1 for st in plan.stages)
    twin = work / "plan_twin.json"
    _twin(plan, prof, cl, widest=not sharded).save(twin)
    if sharded:
        return {"planner's plan (with EP)": planned, "same stages, e_s = 1": twin}
    return {"planner's plan (no EP)": planned, "same stages, widest e_s": twin}


def _train(
    plan: Path, model: Path, profile: Path, cluster: Path, steps: int, out: Path
) -> list[dict[str, Any]]:
    """One ``dapple train`` run; its metrics rows."""
    _dapple("train", "--plan", str(plan), "-m", f"hf:{model}", "--profile", str(profile),
            "--cluster", str(cluster), "--steps", str(steps), "--optimizer", "adamw",
            "--metrics", str(out))  # fmt: skip
    return [json.loads(x) for x in out.read_text().splitlines() if x.strip()]


def _layout(plan: Plan) -> str:
    return "; ".join(
        f"[{st.layers[0]},{st.layers[1]}) {st.replicas}" + (f" e{st.expert_width}" if st.expert_width > 1 else "")
        for st in plan.stages
    ) + f", M={plan.num_micro_batches}"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file to write")
    ap.add_argument("--rounds", type=int, default=3, help="train runs per plan, alternating")
    ap.add_argument("--steps", type=int, default=10, help="steps per train run")
    args = ap.parse_args(argv)
    command = "python benchmarks/moe_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = header("A tiny HF Mixtral on 4 CPU processes: predicted against measured", command)
    work = Path(tempfile.mkdtemp(prefix="dapple-moe-cpu-"))
    model, cluster, profile = _prepare(work)
    plans = _plans(work, profile, cluster)
    prof, cl = ModelProfile.load(profile), load_cluster(str(cluster))
    steps: dict[str, list[float]] = {k: [] for k in plans}
    rows: dict[str, list[dict[str, Any]]] = {}
    loads = [load_note()]
    for r in range(args.rounds):
        order = list(plans) if r % 2 == 0 else list(reversed(plans))
        for name in order:
            out = work / f"m{r}-{list(plans).index(name)}.jsonl"
            got = _train(plans[name], model, profile, cluster, args.steps, out)
            steps[name].append(statistics.median(x["step_ms"] for x in got[DROP:]))
            rows[name] = got
            loads.append(load_note())
    lines += [
        f"Model: `MixtralForCausalLM` from config {CONFIG} (local, random weights), global batch "
        f"{BATCH}; cluster: this machine's `dapple calibrate --nproc 4`; profile: `dapple profile "
        "--co-workers 4` (CPU time of each layer as one of 4 workers). Measured: median of each "
        f"run's steps after the first {DROP}, {args.steps} AdamW steps per run, {args.rounds} "
        "runs per plan alternating; the range is over runs.",
        "",
        "| plan | layout | L ms | simulated ms | measured ms (range) | measured / simulated |",
        "|---|---|---:|---:|---:|---:|",
    ]
    mem = []
    for name, path in plans.items():
        plan = Plan.load(path)
        lat = pipeline_latency(plan, prof, cl)
        sim = simulate(plan, prof, cl).step_ms
        med = statistics.median(steps[name])
        lines.append(f"| {name} | {_layout(plan)} | {lat.L_ms:.1f} | {sim:.1f} | {med:.1f} "
                     f"({min(steps[name]):.1f}-{max(steps[name]):.1f}) | {med / sim:.2f}x |")  # fmt: skip
        last = rows[name][-1]
        est = [r.memory_bytes for r in lat.stages if r.kind == "compute"]
        for s, e in enumerate(est):
            mem.append(f"| {name} | {s} | {e / MIB:.1f} | {last['peak_memory_bytes'][s] / MIB:.1f} "
                       f"| {last['stage_resident_bytes'][s] / MIB:.1f} |")  # fmt: skip
    lines += [
        "",
        "Memory per replica (the last run of each plan): the planner's estimate (parameters, "
        "gradients, AdamW state, K_i micro-batches' activations) beside the measured peak of "
        "held activations and the resident memory the stage added (VmHWM).",
        "",
        "| plan | stage | planner MiB | held activations MiB | resident added MiB |",
        "|---|---:|---:|---:|---:|",
        *mem,
        "",
        "Load during the runs: " + "; ".join(loads[1:]) + ".",
        "",
    ]
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
