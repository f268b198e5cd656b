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
has seen every length), the median over rounds; beside it, tokens per CPU second of the ranks
(their CPU time for the run less that of a warm-up-only run). Attention costs grow with the square of the
length, so ``varying`` does more work per token than ``fixed 64`` at the same mean. The
*same-shapes* comparison divides the varying run's tokens/s by that of the three fixed runs
together (the same steps, each length run fixed: their tokens over their summed step times),
isolating what changing shapes costs the runtime.

Run: ``python benchmarks/variable_shapes.py [--steps 40] [--rounds 2] [--out ...]`` (a few
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import resource
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


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (the spawned ranks)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _train_cpu(plan: Any, wl: Any, steps: int) -> tuple[list[Any], float]:
    t0 = _children_cpu_s()
    metrics = api.train(plan, wl, steps, device="cpu", optimizer="adam", lr=1e-3)
    return metrics, _children_cpu_s() - t0


def _run(plan: Any, kw: dict[str, Any], steps: int) -> tuple[float, float, float, float]:
    """One training run: (tokens/s, ms per step, tokens per step, tokens per CPU second) over
    the steps after the warm-up. The CPU seconds are the ranks' over the whole run less those
    of a run of the warm-up steps alone (start-up, warm-up)."""
    wl = api.load(BENCH_SPEC, **kw)
    _, warm_cpu = _train_cpu(plan, wl, WARMUP)
    metrics, cpu = _train_cpu(plan, wl, steps)
    measured = metrics[WARMUP:]
    tokens = sum(m.tokens or 0 for m in measured)
    ms = sum(m.step_ms for m in measured)
    return tokens / ms * 1e3, ms / len(measured), tokens / len(measured), tokens / (cpu - warm_cpu)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "variable_shapes.md"))
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")
    plan = straight_plan(10, [0, 5], global_batch_size=12, num_micro_batches=4, replicas=[3, 1])
    runs: dict[str, list[tuple[float, float, float, float]]] = {label: [] for label, _ in RUNS}
    for r in range(args.rounds):  # alternate the order: drifting load hits every run alike
        order = RUNS if r % 2 == 0 else RUNS[::-1]
        for label, kw in order:
            runs[label].append(_run(plan, kw, args.steps))
            tps, ms, _, tpc = runs[label][-1]
            print(f"round {r}: {label}: {tps:.0f} tokens/s, {ms:.1f} ms/step, "
                  f"{tpc:.0f} tokens/CPU-s", flush=True)  # fmt: skip
    med = {
        label: tuple(statistics.median(x[k] for x in got) for k in range(4))
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
        "| run | tokens/s | step ms | tokens/step | tokens/s vs fixed 64 | tokens/s per round "
        "| tokens/CPU-s | tokens/CPU-s vs fixed 64 | tokens/CPU-s per round |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    cpu_base = med["fixed 64 (static)"][3]
    for label, (tps, ms, tok, tpc) in med.items():
        walls = ", ".join(f"{x[0]:.0f}" for x in runs[label])
        cpus = ", ".join(f"{x[3]:.0f}" for x in runs[label])
        lines.append(f"| {label} | {tps:.0f} | {ms:.1f} | {tok:.0f} | {tps / base:.3f} | {walls} "
                     f"| {tpc:.0f} | {tpc / cpu_base:.3f} | {cpus} |")  # fmt: skip
    fixed = [med[f"fixed {n} + header"] for n in (32, 64, 96)]
    same_tps = sum(x[2] for x in fixed) / sum(x[1] for x in fixed) * 1e3
    same_tpc = sum(x[2] for x in fixed) / sum(x[2] / x[3] for x in fixed)
    vary = med["varying 32 / 64 / 96 (mean 64)"]
    head = med["fixed 64 + header"]
    lines += [
        "",
        "| comparison | tokens/s ratio | tokens/CPU-s ratio |",
        "|---|---:|---:|",
        f"| shape header (`fixed 64 + header` vs `fixed 64`) | {head[0] / base:.3f} "
        f"| {head[3] / cpu_base:.3f} |",
        f"| equal tokens (`varying` vs `fixed 64`) | {vary[0] / base:.3f} "
        f"| {vary[3] / cpu_base:.3f} |",
        f"| same shapes (`varying` vs the fixed 32, 64 and 96 runs together) "
        f"| {vary[0] / same_tps:.3f} | {vary[3] / same_tpc:.3f} |",
        "",
        "Goal: within 5% (ratio >= 0.95). `equal tokens` also carries how a step's cost "
        "scales with its length (the fixed 32 / 64 / 96 rows show it), not only the runtime. "
        "`same shapes` compares the varying run with the same lengths each run fixed, so its "
        "ratio is what changing shapes from step to step costs the runtime; `shape header` is "
        "the header's cost. tokens/CPU-s divides by the ranks' CPU time instead of wall "
        "time (start-up and warm-up subtracted); waiting ranks spin, so it is disturbed by "
        "other jobs too. The per-round columns show the spread of both.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
