"""Variable-length documents: the JSONL reader's one-line errors, padded batches, the masked
loss (a padded batch has the loss and gradients of its documents run one by one unpadded) and
the seeded document ``make_batch``."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from dapple.datasets import (
    IGNORE_INDEX,
    DocumentBatches,
    masked_token_loss,
    pad_batch,
    read_documents,
)
from dapple.errors import ValidationError
from dapple.models.shapes import DynamicDim, run_dims
from dapple.models.zoo.transformer import transformer

VOCAB = 32


def _docs(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def test_pad_batch_pads_inputs_with_pad_id_and_targets_with_ignore_index() -> None:
    x, y = pad_batch([torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 9])], pad_id=0)
    assert x.tolist() == [[5, 6, 0, 0], [1, 2, 3, 4]]
    assert y.tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX], [2, 3, 4, 9]]


def test_padded_batch_has_the_loss_and_gradients_of_its_documents_unpadded() -> None:
    wl = transformer(layers=2, hidden=16, heads=2, seq=16, vocab=VOCAB)
    model = wl.build_model(0)
    docs = _docs([5, 9, 14])
    x, y = pad_batch(docs, pad_id=0)
    padded = masked_token_loss(model(x), y)
    padded.backward()
    g_padded = _grads(model)
    losses, g_sum = [], [torch.zeros_like(g) for g in g_padded]
    for d in docs:  # one document at a time, no padding, each weighted 1/3
        xi, yi = pad_batch([d])
        loss = masked_token_loss(model(xi), yi) / len(docs)
        loss.backward()
        losses.append(float(loss.detach()))
        g_sum = [a + b for a, b in zip(g_sum, _grads(model), strict=True)]
    assert float(padded.detach()) == pytest.approx(sum(losses), rel=1e-6)
    for a, b in zip(g_padded, g_sum, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a token mean over the whole padded batch weights long documents more: not the same loss
    token_mean = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
    assert abs(float(token_mean.detach()) - float(padded.detach())) > 1e-3


def test_read_documents_names_the_bad_line(tmp_path: Path) -> None:
    good = tmp_path / "docs.jsonl"
    good.write_text('{"ids": [1, 2, 3]}\n\n[4, 5]\n')
    assert [d.tolist() for d in read_documents(good)] == [[1, 2, 3], [4, 5]]
    cases = [
        ('{"ids": [1, 2]}\n{"ids": [1]}\n', "docs.jsonl:2: a document needs at least 2 tokens"),
        ('[1, 2]\n{"text": "a"}\n', r'docs.jsonl:2: expected \{"ids": \[int, \.\.\.\]\}'),
        ("[1, 2\n", "docs.jsonl:1: not JSON"),
        ("[1, 40]\n", r"docs.jsonl:1: token id outside the vocabulary \[0, 32\)"),
        ("\n", "holds no document"),
    ]
    for text, message in cases:
        good.write_text(text)
        with pytest.raises(ValidationError, match=message):
            read_documents(good, vocab=VOCAB)
    with pytest.raises(ValidationError, match="does not exist"):
        read_documents(tmp_path / "missing.jsonl")


def test_document_batches_vary_in_length_are_seeded_and_pickle_without_documents(
    tmp_path: Path,
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"ids": d.tolist()}) for d in _docs([4, 8, 12, 30])))
    make = DocumentBatches(path, max_len=16, vocab=VOCAB)
    shapes = {make(2, seed)[0].shape[1] for seed in range(20)}
    assert len(shapes) > 1 and max(shapes) <= 16  # cut to max_len + 1 tokens
    torch.testing.assert_close(make(3, 7), make(3, 7))
    clone = pickle.loads(pickle.dumps(make))
    assert clone._docs is None
    torch.testing.assert_close(clone(3, 7), make(3, 7))
    # as a workload's make_batch, with its token dimension declared
    wl = transformer(layers=1, hidden=8, heads=2, seq=16, vocab=VOCAB)
    docs_wl = dataclasses.replace(
        wl,
        make_batch=make,
        loss_fn=masked_token_loss,
        dynamic_dims={0: {1: DynamicDim("seq", 1, 16)}},
    )
    assert run_dims(docs_wl, 4, 0) == {0: {1: DynamicDim("seq", 1, 16)}}
