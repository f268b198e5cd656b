"""Tokens/s with sequence lengths that change every step vs a fixed length, same plan, and the
cost of the transport's shape header.

The benchmark model (zoo transformer, 8 blocks of width 128) trains under a 3:1 plan on 4 local
gloo processes, three ways:

- ``fixed``: 64 tokens every step, static shapes (no shape header);
- ``fixed + header``: 64 tokens every step (position table 96), the token dimension declared
  dynamic (``seq_choices=[64]``), so every activation message carries its shape header - the same
  compute, so the difference is the header's cost;
- ``varying``: 32, 64 or 96 tokens by step (mean 64), with headers.

Each run reports the median tokens/s (target tokens of a step over its time) after a warm-up.
Attention costs grow with the square of the length, so ``varying`` does more work per token
than ``fixed`` at the same mean; the header overhead is the ``fixed + header`` row.

Run: ``python benchmarks/variable_shapes.py [--steps 24] [--out benchmarks/variable_shapes.md]``
(a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from _bench_common import BENCH_SPEC, HERE, header, median_after_warmup
from dapple import api
from dapple.core.plan import straight_plan

WARMUP = 4
RUNS: list[tuple[str, dict[str, Any]]] = [
    ("fixed (64 tokens, static)", {"seq": 64, "seq_choices": None}),
    ("fixed + header (64 tokens, declared dynamic)", {"seq": 96, "seq_choices": [64]}),
    ("varying (32 / 64 / 96 tokens, mean 64)", {"seq": 96, "seq_choices": [32, 64, 96]}),
]


def _step_tokens(seq_choices: list[int] | None, steps: int, batch: int) -> list[int]:
    if not seq_choices:
        return [64 * batch] * steps
    return [seq_choices[t % len(seq_choices)] * batch for t in range(steps)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=str(HERE / "variable_shapes.md"))
    args = ap.parse_args(argv)
    plan = straight_plan(10, [0, 5], global_batch_size=12, num_micro_batches=4, replicas=[3, 1])
    rows = []
    for label, kw in RUNS:
        wl = api.load(BENCH_SPEC, **{k: v for k, v in kw.items() if v is not None})
        metrics = api.train(plan, wl, args.steps, device="cpu", optimizer="adam", lr=1e-3)
        tps = [m.tokens_per_s or 0.0 for m in metrics]
        ms = [m.step_ms for m in metrics]
        tokens = _step_tokens(kw["seq_choices"], args.steps, plan.global_batch_size)
        rows.append((label, median_after_warmup(tps, WARMUP), median_after_warmup(ms, WARMUP),
                     statistics.fmean(tokens[WARMUP:]) if args.steps > WARMUP else 0.0))  # fmt: skip
        print(f"{label}: {rows[-1][1]:.0f} tokens/s, {rows[-1][2]:.1f} ms/step", flush=True)
    base = rows[0][1]
    cmd = f"python benchmarks/variable_shapes.py --steps {args.steps}"
    lines = header("Variable shapes: tokens/s fixed vs varying length, shape header cost", cmd)
    lines += [
        f"Plan 3:1 (layers [0, 5) x 3, [5, 10) x 1), G = {plan.global_batch_size}, "
        f"M = {plan.num_micro_batches}, 4 gloo processes, Adam; {args.steps} steps, median "
        f"after {WARMUP} warm-up steps.",
        "",
        "| run | tokens/s | step ms | mean tokens/step | tokens/s vs fixed |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, tps, ms, tok in rows:
        lines.append(f"| {label} | {tps:.0f} | {ms:.1f} | {tok:.0f} | {tps / base:.3f} |")
    lines += [
        "",
        "`fixed + header` runs the same shapes as `fixed` with a shape header before every "
        "activation message: its ratio is the header's cost (goal: within 5%). `varying` is "
        "not the header's cost alone: attention's cost grows with the square of the length "
        "(96-token steps cost more than 1.5 x 64-token steps), and the runtime meters held "
        "activations (saved-tensor hooks, about 5% of a CPU step) on every step whose shapes "
        "differ from the last, i.e. on every step here.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
