"""Measured step time of expert parallelism in the runtime on this CPU: a tiny Mixtral (from its
config, never downloaded) on a 1:2:1 plan whose middle stage holds both MoE blocks, with
expert_width 1 (every replica holds every expert) and 2 (each holds half, tokens exchanged by
all-to-all), run alternately in one group of 4 gloo processes.

    python benchmarks/moe_runtime.py [--rounds 3] [--steps 6] [--out benchmarks/moe_runtime.md]

After one untimed warm-up run of each width, each run trains ``--steps`` AdamW steps; a run's
time is the median of rank 0's ``step_ms`` after the first step; the rounds alternate which
width runs first, so both see the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from _bench_common import header, load_note, median_after_warmup

CONFIG: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip
"""The tiny Mixtral: 2 MoE blocks of 8 experts (top-2), hidden 64."""
SEQ, G, M = 32, 8, 2
WIDTHS = (1, 2)


def _plan(e: int) -> Any:
    from dapple.core.plan import straight_plan

    plan = straight_plan(4, [0, 1, 3], global_batch_size=G, num_micro_batches=M,
                         replicas=[1, 2, 1])  # fmt: skip
    mid = replace(plan.stages[1], expert_width=e)
    return replace(plan, stages=(plan.stages[0], mid, plan.stages[2]))


def worker(rank: int, world: int, model_dir: str, rounds: int, steps: int, out: str) -> None:
    from dapple.models.hf import hf_causal_lm
    from dapple.runtime import TrainConfig, init_distributed, run_plan

    device = init_distributed(TrainConfig(timeout_s=300), world)
    wl = hf_causal_lm(model_dir, seq=SEQ)
    times: dict[str, list[float]] = {str(e): [] for e in WIDTHS}
    cfg = TrainConfig(steps=steps, optimizer="adamw", lr=1e-3, timeout_s=300)
    for e in WIDTHS:  # warm-up runs, not timed
        run_plan(_plan(e), wl, replace(cfg, steps=2), device=device)
    for r in range(rounds):
        for e in WIDTHS if r % 2 == 0 else WIDTHS[::-1]:
            run = run_plan(_plan(e), wl, cfg, device=device)
            times[str(e)].append(median_after_warmup([m.step_ms for m in run.metrics], 1))
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None, help="markdown file (default: print)")
    a = ap.parse_args()
    import transformers as tf

    from dapple.runtime import spawn

    lines = header(
        "Expert parallelism in the runtime: step time with e_s = 2 against 1 (CPU)",
        "python " + " ".join(["benchmarks/moe_runtime.py", *sys.argv[1:]]),
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    lines.insert(-1, f"- commit: {commit or 'unknown'} (plus any uncommitted edits of others)")
    with tempfile.TemporaryDirectory() as d:
        tf.MixtralConfig(**CONFIG).save_pretrained(d)
        res = Path(d, "times.json")
        spawn(worker, 4, d, a.rounds, a.steps, str(res), timeout_s=1800)
        times = {int(k): v for k, v in json.loads(res.read_text()).items()}
    lines += [
        f"Tiny Mixtral ({CONFIG}), {SEQ} tokens per sample, G={G}, M={M}, plan 1:2:1 (layers "
        "[0,1) | [1,3) | [3,4)), the middle stage's two replicas (slices of 2 samples) at "
        f"expert_width 1 and 2; {a.rounds} rounds of {a.steps} AdamW steps per width; "
        "4 gloo processes on this machine.",
        "",
        "| round | e_s = 1 ms/step | e_s = 2 ms/step | e_s=2 / e_s=1 |",
        "|---:|---:|---:|---:|",
    ]
    ratios = []
    for r in range(a.rounds):
        one, two = times[1][r], times[2][r]
        ratios.append(two / one)
        lines.append(f"| {r} | {one:.1f} | {two:.1f} | {two / one:.3f}x |")
    lines += ["", f"Median ratio e_s=2 / e_s=1: {statistics.median(ratios):.3f}x (rounds ranged "
              f"{min(ratios):.3f}x to {max(ratios):.3f}x: under this load a round's ratio is "
              "noise-dominated; the median is the estimate and the range its uncertainty, for "
              "this tiny model on this CPU only).", "",
              f"End: {load_note()}."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
