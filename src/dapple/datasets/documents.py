"""Variable-length documents: a JSONL file of token ids, padded batches and the masked loss.

Each line of a documents file is one document, ``{"ids": [3, 17, ...]}`` or a bare list of ids.
:func:`pad_batch` turns documents into one next-token batch padded to its longest document:
inputs are ``doc[:-1]`` padded with ``pad_id``, targets ``doc[1:]`` padded with
:data:`IGNORE_INDEX`. :func:`masked_token_loss` averages each sample's cross-entropy over its
own (unpadded) tokens and then over the samples, so a padded batch gives the same loss and
gradients as its documents run one by one without padding, for a causal model (a position
sees no later one, so padding after a document changes none of its logits).
:class:`DocumentBatches` is a ``make_batch`` over a documents file (``batch_size`` documents
drawn by the seed), for a :class:`~dapple.models.workload.Workload` whose sequence length then
changes from step to step: declare it, ``dynamic_dims={0: {1: DynamicDim("seq", 1, max_len)}}``
(:mod:`dapple.models.shapes`), as a few draws may happen to agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from dapple.errors import ValidationError

__all__ = [
    "IGNORE_INDEX",
    "DocumentBatches",
    "json_rows",
    "masked_token_loss",
    "pad_batch",
    "read_documents",
]

IGNORE_INDEX = -100
"""Target id of a padding position (``F.cross_entropy``'s ``ignore_index``)."""


def json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSON Lines file.

    Raises:
        ValidationError: a line is not JSON (the message names the file and line).
    """
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValidationError(f"{path}:{n}: not JSON ({e})") from e
        yield n, row


def read_documents(path: str | Path, vocab: int | None = None) -> list[torch.Tensor]:
    """The documents of a JSONL file, each an int64 tensor of its token ids.

    Raises:
        ValidationError: a missing file, a line that is not ``{"ids": [...]}`` or a list of
            ints, a document of fewer than 2 tokens, or an id outside ``[0, vocab)`` (the
            message names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise ValidationError(f"documents file {str(p)!r} does not exist")
    docs: list[torch.Tensor] = []
    for n, row in json_rows(p):
        ids = row.get("ids") if isinstance(row, dict) else row
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValidationError(f'{p}:{n}: expected {{"ids": [int, ...]}} or [int, ...]')
        if len(ids) < 2:
            raise ValidationError(f"{p}:{n}: a document needs at least 2 tokens, got {len(ids)}")
        if vocab is not None and any(not 0 <= i < vocab for i in ids):
            raise ValidationError(f"{p}:{n}: token id outside the vocabulary [0, {vocab})")
        docs.append(torch.tensor(ids, dtype=torch.int64))
    if not docs:
        raise ValidationError(f"documents file {str(p)!r} holds no document")
    return docs


def pad_batch(docs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token ``(inputs, targets)`` of ``docs``, padded to the longest: ``(n, L - 1)`` each,
    ``L`` the longest document; padding is ``pad_id`` in inputs and :data:`IGNORE_INDEX` in
    targets."""
    width = max(int(d.numel()) for d in docs) - 1
    inputs = torch.full((len(docs), width), pad_id, dtype=torch.int64)
    targets = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.int64)
    for r, d in enumerate(docs):
        k = int(d.numel()) - 1
        inputs[r, :k] = d[:-1]
        targets[r, :k] = d[1:]
    return inputs, targets


def masked_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over samples of each sample's mean cross-entropy over its unpadded tokens.

    ``logits`` ``(n, seq, vocab)``, ``targets`` ``(n, seq)`` with :data:`IGNORE_INDEX` at the
    padding. The per-sample mean keeps the :class:`~dapple.models.workload.Workload` loss
    convention (a slice of ``k`` of ``G`` samples contributes ``loss * k / G``).
    """
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).reshape(targets.shape)
    counts = (targets != IGNORE_INDEX).sum(1).clamp(min=1)
    return (per_token.sum(1) / counts).mean()


class DocumentBatches:
    """``make_batch(batch_size, seed)`` over a documents file: ``batch_size`` documents drawn
    with replacement under ``seed``, each cut to ``max_len + 1`` tokens, padded
    (:func:`pad_batch`). Picklable (it keeps the path and reads the file once per process)."""

    def __init__(
        self, path: str | Path, max_len: int, pad_id: int = 0, vocab: int | None = None
    ) -> None:
        if max_len < 1:
            raise ValidationError(f"max_len must be >= 1, got {max_len}")
        self.path, self.max_len, self.pad_id, self.vocab = str(path), max_len, pad_id, vocab
        self._docs: list[torch.Tensor] | None = None
        self.docs()  # errors now, not in a worker

    def docs(self) -> list[torch.Tensor]:
        if self._docs is None:
            self._docs = read_documents(self.path, self.vocab)
        return self._docs

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_docs": None}

    def __call__(self, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        docs = self.docs()
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, len(docs), (batch_size,), generator=g).tolist()
        return pad_batch([docs[r][: self.max_len + 1] for r in rows], self.pad_id)
