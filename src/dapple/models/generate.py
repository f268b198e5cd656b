"""Greedy decoding with a trained causal language model (a layer chain: ids -> logits)."""

from __future__ import annotations

import torch
from torch import nn

from dapple.errors import ValidationError

__all__ = ["greedy_generate"]


@torch.no_grad()
def greedy_generate(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int, context: int
) -> torch.Tensor:
    """Append ``new_tokens`` tokens to ``prompt``, each the argmax of the model's next-token
    logits over the last ``context`` tokens.

    Args:
        model: maps ``(1, t)`` token ids to ``(1, t, vocab)`` logits, ``t <= context``.
        prompt: 1-D token ids (at least one).
        new_tokens: tokens to add.
        context: the most tokens the model takes at once (its positions).

    Returns:
        The prompt followed by the generated tokens (1-D).
    """
    if prompt.dim() != 1 or prompt.numel() < 1:
        raise ValidationError(
            f"prompt must be 1-D with at least one token, got {tuple(prompt.shape)}"
        )
    if new_tokens < 0 or context < 1:
        raise ValidationError(f"need new_tokens >= 0 and context >= 1, got {new_tokens}, {context}")
    was_training = model.training
    model.eval()
    ids = prompt.clone()
    for _ in range(new_tokens):
        logits = model(ids[-context:].unsqueeze(0))
        ids = torch.cat([ids, logits[0, -1].argmax().reshape(1)])
    model.train(was_training)
    return ids
