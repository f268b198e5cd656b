"""Tokens/s with sequence lengths that change every step vs a fixed length, same plan, and the
cost of the transport's shape header.

The benchmark model (zoo transformer, 8 blocks of width 128) trains under a 3:1 plan on 4 local
gloo processes, five ways, in alternating rounds:

- ``fixed 64``: 64 tokens every step, static shapes (no shape header);
- ``fixed 64 + header``: 64 tokens every step (position table 96), the token dimension
  declared dynamic (``seq_choices=[64]``), so every activation message carries its shape
  header - the same compute, so the difference is the header's cost;
- ``fixed 32 + header`` and ``fixed 96 + header``: the other lengths of the varying run, each
  held fixed;
- ``varying``: 32, 64 or 96 tokens by step (mean 64), with headers.

Throughput is the target tokens of the measured steps over their time (after a warm-up that
has seen every length), the median over rounds. Attention costs grow with the square of the
length, so ``varying`` does more work per token than ``fixed 64`` at the same mean. The
*same-shapes* comparison divides the varying run's tokens/s by that of the three fixed runs
together (the same steps, each length run fixed: their tokens over their summed step times),
isolating what changing shapes costs the runtime.

Run: ``python benchmarks/variable_shapes.py [--steps 28] [--rounds 2] [--out ...]`` (a few
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from _bench_common import BENCH_SPEC, HERE, header
from dapple import api
from dapple.core.plan import straight_plan

WARMUP = 4
"""Steps left out of each run: the first of each length allocate and meter."""
RUNS: list[tuple[str, dict[str, Any]]] = [
    ("fixed 64 (static)", {"seq": 64}),
    ("fixed 64 + header", {"seq": 96, "seq_choices": [64]}),
    ("fixed 32 + header", {"seq": 96, "seq_choices": [32]}),
    ("fixed 96 + header", {"seq": 96, "seq_choices": [96]}),
    ("varying 32 / 64 / 96 (mean 64)", {"seq": 96, "seq_choices": [32, 64, 96]}),
]


def _run(plan: Any, kw: dict[str, Any], steps: int) -> tuple[float, float, float]:
    """One training run: (tokens/s, ms per step, tokens per step) over the steps after the
    warm-up."""
    wl = api.load(BENCH_SPEC, **kw)
    metrics = api.train(plan, wl, steps, device="cpu", optimizer="adam", lr=1e-3)[WARMUP:]
    tokens = sum(m.tokens or 0 for m in metrics)
    ms = sum(m.step_ms for m in metrics)
    return tokens / ms * 1e3, ms / len(metrics), tokens / len(metrics)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "variable_shapes.md"))
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")
    plan = straight_plan(10, [0, 5], global_batch_size=12, num_micro_batches=4, replicas=[3, 1])
    runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in RUNS}
    for r in range(args.rounds):  # alternate the order: drifting load hits every run alike
        order = RUNS if r % 2 == 0 else RUNS[::-1]
        for label, kw in order:
            runs[label].append(_run(plan, kw, args.steps))
            tps, ms, _ = runs[label][-1]
            print(f"round {r}: {label}: {tps:.0f} tokens/s, {ms:.1f} ms/step", flush=True)
    med = {
        label: tuple(statistics.median(x[k] for x in got) for k in range(3))
        for label, got in runs.items()
    }
    base = med["fixed 64 (static)"][0]
    cmd = f"python benchmarks/variable_shapes.py --steps {args.steps} --rounds {args.rounds}"
    lines = header("Variable shapes: tokens/s fixed vs varying length, shape header cost", cmd)
    lines += [
        f"Plan 3:1 (layers [0, 5) x 3, [5, 10) x 1), G = {plan.global_batch_size}, "
        f"M = {plan.num_micro_batches}, 4 gloo processes, Adam; {args.steps} steps per run, "
        f"the first {WARMUP} left out; tokens/s = target tokens / time of the measured steps, "
        f"median of {args.rounds} alternating rounds.",
        "",
        "| run | tokens/s | step ms | tokens/step | tokens/s vs fixed 64 | per round |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, (tps, ms, tok) in med.items():
        rounds = ", ".join(f"{x[0]:.0f}" for x in runs[label])
        lines.append(
            f"| {label} | {tps:.0f} | {ms:.1f} | {tok:.0f} | {tps / base:.3f} | {rounds} |"
        )
    fixed = [med[f"fixed {n} + header"] for n in (32, 64, 96)]
    same_tps = sum(t for _, _, t in fixed) / sum(ms for _, ms, _ in fixed) * 1e3
    vary = med["varying 32 / 64 / 96 (mean 64)"][0]
    header_ratio = med["fixed 64 + header"][0] / base
    lines += [
        "",
        f"- shape header (`fixed 64 + header` vs `fixed 64`): {header_ratio:.3f}",
        f"- equal tokens (`varying` vs `fixed 64`): {vary / base:.3f}",
        f"- same shapes (`varying` vs the fixed 32, 64 and 96 runs together, "
        f"{same_tps:.0f} tokens/s): {vary / same_tps:.3f}",
        "",
        "Goal: within 5% (ratio >= 0.95). `equal tokens` includes attention's quadratic cost: "
        "a 96-token step costs more than 1.5 64-token steps, so a run whose lengths vary "
        "around 64 does more work per token than one at 64. `same shapes` compares the "
        "varying run with the same lengths each run fixed, so its ratio is what changing "
        "shapes from step to step costs the runtime; `shape header` is the header's cost.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
