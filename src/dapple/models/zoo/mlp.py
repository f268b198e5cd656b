"""MLP: the smallest zoo model, a chain of ``Linear + ReLU`` layers and a classifier."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo.common import generator

__all__ = ["mlp"]


def _hidden(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())


def mlp(
    layers: int = 4, in_features: int = 32, hidden: int = 64, num_classes: int = 10
) -> Workload:
    """``layers`` hidden ``Linear+ReLU`` layers then a ``Linear`` classifier (cross-entropy).

    Args:
        layers: number of hidden layers (the chain has ``layers + 1`` layers).
        in_features: input width; inputs are N(0, 1).
        hidden: hidden width.
        num_classes: classes of the random integer targets.

    Raises:
        ValidationError: a size below 1.
    """
    if min(layers, in_features, hidden, num_classes) < 1:
        raise ValidationError(
            f"mlp: need sizes >= 1, got layers={layers} in_features={in_features} "
            f"hidden={hidden} num_classes={num_classes}"
        )

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed)
        x = torch.randn(batch_size, in_features, generator=g)
        y = torch.randint(0, num_classes, (batch_size,), generator=g)
        return x, y

    factories: list[Callable[[], nn.Module]] = [
        partial(_hidden, in_features if i == 0 else hidden, hidden) for i in range(layers)
    ]
    factories.append(partial(nn.Linear, hidden, num_classes))
    return Workload(
        name="mlp",
        layer_factories=factories,
        make_batch=make_batch,
        loss_fn=F.cross_entropy,
        layer_names=[f"fc{i}" for i in range(layers)] + ["classifier"],
    )
