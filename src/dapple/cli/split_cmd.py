"""``dapple split``: show the layer chain a model is cut into (pieces, boundaries, tied weights).

The flags are read once into a :class:`~dapple.api.splitting.SplitConfig`; :func:`run_config`
runs the chain (:func:`dapple.api.split`) and prints it.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from dapple.api.splitting import SplitConfig
from dapple.cli._console import console, print_table
from dapple.cli._model_args import add_model_arguments, model_config

__all__ = ["register", "run_config", "split_config_of"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("split", help="show the pieces a model is cut into and what flows between")
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=2, help="batch run through the chain")
    p.set_defaults(func=run)


def split_config_of(args: argparse.Namespace) -> SplitConfig:
    """The :class:`SplitConfig` of ``dapple split``'s flags.

    Raises:
        ValidationError: a ``--set`` item without ``=``.
    """
    return SplitConfig(model=model_config(args), batch_size=args.batch_size)


def run(args: argparse.Namespace) -> int:
    return run_config(split_config_of(args))


def run_config(cfg: SplitConfig) -> int:
    """Run ``cfg``'s model chain (:func:`dapple.api.split`) and print its pieces (``dapple
    split`` once its flags are read)."""
    from dapple import api

    chain = api.split(cfg)
    table = Table(title=f"{chain.model}: {chain.num_layers} layers (batch {cfg.batch_size})")
    for col in ("#", "layer", "params", "output", "tied"):
        table.add_column(col, justify="right" if col in ("#", "params") else "left")
    for i, piece in enumerate(chain.pieces):
        table.add_row(
            str(i),
            piece.name,
            f"{piece.params:,}",
            piece.output,
            ", ".join(f"{name} (group {g})" for name, g in piece.tied),
        )
    print_table(console(), table)
    return 0
