"""The demo's corpus: Python standard library sources as byte tokens, and their entropy.

Every machine that runs dapple has the standard library's ``.py`` files, so the demo trains on
real text without downloading anything. The unigram byte entropy of the training tokens is the
loss a model that ignores context cannot beat; a language model that learns anything goes
below it.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np

from dapple.errors import ValidationError

__all__ = ["nats_to_bits", "stdlib_files", "stdlib_sources", "unigram_entropy"]


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's directory and its top-level ``.py`` files in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, sorted(p for p in root.glob("*.py") if p.is_file())


def stdlib_sources(limit_bytes: int) -> list[Path]:
    """The standard library's top-level ``.py`` files in name order, up to ``limit_bytes``.

    Raises:
        ValidationError: the standard library's sources are not on this machine.
    """
    root, files = stdlib_files()
    picked: list[Path] = []
    total = 0
    for p in files:
        size = p.stat().st_size
        if picked and total + size > limit_bytes:
            break
        picked.append(p)
        total += size
    if not picked:
        raise ValidationError(f"no Python standard library sources (*.py) under {root}")
    return picked


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """``H = -sum_v p_v ln p_v`` in nats per token, ``p_v`` the frequency of token ``v``: the
    cross-entropy of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def nats_to_bits(nats: float) -> float:
    """Nats per token in bits."""
    return nats / math.log(2)
