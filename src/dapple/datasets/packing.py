"""Documents of a token file as training samples: packed to a length budget, or padded.

A *documents file* is a token file (``train.bin``, see :mod:`dapple.datasets.token_file`) with
the start of every document beside it, ``train.docs.npy`` (``int64``, one entry per document
plus the end; written by ``dapple data prepare --documents``). A JSONL file of token ids
(:func:`dapple.datasets.documents.read_documents`) serves as one too.

Design choices:
    - **Packing** (:class:`PackedDocuments`): every sample is ``seq_len`` next-token pairs.
      Each document contributes its own pairs ``(doc[:-1], doc[1:])``, so no target crosses a
      document boundary and nothing needs masking there; documents are laid into samples in
      file order, a document that does not fit the rest of a sample starts the next one
      (next-fit), and one longer than a sample is cut into pieces of ``seq_len`` pairs. The
      unused tail of a sample is padding (``pad_id`` inputs, :data:`IGNORE_INDEX` targets).
      Attention is not masked: as in nanoGPT, a token may attend to earlier documents of its
      sample. Samples have one shape, so the model's shapes stay static.
    - **Padding** (:class:`PaddedDocuments`): every sample is one document (cut to
      ``seq_len + 1`` tokens); a global batch is padded to its longest document, so the token
      dimension changes from step to step and is declared dynamic (:attr:`dynamic_dims`). The
      lengths are known from the offsets, so a rank reads only its own rows and still pads to
      the batch's width.
    - Both train with :func:`~dapple.datasets.documents.masked_token_loss` (:attr:`loss_fn`):
      each sample's mean over its real targets, so a padded batch has the loss and gradients
      of its documents run unpadded, and a packed sample's loss is the token-weighted mean of
      the losses of the pieces it packs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dapple.datasets.documents import IGNORE_INDEX, masked_token_loss, read_documents
from dapple.datasets.token_file import TokenFile
from dapple.errors import ValidationError

__all__ = [
    "DOCS_SUFFIX",
    "DocumentFile",
    "PackedDocuments",
    "PaddedDocuments",
    "docs_path",
    "open_documents",
    "pack_rows",
]

DOCS_SUFFIX = ".docs.npy"
"""The offsets file beside a documents file: ``train.bin`` -> ``train.docs.npy``."""


def docs_path(path: str | Path) -> Path:
    """The document offsets file beside token file ``path``."""
    p = Path(path)
    return p.with_name(p.stem + DOCS_SUFFIX)


class DocumentFile:
    """The documents of a token file with offsets beside it, or of a JSONL file of ids.

    Pickles as its paths (the memmap and the JSONL documents are read again where used).

    Raises:
        ValidationError: a missing or bad token file, a missing offsets file, offsets that
            do not rise from 0 to the file's token count, or no document of 2 tokens or more.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._docs: list[torch.Tensor] | None = None
        self._tokens: TokenFile | None = None
        if self.path.suffix == ".jsonl":
            docs = read_documents(self.path)
            lengths = np.asarray([d.numel() for d in docs], dtype=np.int64)
            self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        else:
            self._tokens = TokenFile(self.path, 1)
            where = docs_path(self.path)
            if not where.is_file():
                raise ValidationError(
                    f"{self.path} has no document offsets ({where.name} beside it): prepare it "
                    "with `dapple data prepare --documents`"
                )
            self.offsets = np.load(where).astype(np.int64)
            n = self._tokens.n_tokens
            if (
                self.offsets.ndim != 1
                or len(self.offsets) < 2
                or self.offsets[0] != 0
                or self.offsets[-1] != n
                or (np.diff(self.offsets) < 0).any()
            ):
                raise ValidationError(
                    f"{where}: offsets must rise from 0 to the {n} tokens of {self.path}"
                )
        self.lengths = np.diff(self.offsets)
        """Tokens per document."""
        if not (self.lengths >= 2).any():
            raise ValidationError(f"{self.path}: no document has 2 tokens or more")

    @property
    def vocab_size(self) -> int | None:
        return self._tokens.vocab_size if self._tokens is not None else None

    def __len__(self) -> int:
        return len(self.lengths)

    def doc(self, i: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens ``[start, end)`` of document ``i`` (int64)."""
        stop = int(self.lengths[i]) if end is None else end
        if self._tokens is None:
            if self._docs is None:
                self._docs = read_documents(self.path)
            return self._docs[i][start:stop]
        lo = int(self.offsets[i])
        mm = self._tokens._tokens()
        return torch.from_numpy(np.asarray(mm[lo + start : lo + stop], dtype=np.int64))

    def max_token(self) -> int:
        if self._tokens is not None:
            return self._tokens.max_token()
        return max(int(self.doc(i).max()) for i in range(len(self)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_docs": None}


def pack_rows(
    lengths: Sequence[int] | np.ndarray, seq_len: int
) -> list[list[tuple[int, int, int]]]:
    """Documents of ``lengths`` tokens packed next-fit into samples of ``seq_len`` pairs.

    Returns one list per sample of pieces ``(document, first token, end token)``; a piece of
    ``k`` tokens brings ``k - 1`` pairs; a document of more than ``seq_len + 1`` tokens is cut
    into pieces of ``seq_len + 1`` tokens that overlap by one (every target once); documents
    of fewer than 2 tokens bring nothing.
    """
    if seq_len < 1:
        raise ValidationError(f"seq_len must be >= 1, got {seq_len}")
    rows: list[list[tuple[int, int, int]]] = []
    row: list[tuple[int, int, int]] = []
    used = 0
    for d, n in enumerate(int(x) for x in lengths):
        for start in range(0, n - 1, seq_len):
            end = min(n, start + seq_len + 1)
            pairs = end - start - 1
            if used + pairs > seq_len:
                rows.append(row)
                row, used = [], 0
            row.append((d, start, end))
            used += pairs
    if row:
        rows.append(row)
    return rows


class _DocumentSamples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """What packed and padded samples share: the masked loss, real pairs known per sample
    without reading it, and batches whose rows a rank does not read still count them."""

    loss_fn = staticmethod(masked_token_loss)
    docs: DocumentFile
    seq_len: int
    pad_id: int
    path: Path

    def __len__(self) -> int:
        raise NotImplementedError

    def pairs_of(self, i: int) -> int:
        """Real (unpadded) pairs of sample ``i``."""
        raise NotImplementedError

    def width(self, items: Sequence[int]) -> int:
        """Pairs per row of a batch of ``items``."""
        raise NotImplementedError

    def read_rows(
        self, items: Sequence[int], input_rows: Sequence[int], target_rows: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``items``, reading only the rows asked for. Rows whose targets are
        not read hold 0 where the sample has a real pair (as a token file's unread rows do),
        so every rank counts the batch's real target tokens alike."""
        width = self.width(items)
        inputs = torch.full((len(items), width), self.pad_id, dtype=torch.int64)
        targets = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.int64)
        want_x, want_y = set(input_rows), set(target_rows)
        for r, item in enumerate(items):
            if r not in want_x and r not in want_y:
                targets[r, : self.pairs_of(item)] = 0
                continue
            x, y = self[item]
            if r in want_x:
                inputs[r, : x.numel()] = x
            targets[r, : y.numel()] = y if r in want_y else 0
        return inputs, targets

    def max_token(self) -> int:
        return self.docs.max_token()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, seq_len={self.seq_len}: {len(self)} samples)"


