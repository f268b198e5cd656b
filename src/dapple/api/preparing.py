"""The Python API's data side: one typed :class:`PrepareConfig` behind ``dapple data prepare``
and :func:`prepare_data`.

``dapple data prepare``'s flags are read once into a :class:`PrepareConfig`;
``prepare_data(cfg)`` tokenizes the text files it names into token files for training
(:func:`dapple.datasets.prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapple.datasets.prepare import Prepared

__all__ = ["PrepareConfig", "prepare_data"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareConfig:
    """What ``dapple data prepare`` is asked for: the text files and the token files to write."""

    text_files: tuple[str, ...]
    """UTF-8 text files, concatenated in this order."""
    output: str
    """The training token file (``val.bin`` and ``meta.json`` go beside it)."""
    val_fraction: float = 0.01
    """Share of the tokens (the last ones) for the validation file, in ``[0, 1)``."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (None: bytes, vocabulary 256)."""
    documents: bool = False
    """The inputs are documents: write their offsets beside each split."""


def prepare_data(cfg: PrepareConfig) -> Prepared:
    """Tokenize ``cfg.text_files`` into the token files ``cfg`` names; an input that is not
    UTF-8 text is refused before anything is tokenized (:func:`dapple.datasets.prepare`
    with ``text=True``).

    Raises:
        ValidationError: as :func:`dapple.datasets.prepare`.
    """
    from dapple.datasets import prepare

    return prepare(
        cfg.text_files,
        cfg.output,
        cfg.val_fraction,
        cfg.tokenizer,
        documents=cfg.documents,
        text=True,
    )
