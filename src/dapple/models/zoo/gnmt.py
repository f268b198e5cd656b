"""GNMT: stacked-LSTM encoder-decoder with attention, as a chain of tuple-passing layers.

Layer chain (PipeDream/MLPerf layout, see :func:`dapple.profiler._paper_arch.gnmt16_layers`):
``embeddings`` maps ``(src, tgt)`` ids to ``(src_emb, tgt_emb)``; encoder layer 0 is a
bidirectional LSTM, layer 1 reads its ``2h`` output, layers 2+ are residual; the target
embeddings ride through the encoder layers as the tuple's second element. Decoder layer 0
runs an LSTM over the target embeddings and dot-product attention over the encoder output,
emitting ``(hidden, context)``; decoder layers 1+ read ``cat(hidden, context)`` (residual from
layer 2); the classifier projects to the vocabulary. Teacher forcing on synthetic sentences of
``seq`` tokens; no dropout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo.common import generator, token_cross_entropy

__all__ = ["gnmt"]

Pair = tuple[torch.Tensor, torch.Tensor]


class GnmtEmbeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.src = nn.Embedding(vocab, hidden)
        self.tgt = nn.Embedding(vocab, hidden)

    def forward(self, ids: Pair) -> Pair:
        return self.src(ids[0]), self.tgt(ids[1])


class EncoderLayer(nn.Module):
    def __init__(self, index: int, hidden: int) -> None:
        super().__init__()
        self.residual = index >= 2
        n_in = 2 * hidden if index == 1 else hidden
        self.rnn = nn.LSTM(n_in, hidden, batch_first=True, bidirectional=index == 0)

    def forward(self, xs: Pair) -> Pair:
        x, tgt = xs
        y, _ = self.rnn(x)
        return (x + y if self.residual else y), tgt


class AttentionDecoderLayer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)

    def forward(self, xs: Pair) -> Pair:
        enc, tgt = xs
        h, _ = self.rnn(tgt)
        scores = self.query(h) @ self.key(enc).transpose(1, 2) / enc.shape[-1] ** 0.5
        context = scores.softmax(-1) @ enc
        return h, context


class DecoderLayer(nn.Module):
    def __init__(self, index: int, hidden: int) -> None:
        super().__init__()
        self.residual = index >= 2
        self.rnn = nn.LSTM(2 * hidden, hidden, batch_first=True)

    def forward(self, xs: Pair) -> Pair:
        x, context = xs
        y, _ = self.rnn(torch.cat((x, context), dim=-1))
        return (x + y if self.residual else y), context


class Classifier(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.out = nn.Linear(hidden, vocab)

    def forward(self, xs: Pair) -> torch.Tensor:
        y: torch.Tensor = self.out(xs[0])
        return y


def gnmt(
    layers: int = 4, hidden: int = 64, vocab: int = 256, seq: int = 16, name: str = "gnmt"
) -> Workload:
    """GNMT with ``layers`` LSTM layers (half encoder, half decoder): ``layers + 2`` chain layers.

    Args:
        layers: total LSTM layers, even and >= 4 (``gnmt-16``: 16).
        hidden: LSTM width (``gnmt-16``: 1024).
        vocab: vocabulary of source and target (``gnmt-16``: 32320).
        seq: tokens per source and target sentence (``gnmt-16``: 50).
        name: workload name.
    """
    if layers < 4 or layers % 2 or min(hidden, vocab, seq) < 1:
        raise ValidationError(
            f"gnmt: layers must be even and >= 4, sizes positive; got layers={layers} "
            f"hidden={hidden} vocab={vocab} seq={seq}"
        )
    half = layers // 2

    def make_batch(batch_size: int, seed: int) -> tuple[Pair, torch.Tensor]:
        g = generator(seed)
        src = torch.randint(0, vocab, (batch_size, seq), generator=g)
        tgt = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
        return (src, tgt[:, :-1].clone()), tgt[:, 1:].clone()

    factories: list[Callable[[], nn.Module]] = [partial(GnmtEmbeddings, vocab, hidden)]
    factories += [partial(EncoderLayer, i, hidden) for i in range(half)]
    factories.append(partial(AttentionDecoderLayer, hidden))
    factories += [partial(DecoderLayer, i, hidden) for i in range(1, half)]
    factories.append(partial(Classifier, hidden, vocab))
    names = ["embeddings"] + [f"encoder{i}" for i in range(half)]
    names += [f"decoder{i}" for i in range(half)] + ["classifier"]
    return Workload(
        name=name,
        layer_factories=factories,
        make_batch=make_batch,
        loss_fn=token_cross_entropy,
        layer_names=names,
    )
