"""What counting the expert load costs: a tiny Mixtral (from its config, never downloaded) in one
process, forward and backward of one batch with the load counters in its MoE blocks
(:mod:`dapple.runtime.parallel.expert.load`: the rows per expert and the router's probabilities
summed on the device) against the same model without them, run alternately.

    python benchmarks/moe_load.py [--rounds 7] [--reps 10] [--out benchmarks/moe_load.md]

Each round times ``--reps`` forward+backward passes of each model (which goes first alternates)
and keeps each model's median; the ratio counted / plain per round is the estimate, its median
over the rounds the result. One process on the CPU: no collective (the counts ride in the step's
existing all_gather in a run, measured in tests/test_expert_load.py as no added host read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench_common import header, load_note
from moe_runtime import CONFIG, SEQ

G = 8


def _time(model: Any, wl: Any, batch: Any, reps: int) -> float:
    """Median ms of ``reps`` forward+backward passes of ``model`` on ``batch``."""
    inputs, targets = batch
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        wl.loss_fn(model(inputs), targets).backward()
        times.append((time.perf_counter() - t) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="markdown file (default: print)")
    a = ap.parse_args()
    import torch
    import transformers as tf

    from dapple.core.plan import straight_plan
    from dapple.models.hf import hf_causal_lm
    from dapple.runtime.parallel.expert import count_expert_load

    torch.set_num_threads(1)
    lines = header(
        "Expert-load counters: forward+backward with and without them (CPU, one process)",
        "python " + " ".join(["benchmarks/moe_load.py", *sys.argv[1:]]),
    )
    with tempfile.TemporaryDirectory() as d:
        tf.MixtralConfig(**CONFIG).save_pretrained(d)
        wl = hf_causal_lm(d, seq=SEQ)
        plain, counted = wl.build_model(0), wl.build_model(0)
    plan = straight_plan(wl.num_layers, [0], global_batch_size=G, num_micro_batches=1)
    loads = count_expert_load(plan, wl, 0, counted, torch.device("cpu"))
    assert loads is not None and len(loads.counters) == 2
    batch = wl.make_batch(G, 0)
    models = {"plain": plain, "counted": counted}
    for m in models.values():  # warm-up, not timed
        _time(m, wl, batch, 2)
    rows, ratios = [], []
    for r in range(a.rounds):
        got = {}
        for name in ("plain", "counted") if r % 2 == 0 else ("counted", "plain"):
            got[name] = _time(models[name], wl, batch, a.reps)
        ratios.append(got["counted"] / got["plain"])
        rows.append(f"| {r} | {got['plain']:.1f} | {got['counted']:.1f} | {ratios[-1]:.3f}x |")
    lines += [
        f"Tiny Mixtral ({CONFIG}), {SEQ} tokens per sample, a batch of {G}: 2 MoE blocks "
        "counted; torch on 1 thread.",
        "",
        "| round | plain ms | counted ms | counted / plain |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
        f"Median ratio counted / plain: {statistics.median(ratios):.3f}x (rounds ranged "
        f"{min(ratios):.3f}x to {max(ratios):.3f}x; this tiny model on this loaded CPU only).",
        "",
        f"End: {load_note()}.",
    ]
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
