"""Megatron's two conjugate operators as autograd functions, and gathering shards back.

``f`` (:class:`CopyToGroup`) marks where a whole activation enters the sharded region: identity
forward, all-reduce of the gradient backward. ``g`` (:class:`ReduceFromGroup`) ends it after a
row-parallel product: all-reduce forward, identity backward (Shoeybi et al. 2019, Fig. 3). A
transformer block has one of each around attention and around the MLP: two all-reduces forward
and two backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CopyToGroup", "ReduceFromGroup", "all_gather_list"]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # in place breaks module hooks
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GroupModule(nn.Module):
    """A stateless module holding a process group, which a deep copy shares (a group cannot be
    copied or pickled: copying a rewritten piece would fail otherwise)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> _GroupModule:
        return type(self)(self.group)


class CopyToGroup(_GroupModule):
    """Megatron's ``f``: identity forward, gradient summed over the tensor group backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Copy.apply(x, self.group)  # type: ignore[no-untyped-call]
        return out


class ReduceFromGroup(_GroupModule):
    """Megatron's ``g``: partial products summed over the tensor group forward, identity
    backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Reduce.apply(x, self.group)  # type: ignore[no-untyped-call]
        return out


def all_gather_list(local: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``local`` (same shape on all), in group-rank order."""
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local.contiguous(), group=group)
    return out
