"""Shared pieces of the model zoo: seeded synthetic data and losses."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["generator", "token_cross_entropy"]


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (batches never touch the global RNG)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(batch, seq, vocab)`` logits against ``(batch, seq)`` token ids.

    Every sample has the same number of tokens, so the token mean is the mean of per-sample
    losses, as :class:`dapple.models.workload.Workload` requires.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Flatten(nn.Module):
    """``x.flatten(1)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)
