"""Greedy decoding against a step-by-step argmax of the same model."""

from __future__ import annotations

import pytest
import torch

from dapple.errors import ValidationError
from dapple.models.generate import greedy_generate
from dapple.models.zoo import load_workload


def test_greedy_generate_takes_the_argmax_over_the_last_context_tokens() -> None:
    model = load_workload("transformer", layers=2, hidden=16, heads=2, seq=8).build_model(3)
    prompt = torch.tensor([1, 2, 3])
    out = greedy_generate(model, prompt, new_tokens=10, context=8)
    assert out.shape == (13,) and torch.equal(out[:3], prompt)
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(10):
            nxt = model(ids[-8:].unsqueeze(0))[0, -1].argmax()
            ids = torch.cat([ids, nxt.reshape(1)])
    assert torch.equal(out, ids)
    assert model.training  # the mode is restored


def test_greedy_generate_rejects_an_empty_prompt() -> None:
    model = load_workload("transformer", layers=1, hidden=8, heads=2, seq=4).build_model(0)
    with pytest.raises(ValidationError, match="prompt"):
        greedy_generate(model, torch.tensor([], dtype=torch.long), 3, 4)
