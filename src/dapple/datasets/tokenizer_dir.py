"""A local Hugging Face tokenizer directory (``--tokenizer DIR`` of ``data prepare`` and
``generate``), checked before ``transformers`` reads it and loaded offline, every failure one
line naming the directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapple.errors import ValidationError, one_line

__all__ = ["TOKENIZER_FILES", "check_tokenizer_dir", "load_hf_tokenizer"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
    "bpe.codes",
)
"""Files ``transformers`` tokenizers save with ``save_pretrained``: the shared ones
(``tokenizer.json``, ``tokenizer_config.json``, special and added tokens, chat templates) and
the vocabulary files of the tokenizer classes (BPE ``vocab.json`` + ``merges.txt``, WordPiece
``vocab.txt``, SentencePiece ``*.model``)."""


def check_tokenizer_dir(where: str | Path) -> Path:
    """``where`` as a :class:`~pathlib.Path` once it is a directory holding at least one of
    :data:`TOKENIZER_FILES`.

    Raises:
        ValidationError: no such directory, a file, or a directory with no tokenizer file.
    """
    d = Path(where)
    if not d.is_dir():
        what = "is a file, not a directory" if d.exists() else "does not exist"
        raise ValidationError(f"tokenizer directory {d} {what}")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise ValidationError(
            f"tokenizer directory {d} holds no tokenizer file (tokenizer.json, "
            "tokenizer_config.json, vocab.json, tokenizer.model...: what save_pretrained writes)"
        )
    return d


def load_hf_tokenizer(where: str | Path) -> Any:
    """The ``transformers`` tokenizer saved in ``where`` (:func:`check_tokenizer_dir`), offline.

    Raises:
        ValidationError: a bad directory, no ``transformers``, or files it cannot load.
    """
    d = check_tokenizer_dir(where)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is an optional dependency
        raise ValidationError("a Hugging Face tokenizer needs: pip install 'dapple[hf]'") from e
    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # OSError, ValueError, JSON and tokenizers' own errors
        raise ValidationError(f"cannot load a tokenizer from {d}: {one_line(e)}") from e
