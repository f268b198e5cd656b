"""``dapple split``: show the layer chain a model is cut into (pieces, boundaries, tied weights)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from dapple.errors import ValidationError
from dapple.split import parse_split_at

__all__ = ["add_split_at_argument", "register", "split_at_overrides"]


def add_split_at_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--split-at NAME,NAME`` (module names to cut before) to a command's parser."""
    p.add_argument(
        "--split-at",
        metavar="NAME,NAME",
        help="cut the model before these modules (default: before every block of its largest "
        "ModuleList and after the last one)",
    )


def split_at_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``{"split_at": [...]}`` for ``load_workload(**overrides)``, or ``{}`` if not given."""
    names = parse_split_at(getattr(args, "split_at", None))
    return {"split_at": names} if names else {}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("split", help="show the pieces a model is cut into and what flows between")
    p.add_argument("--model", "-m", required=True, help="module:factory, e.g. dapple.hf:gpt2")
    add_split_at_argument(p)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory argument, e.g. --set layers=8 (repeatable)",
    )
    p.add_argument("--batch-size", type=int, default=2, help="batch run through the chain")
    p.set_defaults(func=run)


def _describe(value: Any) -> str:
    items = value if isinstance(value, tuple) else (value,)
    return ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]" for t in items
    )


def run(args: argparse.Namespace) -> int:
    from dapple.cli.profile_cmd import parse_overrides
    from dapple.zoo import load_workload

    if args.batch_size < 1:
        raise ValidationError(f"--batch-size must be >= 1, got {args.batch_size}")
    overrides = {**parse_overrides(args.set), **split_at_overrides(args)}
    workload = load_workload(args.model, **overrides)
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
    Console().print(table)
    return 0
