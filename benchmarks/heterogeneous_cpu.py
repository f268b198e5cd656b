"""Unequal per-replica shares on an emulated two-speed CPU cluster (issue #43, item 4).

Three workers: stage 0 (the first ``--layers-0`` layers of an MLP) on ranks 0 and 1, stage 1
(the rest) on rank 2. ``--slowdown`` (``DAPPLE_SLOWDOWN``, :mod:`dapple.runtime.slowdown`)
slows every rank, rank 1 three times more than the others (default ``0:20,1:60,2:20``): each
forward and backward sleeps (K - 1) times its compute, meant to make the emulated compute
dominate the step while the three ranks share the 2 cores little. On this shared 2-core machine
the result was noise (heterogeneous_cpu.md: the compute measured per forward and backward did
not follow the samples under a load of 20+). The same model and batches train under two plans
that differ only in stage 0's shares of each micro-batch:

- even: ``b/2 : b/2``, what a plan that knows nothing of speeds does;
- balanced: :func:`dapple.cost.replica_shares.balanced_shares` for the speeds ``1/K`` of
  ranks 0 and 1 with a time linear in the samples (12:4 of b = 16 for K = 20 and 60).

Rounds alternate even and balanced; each run's step time is the median ``step_ms`` of its steps
after the first two. The ratio is even / balanced (> 1: the balanced shares are faster).
No prediction is made here: the cost model has no per-device speeds yet.

Usage: ``python benchmarks/heterogeneous_cpu.py [--rounds 2 --steps 6 --out
benchmarks/heterogeneous_cpu.md]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header
from dapple import api
from dapple.core.plan import Plan, straight_plan
from dapple.cost.replica_shares import balanced_shares
from dapple.runtime.slowdown import SLOWDOWN_ENV, slowdown_factor


def _plans(args: argparse.Namespace) -> dict[str, Plan]:
    G, M = args.global_batch, args.micro_batches
    base = straight_plan(args.layers, [0, args.layers_0], global_batch_size=G,
                         num_micro_batches=M, replicas=[2, 1])  # fmt: skip
    b = base.micro_batch_size
    speeds = (1.0 / slowdown_factor(0, args.slowdown), 1.0 / slowdown_factor(1, args.slowdown))
    shares = balanced_shares(b, speeds, lambda n: float(n))
    out = {}
    for name, sh in (("even", None), ("balanced", shares)):
        st0 = dataclasses.replace(base.stages[0], shares=sh)
        out[name] = dataclasses.replace(base, stages=(st0, base.stages[1]))
    return out


def _step_ms(plan: Plan, args: argparse.Namespace) -> float:
    # the zoo MLP's chain: its hidden blocks and the classifier head
    wl = api.load("mlp", layers=args.layers - 1, in_features=args.hidden, hidden=args.hidden)
    metrics = api.train(plan, wl, args.steps, device="cpu", optimizer="sgd", lr=1e-3, seed=1,
                        echo=False)  # fmt: skip
    return statistics.median(m.step_ms for m in metrics[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slowdown", default="0:20,1:60,2:20", help="RANK:K,...: rank slow-downs")
    ap.add_argument("--layers", type=int, default=7, help="chain layers (blocks + head)")
    ap.add_argument("--layers-0", type=int, default=4, help="layers of stage 0")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ[SLOWDOWN_ENV] = args.slowdown
    plans = _plans(args)
    runs: dict[str, list[float]] = {name: [] for name in plans}
    for r in range(args.rounds):
        for name, plan in plans.items():
            runs[name].append(_step_ms(plan, args))
            print(f"round {r}: {name} {runs[name][-1]:.1f} ms", flush=True)
    cmd = "python benchmarks/heterogeneous_cpu.py " + " ".join(sys.argv[1:])
    lines = header("Unequal shares on an emulated two-speed CPU cluster (#43)", cmd.strip())
    b = plans["even"].micro_batch_size
    lines += [
        f"Zoo MLP of {args.layers} chain layers (hidden {args.hidden}); stage 0 = layers "
        f"[0, {args.layers_0}) on ranks 0 and 1, stage 1 on rank 2; G = {args.global_batch}, "
        f"M = {args.micro_batches}, b = {b}; ranks slowed by "
        f"`{SLOWDOWN_ENV}={args.slowdown}`; SGD, {args.steps} steps per run, median step_ms "
        "of steps 2 onward.",
        "",
        "| plan | stage-0 shares | "
        + " | ".join(f"round {r} ms" for r in range(args.rounds))
        + " | median ms |",
        "|---|---|" + "---|" * (args.rounds + 1),
    ]
    for name, plan in plans.items():
        sh = plan.stages[0].slice_sizes(b)
        cells = " | ".join(f"{x:.1f}" for x in runs[name])
        lines.append(
            f"| {name} | {sh[0]}:{sh[1]} | {cells} | {statistics.median(runs[name]):.1f} |"
        )
    ratio = statistics.median(runs["even"]) / statistics.median(runs["balanced"])
    pairs = [e / u for e, u in zip(runs["even"], runs["balanced"], strict=True)]
    lines += ["", f"even / balanced: {ratio:.2f} (per round: "
              + ", ".join(f"{p:.2f}" for p in pairs) + ")", ""]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
