"""Data flags of the commands that run a plan: ``--data``, ``--seq-len`` (``train`` and
``verify``) and ``--eval-data`` (``train``).

With ``--data`` the model is built for the data's sequence length: ``--seq-len N`` becomes
the factory argument ``seq=N`` (the zoo transformer's and the Hugging Face models'), unless
``--set seq=`` already says so. Torch-free at import time.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from dapple.errors import ValidationError

if TYPE_CHECKING:
    from dapple.datasets import TokenFile

__all__ = ["add_data_arguments", "add_eval_data_argument", "open_datasets", "with_seq_len"]


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--data PATH`` and ``--seq-len N`` to ``p``."""
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="train on this token file (`dapple data prepare`; default: the model's synthetic "
        "batches); step t takes the next global batch of a seeded per-epoch shuffle",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sample of --data (the model is built with seq=N)",
    )


def add_eval_data_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--eval-data PATH`` (read with ``--seq-len``)."""
    p.add_argument(
        "--eval-data",
        default=None,
        metavar="PATH",
        help="evaluation token file, read with --seq-len (its first global batches, in order)",
    )


def _paths(args: argparse.Namespace) -> list[str]:
    return [x for x in (args.data, getattr(args, "eval_data", None)) if x is not None]


def with_seq_len(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` plus ``seq=--seq-len`` when a data file is given.

    Raises:
        ValidationError: ``--seq-len`` without a data file, a data file without ``--seq-len``,
            or ``--set seq=`` disagreeing with ``--seq-len``.
    """
    if not _paths(args):
        if args.seq_len is not None:
            raise ValidationError("--seq-len applies to --data / --eval-data; give a data file")
        return overrides
    if args.seq_len is None:
        raise ValidationError("--data / --eval-data need --seq-len N (tokens per sample)")
    if args.seq_len < 1:
        raise ValidationError(f"--seq-len must be >= 1, got {args.seq_len}")
    if "seq" in overrides and overrides["seq"] != args.seq_len:
        raise ValidationError(
            f"--set seq={overrides['seq']} disagrees with --seq-len {args.seq_len}"
        )
    return {**overrides, "seq": args.seq_len}


def open_datasets(args: argparse.Namespace) -> tuple[TokenFile | None, TokenFile | None]:
    """The token files of ``--data`` and ``--eval-data`` (None where not given).

    Raises:
        ValidationError: a missing, empty or too short file.
    """
    from dapple.datasets import TokenFile

    data = TokenFile(args.data, args.seq_len) if args.data is not None else None
    path = getattr(args, "eval_data", None)
    return data, (TokenFile(path, args.seq_len) if path is not None else None)
