"""``dapple data prepare``: text files -> token files for ``dapple train --data``.

Writes the training split at ``--output`` (e.g. ``data/train.bin``), the last
``--val-fraction`` of the tokens to ``val.bin`` beside it, and ``meta.json`` (vocabulary,
dtype, token counts, sources). Tokens are bytes (vocabulary 256) unless ``--tokenizer DIR``
names a local Hugging Face tokenizer. With ``--documents`` each ``{"text": ...}`` line of a
``.jsonl`` input (or each other input file) is a document, and ``train.docs.npy`` /
``val.docs.npy`` beside the splits hold where each starts (``train --pack`` / ``--pad``).
An input that is not UTF-8 text (binary data), an output path that cannot be written, an
output that is one of the inputs, or an existing output that no ``meta.json`` beside it says
this command wrote, is refused before anything is tokenized.
"""

from __future__ import annotations

import argparse

from dapple.api.preparing import PrepareConfig
from dapple.cli._console import plain_doc
from dapple.errors import ValidationError

__all__ = ["prepare_config_of", "register", "run_config", "run_prepare"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "data",
        help="prepare token files for training (dapple data prepare ...)",
        description=plain_doc(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ops = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = ops.add_parser(
        "prepare",
        help="tokenize text files into train.bin, val.bin and meta.json",
        description=plain_doc(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("text_files", nargs="+", metavar="TEXT_FILE", help="UTF-8 text files")
    prep.add_argument(
        "-o", "--output", required=True, help="training token file, e.g. data/train.bin"
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="share of the tokens (the last ones) for val.bin (default %(default)s)",
    )
    prep.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a local Hugging Face tokenizer directory (default: bytes, vocabulary 256)",
    )
    prep.add_argument(
        "--documents",
        action="store_true",
        help='the inputs are documents (each {"text": ...} line of a .jsonl file, each other '
        "file whole): write their offsets beside each split (train.docs.npy) for "
        "train --data ... --pack / --pad; the validation split is whole documents",
    )
    prep.set_defaults(func=run_prepare)


def prepare_config_of(args: argparse.Namespace) -> PrepareConfig:
    """The :class:`~dapple.api.preparing.PrepareConfig` of ``dapple data prepare``'s flags."""
    return PrepareConfig(
        text_files=tuple(args.text_files),
        output=args.output,
        val_fraction=args.val_fraction,
        tokenizer=args.tokenizer,
        documents=args.documents,
    )


def run_prepare(args: argparse.Namespace) -> int:
    return run_config(prepare_config_of(args))


def run_config(cfg: PrepareConfig) -> int:
    """Write the token files ``cfg`` asks for (:func:`dapple.api.prepare_data`) and say what
    they hold (``dapple data prepare`` once its flags are read)."""
    from dapple import api

    if not 0 <= cfg.val_fraction < 1:  # the library's check names its argument
        raise ValidationError(f"--val-fraction must be in [0, 1), got {cfg.val_fraction}")
    out = api.prepare_data(cfg)
    print(
        f"{out.train}: {out.train_tokens:,} tokens; {out.val}: {out.val_tokens:,} tokens; "
        f"vocabulary {out.vocab_size:,} ({out.dtype}); {out.meta}"
    )
    return 0
