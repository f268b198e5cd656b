"""``dapple split``: show the layer chain a model is cut into (pieces, boundaries, tied weights)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from dapple.cli._console import console, print_table
from dapple.cli._model_args import add_model_arguments, model_overrides
from dapple.errors import ValidationError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("split", help="show the pieces a model is cut into and what flows between")
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=2, help="batch run through the chain")
    p.set_defaults(func=run)


def _describe(value: Any) -> str:
    items = value if isinstance(value, tuple) else (value,)
    return ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]" for t in items
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import check_training_memory

    if args.batch_size < 1:
        raise ValidationError(f"--batch-size must be >= 1, got {args.batch_size}")
    overrides = model_overrides(args)
    workload = load_workload(args.model, **overrides)
    check_training_memory(workload, 0.0, what="splitting")  # the whole model is built below
    tied = {(i, n): g for g, group in enumerate(workload.tied_parameters) for i, n in group}
    chain = workload.build_model(0)
    x, _ = workload.make_batch(args.batch_size, 0)
    table = Table(title=f"{workload.name}: {workload.num_layers} layers (batch {args.batch_size})")
    for col in ("#", "layer", "params", "output", "tied"):
        table.add_column(col, justify="right" if col in ("#", "params") else "left")
    with torch.no_grad():
        for i, piece in enumerate(chain):
            x = piece(x)
            names = [n for n, _ in piece.named_parameters()]
            table.add_row(
                str(i),
                workload.name_of(i),
                f"{sum(p.numel() for p in piece.parameters()):,}",
                _describe(x),
                ", ".join(f"{n} (group {tied[(i, n)]})" for n in names if (i, n) in tied),
            )
    print_table(console(), table)
    return 0
