"""What metering held activations costs a CPU step: forward + backward of the benchmark model
with the runtime's saved-tensor hooks (:meth:`dapple.runtime.memory.ActivationMeter.saved_tensors_hooks`)
and without, in one process, alternating, paired.

The runtime meters a step only when its batch shapes are new (:class:`dapple.runtime.metrics.StepProbe`
keeps each shape's peak), so a run whose length cycles through a few values pays this cost on
the first step of each length instead of on every step.

Run: ``python benchmarks/metering_cost.py [--pairs 40] [--out benchmarks/metering_cost.md]``
(under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from _bench_common import HERE, bench_transformer, header
from dapple.runtime.memory import ActivationMeter

LENGTHS = (32, 64, 96)
BATCH = 3
"""Samples per forward: a micro-batch of the variable_shapes plan (G = 12, M = 4)."""


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, hooks) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    with hooks:
        loss = loss_fn(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--out", default=str(HERE / "metering_cost.md"))
    args = ap.parse_args(argv)
    wl = bench_transformer(seq=max(LENGTHS))
    model = wl.build_model(0)
    meter = ActivationMeter(exclude=list(model.parameters()))
    rows = []
    for n in LENGTHS:
        tokens = torch.randint(0, 512, (BATCH, n + 1), generator=torch.Generator().manual_seed(n))
        x, y = tokens[:, :-1], tokens[:, 1:]
        for _ in range(3):  # warm-up
            _step(model, x, y, wl.loss_fn, meter.saved_tensors_hooks())
        plain, metered = [], []
        for k in range(args.pairs):  # alternate which goes first
            order = ("plain", "metered") if k % 2 == 0 else ("metered", "plain")
            for kind in order:
                hooks = (
                    meter.saved_tensors_hooks() if kind == "metered" else contextlib.nullcontext()
                )
                (metered if kind == "metered" else plain).append(
                    _step(model, x, y, wl.loss_fn, hooks)
                )
        ratios = [m / p for m, p in zip(metered, plain, strict=True)]
        rows.append((n, statistics.median(plain) * 1e3, statistics.median(metered) * 1e3,
                     statistics.median(ratios)))  # fmt: skip
        print(f"{n} tokens: plain {rows[-1][1]:.1f} ms, metered {rows[-1][2]:.1f} ms, "
              f"paired ratio {rows[-1][3]:.3f}", flush=True)  # fmt: skip
    cmd = f"python benchmarks/metering_cost.py --pairs {args.pairs}"
    lines = header("Metering held activations: cost per forward + backward", cmd)
    lines += [
        f"The benchmark model (10 layers), {BATCH} samples, one process, forward + backward "
        f"with and without the saved-tensor hooks, {args.pairs} alternating pairs per length; "
        "medians.",
        "",
        "| tokens | plain ms | metered ms | metered / plain (median of pairs) |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {p:.1f} | {m:.1f} | {r:.3f} |" for n, p, m, r in rows]
    lines += [
        "",
        "`StepProbe` meters the first step of each distinct batch shape and reuses its peak, "
        "so a run cycling through these lengths pays this once per length; before, it paid "
        "it on every step whose shapes differed from the last metered step (every step of "
        "`variable_shapes.py`'s varying run).",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
