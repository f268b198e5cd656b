"""TP plans: which parameters of a stage piece are cut over a tensor group, and how.

A TP plan maps module-name patterns to a style (:mod:`dapple.models.tp_plan`: its format,
:func:`~dapple.models.tp_plan.match_style`, the zoo transformer's plan).

Styles (Megatron-LM's column- and row-parallel linear layers, Shoeybi et al. 2019, §3):

- ``colwise``: ``y = x W^T + b`` with ``W`` cut by output rows (``Shard(0)``) and ``b`` with it;
  ``x`` whole, ``y`` cut along its last dimension.
- ``packed_colwise``: ``colwise`` for a fused projection whose output the graph splits into
  parts (the zoo transformer's ``qkv``); each part is cut on its own, so each rank holds the
  ``r``-th slice of every part (Hugging Face's ``packed_colwise``).
- ``rowwise``: ``W`` cut by input columns (``Shard(1)``), ``x`` cut along its last dimension;
  the partial products are summed over the group and ``b`` (whole) is added once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dapple.errors import ValidationError
from dapple.models.tp_plan import STYLES, TRANSFORMER_TP_PLAN, Style, match_style

__all__ = [
    "STYLES",
    "TRANSFORMER_TP_PLAN",
    "ShardLayout",
    "Style",
    "match_style",
]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How one parameter is cut over the ``t`` ranks of a tensor group.

    Rank ``r`` holds slice ``r`` of every part: ``parts`` are the sizes along ``dim`` of the
    packed parts (one part, the whole dimension, unless the style is ``packed_colwise``).
    """

    name: str
    """Qualified parameter name (the model's)."""
    style: Style
    dim: int
    """0: the output rows (colwise weight and bias); 1: the input columns (rowwise weight)."""
    parts: tuple[int, ...]
    """Global sizes of the parts along ``dim``; their sum is the parameter's size there."""

    def check(self, shape: Sequence[int], t: int) -> None:
        """Raise a ValidationError unless ``t`` divides every part of a parameter of ``shape``."""
        if sum(self.parts) != shape[self.dim] or any(p % t for p in self.parts):
            raise ValidationError(
                f"TP width {t} does not divide {self.name} (size {shape[self.dim]} along "
                f"dimension {self.dim}, parts {list(self.parts)})"
            )

    def shard(self, full: torch.Tensor, rank: int, t: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the whole parameter ``full`` (a copy)."""
        self.check(full.shape, t)
        pieces = torch.split(full, list(self.parts), self.dim)
        return torch.cat([p.chunk(t, self.dim)[rank] for p in pieces], self.dim).clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole parameter from every rank's slice, in rank order."""
        t = len(shards)
        local = [p // t for p in self.parts]
        split = [torch.split(s, local, self.dim) for s in shards]
        return torch.cat(
            [torch.cat([sp[k] for sp in split], self.dim) for k in range(len(self.parts))],
            self.dim,
        )
