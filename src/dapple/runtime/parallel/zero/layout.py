"""The flat layout of a replicated stage's sharded parameters: buckets, and each replica's part.

Used by :class:`dapple.runtime.parallel.zero.FlatShards` (:mod:`dapple.runtime.parallel.zero` describes the
design): the parameters, in runs, become views of one flat buffer per bucket padded to a
multiple of r; replica ``j`` updates its chunk ``[j P / r, (j + 1) P / r)`` of each bucket,
in pieces (:class:`Piece`) cut at parameter boundaries, and slice ``[j c, (j + 1) c)``,
``c = ceil(n / r)``, of each tied parameter. A bucket of parameters held by fewer replicas
(an expert shard's r_s / e_s copies) is cut the same way over those (:class:`ShardGroup`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "Bucket",
    "FlatLayout",
    "Piece",
    "ShardGroup",
    "flat_bucket",
    "flat_layout",
    "replica_slices",
    "tied_slices",
]


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """The replicas a bucket is sharded over: the stage's r_s (its replica group), or the
    copies of a parameter fewer replicas hold (an expert shard's r_s / e_s)."""

    devices: tuple[int, ...]
    """Their ranks, in replica order (member ``i`` owns chunk ``i`` of each bucket)."""
    pg: Any
    """Their process group."""
    index: int
    """This rank's member index."""

    @property
    def size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one stage parameter this replica updates: inside its chunk of a bucket, or
    its slice of a tied parameter."""

    param: nn.Parameter
    """The optimizer's parameter: a 1-D view of its bucket's flat parameter buffer (of the
    tied parameter)."""
    origin: nn.Parameter
    """The stage parameter it is part of."""
    offset: int
    """Where it starts in ``origin.reshape(-1)``."""


@dataclass
class Bucket:
    """One bucket of a stage's sharded parameters, and its reduction's state."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    """The bucket's parameters, padded (they are views of it)."""
    padded: int
    """P: its element count, a multiple of r."""
    shard_start: int
    """Offset of this replica's chunk in the gradient shard."""
    grads: torch.Tensor | None = None
    """ZeRO-1: the bucket's gradients (``p.grad`` are views of it)."""
    ready: set[int] = field(default_factory=set)
    works: list[Any] = field(default_factory=list)
    """The reduce-scatter in flight (empty: none)."""
    result: torch.Tensor | None = None
    """Where this replica's reduced chunk lands: added to the shard when done (ZeRO-2), or
    copied there (ZeRO-1 on gloo; elsewhere ZeRO-1 reduces into the shard itself)."""
    staged: torch.Tensor | None = None
    """ZeRO-2: the micro-batch's gradients being reduced (kept alive until done)."""
    launched_sum: torch.Tensor | None = None
    """ZeRO-1: the sum of the bucket's local gradients when its reduction started (for the
    non-finite guard: on gloo the reduction overwrites them)."""
    group: ShardGroup | None = None
    """The replicas it is sharded over (set by :class:`~dapple.runtime.parallel.zero.FlatShards`)."""


PieceSpot = tuple[int, int, int]
"""Where a piece's gradient lives: ``(bucket, offset in this replica's chunk, length)``."""


def flat_bucket(
    k: int,
    run: list[nn.Parameter],
    replica: int,
    r: int,
    shard_start: int,
    bucket_grads: bool,
    kw: dict[str, Any],
) -> tuple[Bucket, list[Piece], list[PieceSpot]]:
    """Bucket ``k``: the parameters of ``run`` copied into one flat buffer padded to a multiple
    of r and made views of it (``bucket_grads``, ZeRO-1: with a gradient buffer of its size).
    Call under ``torch.no_grad()``.

    Returns:
        The bucket, replica ``replica``'s pieces of it (the parts of its parameters inside
        its chunk) and where each piece's gradient lives.
    """
    n = sum(p.numel() for p in run)
    padded = -(-n // r) * r
    chunk = padded // r
    bk = Bucket(run, torch.zeros(padded, **kw), padded, shard_start)
    lo, hi = replica * chunk, (replica + 1) * chunk
    pieces: list[Piece] = []
    spots: list[PieceSpot] = []
    off = 0
    for p in run:
        view = bk.flat[off : off + p.numel()]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view_as(p)  # the old storage goes now: one bucket extra at most
        a, b = max(off, lo), min(off + p.numel(), hi)
        if a < b:
            spots.append((k, a - lo, b - a))
            pieces.append(Piece(nn.Parameter(bk.flat[a:b]), p, a - off))
        off += p.numel()
    if bucket_grads:
        bk.grads = torch.zeros(padded, **kw)
    return bk, pieces, spots


@dataclass
class FlatLayout:
    """A stage's sharded parameters laid out in buckets, as one replica holds them."""

    buckets: list[Bucket]
    pieces: list[Piece]
    """This replica's pieces, in bucket order (the optimizer's parameters)."""
    where: dict[int, tuple[int, int, int]]
    """``id(stage parameter) -> (bucket, index in it, offset in its flat buffer)``."""
    grad_shard: torch.Tensor
    """This replica's chunk of every bucket's reduced gradient, in bucket order; each piece's
    gradient is a view of it."""


def flat_layout(
    runs: Sequence[list[nn.Parameter]],
    replica: int,
    r: int,
    bucket_grads: bool,
    kw: dict[str, Any],
    held: Sequence[tuple[int, int]] | None = None,
) -> FlatLayout:
    """Lay ``runs`` out one bucket each (:func:`flat_bucket`, one at a time, so the copies add
    one bucket to the peak) and point the pieces' gradients into the gradient shard. Call
    under ``torch.no_grad()``.

    Args:
        bucket_grads: each bucket keeps a whole gradient buffer (ZeRO-1, whose gradients
            accumulate unsharded until the step's reduce-scatter; ZeRO-2 reduces each
            backward's straight into the shard).
        held: each run's ``(member index, members)`` when it is sharded over other replicas
            than the stage's (None: ``(replica, r)`` for every run).
    """
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    spots: list[PieceSpot] = []
    where: dict[int, tuple[int, int, int]] = {}
    shard = 0
    for k, run in enumerate(runs):
        j, n_k = (replica, r) if held is None else held[k]
        bk, mine, at = flat_bucket(k, run, j, n_k, shard, bucket_grads, kw)
        buckets.append(bk)
        pieces += mine
        spots += at
        off = 0
        for i, p in enumerate(run):
            where[id(p)] = (k, i, off)
            off += p.numel()
        shard += bk.padded // n_k  # this replica's chunk of it
    grad_shard = torch.zeros(shard, **kw)
    for pc, (k, at0, n) in zip(pieces, spots, strict=True):
        g0 = buckets[k].shard_start + at0
        pc.param.grad = grad_shard[g0 : g0 + n]
    return FlatLayout(buckets, pieces, where, grad_shard)


def replica_slices(n: int, r: int) -> list[tuple[int, int]]:
    """Each of r replicas' elements ``[lo, hi)`` of a tied parameter of n elements: ``c =
    ceil(n / r)`` each (the last may be short or empty)."""
    c = -(-n // r)
    return [(min(j * c, n), min((j + 1) * c, n)) for j in range(r)]


def tied_slices(tied: Sequence[nn.Parameter], replica: int, r: int) -> list[Piece]:
    """Replica ``replica``'s slice of each tied parameter (none where its slice is empty)."""
    out: list[Piece] = []
    for t in tied:
        lo, hi = replica_slices(t.numel(), r)[replica]
        if lo < hi:
            out.append(Piece(nn.Parameter(t.detach().view(-1)[lo:hi]), t, lo))
    return out
