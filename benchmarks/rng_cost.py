"""What plan-independent dropout costs: keyed masks against PyTorch's own dropout, same pieces.

A GPT-2 from its config (dropout 0.1 on embeddings, residuals and attention) is traced and cut
as dapple runs it; each step's forward and backward of the whole chain of pieces runs in three
variants, interleaved round by round in one process:

- ``keyed``: the pieces as dapple runs them (:mod:`dapple.models.rng`: masks hashed from seed,
  step, site and sample; attention with dropout as its math formulation);
- ``native``: the same pieces with every random site swapped for ``nn.Dropout`` and PyTorch's
  ``scaled_dot_product_attention`` with its own dropout (the process's generator);
- ``off``: the same pieces with every random site off (no dropout), the floor.

Reported: the median step time of each (ms) and the ratios, and the bytes autograd keeps for the
backward (saved tensors, one step).

    python benchmarks/rng_cost.py [-o benchmarks/rng_cost.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from _bench_common import header, write_report  # noqa: E402
from dapple import api  # noqa: E402
from dapple.models.rng import KeyedAttention, KeyedDropout, keyed  # noqa: E402

ROUNDS = 7


class _NativeAttention(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(*args, **kwargs)


def _variant(model: nn.Module, kind: str) -> nn.Module:
    out = copy.deepcopy(model)
    for piece in out:
        for name, mod in list(piece.named_children()):
            if isinstance(mod, KeyedDropout) and kind == "native":
                setattr(piece, name, nn.Dropout(mod.p))
            elif isinstance(mod, KeyedAttention) and kind == "native":
                setattr(piece, name, _NativeAttention())
            elif isinstance(mod, (KeyedDropout, KeyedAttention)) and kind == "off":
                mod.eval()  # the site only: the rest of the piece stays in training mode
    return out


def _step(model: nn.Module, batch: tuple[Any, Any], loss_fn: Any, step: int) -> float:
    """One forward and backward; seconds."""
    inputs, targets = batch
    t0 = time.perf_counter()
    with keyed(0, step, 0, targets.shape[0]):
        loss_fn(model(inputs), targets).backward()
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - t0


def _saved_bytes(model: nn.Module, batch: tuple[Any, Any]) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    inputs, targets = batch
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with keyed(0, 0, 0, targets.shape[0]), hooks:
        model(inputs)
    return total


def _measure(seq: int, batch: int, hidden: int, layers: int) -> list[str]:
    wl = api.load(
        "dapple.models.hf:gpt2", layers=layers, hidden=hidden, heads=4, vocab=512, seq=seq,
        dropout=0.1,
    )  # fmt: skip
    keyed_model = wl.build_model(0).train()
    models = {k: _variant(keyed_model, k) for k in ("off", "native", "keyed")}
    data = wl.make_batch(batch, 0)
    times: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        _step(m, data, wl.loss_fn, 0)  # warm-up
    for r in range(ROUNDS):
        for k, m in models.items():
            times[k].append(_step(m, data, wl.loss_fn, r + 1))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    mem = {k: _saved_bytes(m, data) / 2**20 for k, m in models.items()}
    return [
        f"| {layers} x {hidden}, seq {seq}, batch {batch} | {ms['off']:.1f} | {ms['native']:.1f} | "
        f"{ms['keyed']:.1f} | {ms['keyed'] / ms['native']:.2f} | {ms['native'] / ms['off']:.2f} | "
        f"{mem['off']:.1f} / {mem['native']:.1f} / {mem['keyed']:.1f} |"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-o", "--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = header(
        "Plan-independent dropout: cost per step",
        "python benchmarks/rng_cost.py" + (f" -o {args.out}" if args.out else ""),
    )
    lines += [
        f"GPT-2 from its config, dropout 0.1 everywhere (embeddings, residuals, attention), one "
        f"process, 1 thread; forward + backward of the whole chain of traced pieces, median of "
        f"{ROUNDS} rounds after a warm-up, the three variants interleaved round by round.",
        "",
        "| model | off (ms) | native (ms) | keyed (ms) | keyed / native | native / off "
        "| saved for backward off / native / keyed (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for seq, batch, hidden, layers in [(64, 8, 128, 4), (128, 8, 256, 4), (256, 4, 256, 4)]:
        lines += _measure(seq, batch, hidden, layers)
        print(lines[-1], flush=True)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
