"""A flat binary file of token ids as a map-style dataset of fixed-length windows.

Design choices (the nanoGPT ``train.bin`` convention):
    - the file is the token ids back to back, no header, little-endian ``uint16`` or
      ``uint32``; it is read through ``numpy.memmap``, so opening costs nothing and a
      window reads ``seq_len + 1`` ids;
    - the dtype comes from ``meta.json`` in the same directory (written by
      :func:`dapple.datasets.prepare.prepare`) when that file exists and names one, else
      ``uint16`` - nanoGPT's default, enough for vocabularies up to 65,536;
    - item ``i`` is the window of ``seq_len + 1`` tokens starting at token ``i * seq_len``
      (windows overlap by one token, so every token but the first is a target once):
      ``(window[:-1], window[1:])``, both ``int64`` tensors of ``seq_len`` ids. There are
      ``(n_tokens - 1) // seq_len`` items; the tail that does not fill a window is unused;
    - targets are already the next tokens (``y[t]`` follows ``x[t]``): a loss compares the
      logits at position ``t`` with ``y[t]`` without shifting (the zoo transformer's and
      :func:`dapple.models.hf.causal_lm_loss`), so all ``seq_len`` targets of a window train.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dapple.errors import ValidationError

__all__ = ["DTYPES", "META_NAME", "TokenFile", "read_meta"]

META_NAME = "meta.json"
"""The JSON beside a token file: vocabulary size, dtype, token counts, sources."""
DTYPES = ("uint16", "uint32")
"""Token id dtypes a token file may use."""
_CHUNK_TOKENS = 1 << 24
"""Tokens per read when scanning a whole file (64 MiB of uint32)."""


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.json`` beside token file ``path`` (``{}`` when there is none).

    Raises:
        ValidationError: the meta file exists but is not a JSON object.
    """
    meta = Path(path).with_name(META_NAME)
    if not meta.is_file():
        return {}
    try:
        data = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValidationError(f"unreadable token meta file {meta}: {e}") from e
    if not isinstance(data, dict):
        raise ValidationError(f"token meta file {meta} is not a JSON object")
    return data


class TokenFile(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``seq_len`` next-token pairs over a flat token file (see the module docstring).

    Pickles as its path, ``seq_len`` and dtype (plus the cached maximum id), so spawned
    workers reopen the memmap themselves.

    Args:
        path: the token file.
        seq_len: tokens per sample.
        dtype: ``uint16`` or ``uint32``; ``None``: from ``meta.json`` beside the file, else
            ``uint16``.

    Raises:
        ValidationError: a missing or empty file, a size that is not a whole number of
            tokens, a bad dtype or ``seq_len``, or fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str | None = None) -> None:
        self.path = Path(path)
        meta = read_meta(self.path)
        self.dtype = str(dtype or meta.get("dtype") or "uint16")
        self.vocab_size: int | None = (
            int(meta["vocab_size"]) if isinstance(meta.get("vocab_size"), int) else None
        )
        """The vocabulary the file was tokenized with (from ``meta.json``; None: unknown)."""
        if self.dtype not in DTYPES:
            raise ValidationError(
                f"token dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if seq_len < 1:
            raise ValidationError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        if self.path.is_dir():
            raise ValidationError(f"data file {self.path} is a directory, not a token file")
        if not self.path.is_file():
            raise ValidationError(f"data file {self.path} does not exist")
        try:
            with self.path.open("rb"):
                pass
        except OSError as e:
            raise ValidationError(f"cannot read data file {self.path}: {e.strerror or e}") from None
        size = self.path.stat().st_size
        itemsize = np.dtype(self.dtype).itemsize
        if size == 0:
            raise ValidationError(f"data file {self.path} is empty")
        if size % itemsize:
            raise ValidationError(
                f"data file {self.path}: {size} bytes is not a whole number of {self.dtype} tokens"
            )
        self.n_tokens = size // itemsize
        if self.n_tokens < seq_len + 1:
            raise ValidationError(
                f"data file {self.path} has {self.n_tokens} tokens, fewer than one sample of "
                f"seq_len + 1 = {seq_len + 1}"
            )
        self._mm: np.memmap[Any, Any] | None = None
        self._max_token: int | None = None

    def _tokens(self) -> np.memmap[Any, Any]:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._mm

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"item {i} out of range for {n} items of {self.path}")
        start = i * self.seq_len
        window = np.asarray(self._tokens()[start : start + self.seq_len + 1], dtype=np.int64)
        t = torch.from_numpy(window)
        return t[:-1].clone(), t[1:].clone()

    def max_token(self) -> int:
        """The largest token id in the whole file (scanned in chunks once, then cached)."""
        if self._max_token is None:
            mm = self._tokens()
            best = 0
            for lo in range(0, self.n_tokens, _CHUNK_TOKENS):
                best = max(best, int(mm[lo : lo + _CHUNK_TOKENS].max()))
            self._max_token = best
        return self._max_token

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_mm"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.path)!r}, seq_len={self.seq_len}, dtype={self.dtype!r}: "
            f"{self.n_tokens} tokens, {len(self)} items)"
        )
