"""Data flags of the commands that run a plan: ``--data``, ``--seq-len``, ``--pack`` /
``--pad`` (``train`` and ``verify``) and ``--eval-data`` (``train``).

``--pack`` and ``--pad`` read a documents file (``dapple data prepare --documents``, or a JSONL
file of ids) as :class:`~dapple.datasets.packing.PackedDocuments` (samples of ``--seq-len``
pairs packed from whole documents) or :class:`~dapple.datasets.packing.PaddedDocuments` (one
document per sample, each batch padded to its longest, up to ``--seq-len``); without them a
token file is read as fixed windows.

With ``--data`` the model is built for the data's sequence length: ``--seq-len N`` becomes
the factory argument ``seq=N`` (the zoo transformer's and the Hugging Face models'), unless
``--set seq=`` already says so (:func:`~dapple.api.run_config.seq_len_overrides`, which
the run's configuration applies). Torch-free at import time.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

__all__ = ["add_data_arguments", "add_eval_data_argument"]


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
        "longest a document is cut to (dapple plan --mean-seq-len plans the same lengths: N, "
        "or MEAN,N for padded documents)",
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
