"""Transformer language model (GPT-style pre-LN blocks): embedding, N blocks, LM head.

``bert-48`` in the zoo is this chain at the paper's BERT-48 widths (48 blocks, hidden 1024,
16 heads, sequence 512, vocabulary 30522), trained as a causal LM on synthetic tokens. No
dropout, so every run is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import ValidationError
from dapple.models.shapes import DynamicDim
from dapple.models.workload import Workload
from dapple.models.zoo.common import generator, token_cross_entropy

__all__ = ["Block", "Embedding", "LMHead", "transformer", "transformer_tp"]


class Embedding(nn.Module):
    """Token + learned position embeddings: ``(b, seq)`` ids -> ``(b, seq, hidden)``."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tok(ids) + self.pos[: ids.shape[1]]
        return out


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, causal self-attention."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        shape = (b, s, self.heads, h // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class LMHead(nn.Module):
    """Final LayerNorm and vocabulary projection: ``(b, seq, hidden) -> (b, seq, vocab)``."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(self.ln(x))
        return y


def transformer(
    layers: int = 6,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 256,
    ffn: int | None = None,
    name: str = "transformer",
    seq_choices: Sequence[int] | None = None,
) -> Workload:
    """Causal transformer LM: ``layers + 2`` chain layers (embedding, blocks, head).

    Args:
        layers: number of transformer blocks.
        hidden: model width; ``heads`` must divide it.
        heads: attention heads.
        seq: tokens per sample.
        vocab: vocabulary size; batches are uniform random tokens, targets the next token.
        ffn: feed-forward width (default ``4 * hidden``).
        name: workload name.
        seq_choices: tokens per sample that change from step to step: the batch of seed
            ``t`` has ``seq_choices[t % len(seq_choices)]`` tokens (each at most ``seq``, the
            position table); the token dimension is then declared dynamic, ``[1, seq]``.
            None: always ``seq``.
    """
    if min(layers, hidden, heads, seq, vocab) < 1 or hidden % heads:
        raise ValidationError(
            f"transformer: need positive sizes and heads dividing hidden, got layers={layers} "
            f"hidden={hidden} heads={heads} seq={seq} vocab={vocab}"
        )
    choices = tuple(int(c) for c in seq_choices) if seq_choices else ()
    if any(not 1 <= c <= seq for c in choices):
        raise ValidationError(
            f"transformer: seq_choices {list(choices)} must lie in [1, seq={seq}] (the position "
            "table)"
        )
    ffn = ffn or 4 * hidden

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = choices[seed % len(choices)] if choices else seq
        tokens = torch.randint(0, vocab, (batch_size, n + 1), generator=generator(seed))
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()

    factories: list[Callable[[], nn.Module]] = [partial(Embedding, vocab, hidden, seq)]
    factories += [partial(Block, hidden, heads, ffn) for _ in range(layers)]
    factories.append(partial(LMHead, hidden, vocab))
    return Workload(
        name=name,
        layer_factories=factories,
        make_batch=make_batch,
        loss_fn=token_cross_entropy,
        layer_names=["embedding"] + [f"block{i}" for i in range(layers)] + ["lm_head"],
        dynamic_dims={0: {1: DynamicDim("seq", 1, seq)}} if choices else {},
    )


def _whole_model(sizes: dict[str, Any]) -> nn.Module:
    """The zoo transformer of ``sizes`` as one ``nn.Sequential`` (the factory
    :func:`transformer_tp` traces)."""
    return transformer(**sizes).build_model()


def transformer_tp(
    layers: int = 6,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 256,
    ffn: int | None = None,
    name: str = "transformer-tp",
) -> Workload:
    """The zoo transformer traced into pieces (embedding, each block, head) with its TP plan
    (:data:`dapple.models.tp_plan.TRANSFORMER_TP_PLAN`: heads and MLP units cut over a tensor
    group, as Megatron cuts a GPT block), so a plan of tensor width t > 1 can run it. The
    arguments, batches and loss are :func:`transformer`'s; the weights of a seed are drawn for
    the whole model (:func:`dapple.models.split.workload_from_module`), not layer by layer.
    ``heads`` and ``4 * hidden`` (or ``ffn``) must be divisible by t."""
    from dapple.models.split import workload_from_module
    from dapple.models.tp_plan import TRANSFORMER_TP_PLAN

    sizes: dict[str, Any] = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "seq": seq,
        "vocab": vocab,
    }
    if ffn is not None:
        sizes["ffn"] = ffn
    wl = transformer(**sizes)  # checks the sizes
    cuts = [str(i) for i in range(1, layers + 2)]  # before each block and before the head
    traced = workload_from_module(
        partial(_whole_model, sizes), wl.make_batch, wl.loss_fn, split_at=cuts, name=name
    )
    return dataclasses.replace(traced, tp_plan=dict(TRANSFORMER_TP_PLAN))