class PackedDocuments(_DocumentSamples):
    """Samples of ``seq_len`` next-token pairs packed from documents (module docstring).

    Args:
        docs: the documents.
        seq_len: pairs per sample.
        pad_id: input id of the padding at a sample's end.
    """

    def __init__(self, docs: DocumentFile, seq_len: int, pad_id: int = 0) -> None:
        self.docs, self.seq_len, self.pad_id = docs, seq_len, pad_id
        self.rows = pack_rows(docs.lengths, seq_len)
        self.path = docs.path
        self.dynamic_dims: dict[int, dict[int, tuple[str, int, int]]] = {}
        """None: every sample has ``seq_len`` pairs."""

    def __len__(self) -> int:
        return len(self.rows)

    def pairs_of(self, i: int) -> int:
        return sum(end - start - 1 for _, start, end in self.rows[i])

    def width(self, items: Sequence[int]) -> int:
        return self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        pos = 0
        for d, start, end in self.rows[i]:
            toks = self.docs.doc(d, start, end)
            k = int(toks.numel()) - 1
            inputs[pos : pos + k] = toks[:-1]
            targets[pos : pos + k] = toks[1:]
            pos += k
        return inputs, targets


class PaddedDocuments(_DocumentSamples):
    """One document per sample, cut to ``seq_len + 1`` tokens; batches padded to their longest.

    Args:
        docs: the documents (those of fewer than 2 tokens are left out).
        seq_len: the most pairs a sample has (the model's position table).
        pad_id: input id of the padding.
    """

    def __init__(self, docs: DocumentFile, seq_len: int, pad_id: int = 0) -> None:
        if seq_len < 1:
            raise ValidationError(f"seq_len must be >= 1, got {seq_len}")
        self.docs, self.seq_len, self.pad_id = docs, seq_len, pad_id
        self.index = np.flatnonzero(docs.lengths >= 2)
        self.pairs = np.minimum(docs.lengths[self.index], seq_len + 1) - 1
        self.path = docs.path
        self.dynamic_dims = {0: {1: ("seq", 1, seq_len)}}
        """The token dimension changes from batch to batch, in ``[1, seq_len]`` (the
        ``dynamic_dims`` declaration of :mod:`dapple.models.shapes`)."""

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = self.docs.doc(int(self.index[i]), 0, int(self.pairs[i]) + 1)
        return toks[:-1].clone(), toks[1:].clone()

    def pairs_of(self, i: int) -> int:
        return int(self.pairs[i])

    def width(self, items: Sequence[int]) -> int:
        """The longest sample of the batch (known from the offsets, so a rank reading only
        its rows still pads to the batch's width)."""
        return int(max(self.pairs[list(items)]))


def open_documents(path: str | Path, seq_len: int, mode: str) -> PackedDocuments | PaddedDocuments:
    """The documents at ``path`` as ``mode`` ``"pack"`` or ``"pad"`` samples of ``seq_len``.

    Raises:
        ValidationError: a bad mode or documents file (see :class:`DocumentFile`).
    """
    if mode not in ("pack", "pad"):
        raise ValidationError(f"documents mode must be 'pack' or 'pad', got {mode!r}")
    docs = DocumentFile(path)
    return PackedDocuments(docs, seq_len) if mode == "pack" else PaddedDocuments(docs, seq_len)
