"""Where dapple's per-step gap to a plain loop sits: forward, backward or the rest (issue 46).

``runtime_overhead.py`` pairs each dapple step with a plain step over the same traced pieces
in one process (``_interleaved_ms``: dapple's ``on_step`` runs the plain step), and its
instrumented run times dapple's phases apart from that pairing. This script cuts both sides
of the pairing itself into the same three parts, timed the same way (one ``perf_counter``
pair around each micro-batch's forward and each backward, nothing else wrapped):

- **F**: a micro-batch's forward: slicing, the layers, the loss scaled by its share of the
  batch and its addition to the step's loss sum (dapple: ``StageExecutor.forward``; plain:
  the model, ``loss_fn``, ``x b/G`` and the running total);
- **B**: its backward (dapple: ``StageExecutor.backward``; plain: ``loss.backward()``);
- **rest**: the rest of the step (dapple: from the end of the previous ``on_step`` to its own,
  less its F and B; plain: from ``make_batch`` to after its one loss read, less its F and B):
  the batch, zeroing the gradients and the optimizer step on both sides; dapple also runs the
  program interpreter, the gradient norm, the step's collective, the probes and the metrics
  line.

Variants, each in its own process (their order alternates over ``--rounds``):

- ``shipped``: dapple's defaults (the norm on every step);
- ``no norm``: ``grad_norm_every`` beyond the run's length (the norm on step 0 only, the fused
  finiteness check on the others: a configuration dapple offers);
- ``no norm, probe, tokens``: as ``no norm``, and in this process the resident-memory probe
  and the target-token count replaced by constants. This drops metrics dapple promises: it
  prices them, it is not a configuration.

One torch thread, fp32, fused AdamW, M = 4, the model of ``runtime_overhead.py``. Per part:
the median over the paired steps of each side's ms, and the difference.

Usage::

    python benchmarks/step_gap.py [--model tiny] [--rounds 3] [--steps 60] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _bench_common import git_in, json_child, load_note, write_report

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 10
VARIANTS = ("shipped", "no norm", "no norm, probe, tokens")
PARTS = ("F", "B", "rest")


def child(model: str, variant: str, steps: int) -> dict[str, list[float]]:
    """``steps`` paired steps of ``variant`` after :data:`WARMUP`: per step, each side's ms
    by part (``plain F``, ..., ``dapple rest``)."""
    import torch
    import torch.distributed as dist

    import runtime_overhead as ro
    from dapple.runtime import interpreter, metrics
    from dapple.runtime.optim import make_optimizer
    from dapple.runtime.stage import StageExecutor

    torch.set_num_threads(ro.THREADS)
    size = ro.MODELS[model]
    G, M = size["G"], size["M"]
    b = G // M
    wl, _ = ro._model(size)
    total_steps = WARMUP + steps
    if variant != "shipped":
        ro.GRAD_NORM_EVERY = total_steps
    if variant == "no norm, probe, tokens":
        metrics.StepProbe.resident_peak_bytes = lambda self: 0  # type: ignore[method-assign]
        interpreter.target_token_count = lambda targets: None  # type: ignore[attr-defined]
    clock = time.perf_counter
    model_p = wl.build_model(ro.SEED + 1)
    params = list(model_p.parameters())
    opt = make_optimizer(ro._config(total_steps), params)
    out: dict[str, list[float]] = {f"{s} {p}": [] for s in ("plain", "dapple") for p in PARTS}

    def plain(k: int, keep: bool) -> None:
        """``runtime_overhead._plain_step`` with the F and B marks inline (a timing hook in
        that loop would add calls to the plain side of every other pairing)."""
        t_start = clock()
        f = bw = 0.0
        x, y = wl.make_batch(G, ro.SEED + k)
        for p in params:
            p.grad = None
        total: Any = 0.0
        for m in range(M):
            t0 = clock()
            loss = wl.loss_fn(model_p(x[m * b : (m + 1) * b]), y[m * b : (m + 1) * b]) * (b / G)
            total = total + loss.detach()
            t1 = clock()
            loss.backward()
            t2 = clock()
            f, bw = f + t1 - t0, bw + t2 - t1
        opt.step()
        float(total)  # its one read per step
        whole = clock() - t_start
        if not keep:
            return
        for part, s in (("F", f), ("B", bw), ("rest", whole - f - bw)):
            out[f"plain {part}"].append(s * 1e3)

    acc = {"F": 0.0, "B": 0.0}
    for name, part in (("forward", "F"), ("backward", "B")):
        run = getattr(StageExecutor, name)

        def timed(self: Any, a: Any, run: Any = run, part: str = part) -> None:
            t0 = clock()
            run(self, a)
            acc[part] += clock() - t0

        setattr(StageExecutor, name, timed)
    mark = [0.0]

    def on_step(m: Any) -> None:  # dapple's step m ends here; plain's step m runs next
        now = clock()
        keep = m.step >= WARMUP
        if keep:
            out["dapple F"].append(acc["F"] * 1e3)
            out["dapple B"].append(acc["B"] * 1e3)
            out["dapple rest"].append((now - mark[0] - acc["F"] - acc["B"]) * 1e3)
        plain(m.step, keep)
        acc["F"] = acc["B"] = 0.0
        mark[0] = clock()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ro._dapple(wl, size, total_steps, on_step)
    finally:
        dist.destroy_process_group()
    return out


def run_child(model: str, variant: str, steps: int) -> dict[str, list[float]]:
    """One variant's paired steps, in a process of its own (this checkout's ``src/``)."""
    args = [variant, "--model", model, "--steps", str(steps)]
    result: dict[str, list[float]] = json_child(__file__, ROOT / "src", args, variant)
    return result


def render(
    results: dict[str, list[dict[str, list[float]]]], command: str, loads: list[str]
) -> list[str]:
    """The markdown report: per variant and part, each side's median ms and the difference,
    and the paired ratio of whole steps (plain / dapple)."""
    med = statistics.median
    rows = []
    for variant, runs in results.items():
        cells = {k: [x for r in runs for x in r[k]] for k in runs[0]}
        plain_steps = [sum(t) for t in zip(*(cells[f"plain {p}"] for p in PARTS), strict=True)]
        dapple_steps = [sum(t) for t in zip(*(cells[f"dapple {p}"] for p in PARTS), strict=True)]
        ratios = sorted(p / d for p, d in zip(plain_steps, dapple_steps, strict=True) if d > 0)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        base = med(plain_steps)
        for part in PARTS:
            p, d = med(cells[f"plain {part}"]), med(cells[f"dapple {part}"])
            rows.append(f"| {variant} | {part} | {p:.3f} | {d:.3f} | {d - p:+.3f} | "
                        f"{100 * (d - p) / base:+.1f}% |")  # fmt: skip
        rows.append(f"| {variant} | **step** | {base:.3f} | {med(dapple_steps):.3f} | "
                    f"{med(dapple_steps) - base:+.3f} | paired ratio {med(ratios):.3f} "
                    f"(IQR {q1:.3f}-{q3:.3f}, {len(ratios)} steps) |")  # fmt: skip
    return [
        "# Where dapple's per-step gap to a plain loop sits (issue 46)",
        "",
        f"Command: `{command}`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"commit {git_in(ROOT, 'rev-parse', '--short', 'HEAD')}; {loads[0]} at the start, "
        f"{loads[-1]} at the end.",
        "",
        "Medians over the paired steps of every round, ms per step (F and B: the step's M "
        "micro-batches together). Difference: dapple minus plain, also as a share of the "
        "plain step. Paired ratio: the median over steps of plain / dapple whole-step ms.",
        "",
        "| variant | part | plain ms | dapple ms | difference | share of the plain step |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.steps)))
        return
    loads = [load_note()]
    results: dict[str, list[dict[str, list[float]]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            results[variant].append(run_child(args.model, variant, args.steps))
            print(f"round {r}: {variant} done", flush=True)
    loads.append(load_note())
    command = (f"python benchmarks/step_gap.py --model {args.model} --rounds {args.rounds} "
               f"--steps {args.steps}" + (f" --out {args.out}" if args.out else ""))  # fmt: skip
    write_report(render(results, command, loads), args.out)


if __name__ == "__main__":
    main()
