"""Data flags of the commands that run a plan: ``--data``, ``--seq-len``, ``--pack`` /
``--pad`` (``train`` and ``verify``) and ``--eval-data`` (``train``).

``--pack`` and ``--pad`` read a documents file (``dapple data prepare --documents``, or a JSONL
file of ids) as :class:`~dapple.datasets.packing.PackedDocuments` (samples of ``--seq-len``
pairs packed from whole documents) or :class:`~dapple.datasets.packing.PaddedDocuments` (one
document per sample, each batch padded to its longest, up to ``--seq-len``); without them a
token file is read as fixed windows.

With ``--data`` the model is built for the data's sequence length: ``--seq-len N`` becomes
the factory argument ``seq=N`` (the zoo transformer's and the Hugging Face models'), unless
``--set seq=`` already says so. Torch-free at import time.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data import Dataset

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
        help="tokens per sample of --data (the model is built with seq=N); with --pad the "
        "longest a document is cut to",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--pack",
        action="store_const",
        const="pack",
        dest="documents",
        help="--data holds documents (prepare --documents, or .jsonl ids): pack them into "
        "samples of --seq-len next-token pairs, no target crossing a document",
    )
    mode.add_argument(
        "--pad",
        action="store_const",
        const="pad",
        dest="documents",
        help="--data holds documents: one per sample, each batch padded to its longest "
        "(the token dimension changes from step to step; padding is masked in the loss)",
    )


def add_eval_data_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--eval-data PATH`` (read with ``--seq-len``)."""
    p.add_argument(
        "--eval-data",
        default=None,
        metavar="PATH",
        help="evaluation token file, read with --seq-len (its first global batches, in order)",
    )


def with_seq_len(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` plus ``seq=--seq-len`` when a data file is given
    (:func:`~dapple.runtime.run_config.seq_len_overrides`).

    Raises:
        ValidationError: ``--seq-len`` without a data file, a data file without ``--seq-len``,
            or ``--set seq=`` disagreeing with ``--seq-len``; ``--pack`` / ``--pad``
            without ``--data``.
    """
    from dapple.runtime.run_config import seq_len_overrides

    return seq_len_overrides(
        overrides,
        data=args.data,
        eval_data=getattr(args, "eval_data", None),
        seq_len=args.seq_len,
        documents=getattr(args, "documents", None),
    )


def open_datasets(args: argparse.Namespace) -> tuple[Dataset[Any] | None, Dataset[Any] | None]:
    """The datasets of ``--data`` and ``--eval-data`` (None where not given): token files, or
    documents packed or padded (``--pack`` / ``--pad``,
    :func:`~dapple.runtime.run_config.open_run_data`).

    Raises:
        ValidationError: a missing, empty or too short file; ``--pack`` / ``--pad`` without
            ``--data``, or on a file without document offsets.
    """
    from dapple.runtime.run_config import check_documents, open_run_data

    mode = getattr(args, "documents", None)
    check_documents(args.data, mode)
    paths = (args.data, getattr(args, "eval_data", None))
    train, evals = (None if x is None else open_run_data(x, args.seq_len, mode) for x in paths)
    return train, evals
