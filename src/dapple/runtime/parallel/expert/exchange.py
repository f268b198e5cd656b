"""Expert parallelism's token exchange: dispatch each token row to the replica holding its
expert, combine the results back (an all-to-all over the expert group, both ways).

Index conventions: ``e`` the expert width e_s (replicas in the expert group), ``E`` experts per
MoE layer, ``E_l = E / e`` experts per replica; member ``q`` of the group holds experts
``[q*E_l, (q+1)*E_l)``. A replica's rows enter :class:`ExpertDispatch` sorted by expert (as
Hugging Face's grouped-matmul experts sort them), with ``offs[k]`` the end of expert ``k``'s
rows: the rows for member ``q`` are then one contiguous run. Dispatch all-gathers the
per-expert counts (the ``[e, E]`` *route table*), sends each run to its member
(``all_to_all_single``: gloo and NCCL both run it with uneven splits) and re-orders what it
received from source-major to expert-major, so the local grouped matmuls see their rows
grouped by local expert, with local offsets. :class:`ExpertCombine` undoes it: rows back to
source-major, and the inverse all-to-all returns each row to the replica it came from, in its
original place. The backward of each is the other's exchange of the gradients.

Both are stateless per call (the route table travels through the graph from dispatch to
combine), so micro-batches in flight, re-computation and evaluation forwards need nothing
more; every member must run the same sequence of exchanges (the replicas of a stage run the
same program).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from dapple.runtime import comm

__all__ = ["Collectives", "ExpertCombine", "ExpertDispatch", "GroupCollectives", "Route"]


class Collectives(Protocol):
    """The two collectives of an expert group, from one member's side."""

    @property
    def size(self) -> int:
        """e: members of the group."""
        ...

    @property
    def index(self) -> int:
        """This member's index in the group (its expert shard)."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t``, stacked in member order (``[e, *t.shape]``)."""
        ...

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send ``x``'s consecutive runs of ``send[q]`` rows to member ``q``; return the runs
        of ``recv[p]`` rows received from each member ``p``, in member order."""
        ...


@dataclass(frozen=True)
class GroupCollectives:
    """:class:`Collectives` over a ``torch.distributed`` process group."""

    group: Any
    size: int
    index: int

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        outs = [torch.empty_like(t) for _ in range(self.size)]
        comm.all_gather(outs, t.contiguous(), group=self.group)
        return torch.stack(outs)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out


class Route:
    """Where one member's rows go and come from, given the route table.

    Attributes:
        send: rows this member sends to each member (its runs by owner).
        recv: rows it receives from each member.
        order: the received rows' indices in expert-major order (local expert, then source).
        local_offs: the end of each local expert's rows in that order (``E_l`` entries).
    """

    def __init__(self, table: torch.Tensor, me: int) -> None:
        e, E = table.shape
        if E % e:
            raise ValueError(f"route table of {E} experts cannot be split over {e} members")
        per = table.reshape(e, e, E // e)  # [source p, owner q, local expert k]
        self.send: list[int] = per[me].sum(-1).tolist()
        mine = per[:, me, :]  # [source p, local expert k]: rows p sends me for expert k
        self.recv: list[int] = mine.sum(-1).tolist()
        sizes = mine.reshape(-1)  # the received runs, source-major: (p, k)
        starts = (torch.cumsum(sizes, 0) - sizes).reshape(mine.shape)
        run_start = starts.t().reshape(-1)  # the runs taken expert-major: (k, p)
        run_len = mine.t().reshape(-1)
        placed = torch.cumsum(run_len, 0) - run_len  # where each run lands in that order
        shift = torch.repeat_interleave(run_start - placed, run_len)
        self.order = torch.arange(int(run_len.sum())) + shift
        self.local_offs = torch.cumsum(mine.sum(0), 0)


def _counts(offs: torch.Tensor) -> torch.Tensor:
    """Rows per expert from the cumulative ends ``offs``."""
    ends = offs.long()
    return torch.diff(ends, prepend=ends.new_zeros(1))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, offs: torch.Tensor, coll: Collectives
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = coll.all_gather(_counts(offs)).cpu()
        route = Route(table, coll.index)
        got = coll.all_to_all(x, route.send, route.recv)
        ctx.coll, ctx.route = coll, route
        local = got[route.order.to(got.device)]
        local_offs = route.local_offs.to(device=offs.device, dtype=offs.dtype)
        ctx.mark_non_differentiable(local_offs, table)
        return local, local_offs, table

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[torch.Tensor, None, None]:
        route: Route = ctx.route
        src = torch.empty_like(g)
        src[route.order.to(g.device)] = g
        return ctx.coll.all_to_all(src, route.recv, route.send), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, table: torch.Tensor, coll: Collectives) -> torch.Tensor:
        route = Route(table, coll.index)
        src = torch.empty_like(y)
        src[route.order.to(y.device)] = y
        ctx.coll, ctx.route = coll, route
        return coll.all_to_all(src, route.recv, route.send)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        route: Route = ctx.route
        got = ctx.coll.all_to_all(g.contiguous(), route.send, route.recv)
        return got[route.order.to(got.device)], None, None


class ExpertDispatch(nn.Module):
    """``(x, offs) -> (rows of my experts, their local offsets, route table)``: this member's
    rows ``x`` (sorted by expert, ``offs`` their cumulative ends) sent to their experts' holders,
    and the rows of its own experts from every member, grouped by local expert."""

    def __init__(self, coll: Collectives) -> None:
        super().__init__()
        self.coll = coll

    def forward(
        self, x: torch.Tensor, offs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _Dispatch.apply(x, offs, self.coll)  # type: ignore[no-untyped-call]
        return out


class ExpertCombine(nn.Module):
    """``(y, table) -> rows``: the local experts' results ``y`` (in :class:`ExpertDispatch`'s
    expert-major order) returned to the members they came from, each member's rows in their
    original order."""

    def __init__(self, coll: Collectives) -> None:
        super().__init__()
        self.coll = coll

    def forward(self, y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Combine.apply(y, table, self.coll)  # type: ignore[no-untyped-call]
        return out
