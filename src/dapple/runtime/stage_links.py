"""The split-concat messages of one replica of one stage (section 6.2).

Replica ``j`` of stage ``s`` owns rows ``[lo, hi)`` of every micro-batch
(``slice_bounds(b, r_s, shares_s)[j]``). Between stages only activations (forward) and their
gradients (backward) travel, as the overlapping row ranges of :func:`dapple.core.plan.transfers`,
with non-blocking ``isend``/``irecv``: a receive posts one buffer per boundary tensor for each
peer replica, and :meth:`StageLinks.wait_concat` joins the pieces in row order.

With ``dynamic=True`` (the model's input shapes change from step to step) every activation
message is preceded by its shape header (:func:`dapple.runtime.transport.shape_header`): a
forward receive posts the header's ``irecv`` early and the data's once the header arrived; a
gradient receive sizes its buffers from the activations this stage sent (posted at once when
they exist, else when the backward waits for them).

A message between two chunks of the same rank (the turn of a V: rank P-1's chunk P-1 feeds its
chunk P, whose input gradients come back) is handed over: the sender leaves the tensor itself
(its rows, detached) under the message's tag and the receiver takes it, with no buffer, no copy,
no shape header and no process group - as ``torch.distributed.pipelining`` passes a V's local
activations and gradients between its stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dapple.core.plan import Plan, slice_bounds, transfers
from dapple.runtime import comm
from dapple.runtime.parallel.stage_mesh import peer_ranks
from dapple.runtime.transport import (
    HEADER_INDEX,
    BoundarySpec,
    header_buffer,
    message_tag,
    sample_shapes,
    shape_header,
)

__all__ = ["StageLinks"]


_HANDED: dict[int, torch.Tensor] = {}
"""Messages between two chunks of this rank, by tag, from the send until the receive takes them
(every one is taken within its step; :meth:`StageLinks.finish` and a new run's links forget any
left)."""


def _hand(t: torch.Tensor, tag: int) -> None:
    """Leave ``t`` for this rank's receive of ``tag``."""
    if tag in _HANDED:
        raise RuntimeError(f"a message to this rank with tag {tag} is handed twice in one step")
    _HANDED[tag] = t


def _take(tag: int, rank: int) -> torch.Tensor:
    """The tensor rank ``rank`` (this one) handed itself under ``tag``."""
    try:
        return _HANDED.pop(tag)
    except KeyError:
        raise RuntimeError(
            f"rank {rank} waits for a message to itself (tag {tag}) that its program sends "
            "later: the schedule must send before it receives"
        ) from None


@dataclass
class _Recv:
    lo: int
    hi: int
    rank: int
    buffers: list[torch.Tensor]
    works: list[Any]
    header: torch.Tensor | None = None
    """Dynamic shapes, forward: the shape header being received (data not posted yet)."""
    deferred: bool = False
    """Dynamic shapes, backward: posted when the backward waits (no activations yet)."""
    handed: tuple[int, ...] = ()
    """From this rank itself: the tags of the tensors taken at the wait (no buffers posted)."""


def _peers(plan: Plan, s: int, other: int, tensor_rank: int) -> dict[int, tuple[list[int], int]]:
    """Each replica of stage ``other`` -> (the ranks of its tensor group this rank sends to,
    the rank it receives from) (:func:`~dapple.runtime.parallel.stage_mesh.peer_ranks`)."""
    st, ot = plan.stages[s], plan.stages[other]
    t = st.tensor_width
    return {
        k: (peer_ranks(ot, k, tensor_rank, t, True), peer_ranks(ot, k, tensor_rank, t, False)[0])
        for k in range(ot.replicas)
    }


def _floating(tensors: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors of ``tensors`` that carry gradients (floating point or complex)."""
    return [t for t in tensors if t.dtype.is_floating_point or t.dtype.is_complex]


class StageLinks:
    """The receives, sends and row ranges of replica ``replica`` of stage ``stage``.

    Attributes:
        lo, hi: The rows ``[lo, hi)`` of every micro-batch this replica owns.
        waiting_on: ``(what, peer rank)`` while blocked on a peer (for error messages).
    """

    def __init__(
        self,
        plan: Plan,
        stage: int,
        replica: int,
        specs: Sequence[BoundarySpec],
        device: torch.device,
        dynamic: bool = False,
        tensor_rank: int = 0,
    ) -> None:
        self.s, self.device, self.dynamic = stage, device, dynamic
        b = plan.micro_batch_size
        S = plan.num_stages
        reps = [st.replicas for st in plan.stages]
        shares = [st.shares for st in plan.stages]
        self.lo, self.hi = slice_bounds(b, reps[stage], shares[stage])[replica]
        self.in_spec = specs[stage - 1] if stage > 0 else None
        self.out_spec = specs[stage] if stage < S - 1 else None
        # peer replica -> micro-batch rows [lo, hi) exchanged with it
        self.in_rows: dict[int, tuple[int, int]] = (
            {
                p: (lo, hi)
                for p, k, lo, hi in transfers(
                    b, reps[stage - 1], reps[stage], shares[stage - 1], shares[stage]
                )
                if k == replica
            }
            if stage > 0
            else {}
        )
        self.out_rows: dict[int, tuple[int, int]] = (
            {
                k: (lo, hi)
                for p, k, lo, hi in transfers(
                    b, reps[stage], reps[stage + 1], shares[stage], shares[stage + 1]
                )
                if p == replica
            }
            if stage < S - 1
            else {}
        )
        self.prev_ranks = _peers(plan, stage, stage - 1, tensor_rank) if stage > 0 else {}
        """Replica of stage s-1 -> (the ranks this rank sends gradients to, the one it receives
        activations from): tensor groups pair by index (:func:`peer_ranks`)."""
        self.next_ranks = _peers(plan, stage, stage + 1, tensor_rank) if stage < S - 1 else {}
        self.p2p = comm.PointToPoint()
        """The messages' sends and receives on the run's process group."""
        self.waiting_on: tuple[str, int] | None = None
        self.pending: list[Any] = []
        """Sends posted and not yet known complete (kept alive with their buffers)."""
        self._recv: tuple[dict[int, list[_Recv]], dict[int, list[_Recv]]] = ({}, {})
        """Forward and backward receives posted, by micro-batch."""
        self._grad_in: dict[int, tuple[torch.Tensor, ...]] = {}
        self._grad_in_left: dict[int, int] = {}
        _HANDED.clear()  # what a run that failed mid-step left

    def poll(self) -> None:
        """Forget the sends that completed."""
        self.pending = [w for w in self.pending if not w.is_completed()]

    def finish(self, sends: Sequence[Any] = ()) -> None:
        """Wait for ``sends`` and every pending send of this step; forget the step's gradients
        kept for ``SEND_B``."""
        self.pending += sends
        for w in self.pending:
            self.waiting_on = ("send completion", -1)
            w.wait()
        self.pending = []
        self.waiting_on = None
        self._grad_in.clear()
        self._grad_in_left.clear()
        if _HANDED:  # a failed step's (each step takes all it hands)
            _HANDED.clear()

    def post_recv(self, m: int, peer: int, backward: bool, outputs: Sequence[Any] | None) -> None:
        """Post the receives of micro-batch ``m``'s slice from replica ``peer``: activations
        from stage s-1, or (``backward``) gradients from stage s+1, sized under dynamic shapes
        from ``outputs``, the activations this replica sent (None: not computed yet)."""
        table = self._recv[backward]
        if backward:
            assert self.out_spec is not None
            lo, hi = self.out_rows[peer]
            rank = self.next_ranks[peer][1]
            specs = [t for t in self.out_spec.tensors if t.carries_grad]
        else:
            assert self.in_spec is not None
            lo, hi = self.in_rows[peer]
            rank = self.prev_ranks[peer][1]
            specs = list(self.in_spec.tensors)
        if rank == self.p2p.rank:
            tags = tuple(
                message_tag(m, backward, i, self.s - 1 + backward) for i in range(len(specs))
            )
            table.setdefault(m, []).append(_Recv(lo, hi, rank, [], [], handed=tags))
        elif not self.dynamic:
            bufs = [t.buffer(hi - lo, self.device) for t in specs]
            table.setdefault(m, []).append(
                _Recv(lo, hi, rank, bufs, self._irecv(bufs, rank, m, backward))
            )
        elif not backward:
            assert self.in_spec is not None
            hdr = header_buffer(self.in_spec, self.device)
            tag = message_tag(m, False, HEADER_INDEX, self.s - 1)
            work = self.p2p.irecv(hdr, rank, tag)
            table.setdefault(m, []).append(_Recv(lo, hi, rank, [], [work], header=hdr))
        else:
            r = _Recv(lo, hi, rank, [], [], deferred=True)
            if outputs is not None:
                self._post_grad_recv(r, m, outputs)
            table.setdefault(m, []).append(r)

    def wait_concat(
        self, m: int, backward: bool, outputs: Sequence[Any] = ()
    ) -> list[torch.Tensor]:
        """Wait for micro-batch ``m``'s activations (or ``backward``: gradients) from every
        peer and join them in row order (``outputs``: the activations the gradients are of)."""
        what = "gradients" if backward else "activations"
        pieces = sorted(self._recv[backward].pop(m), key=lambda r: r.lo)
        for r in pieces:  # dynamic shapes: size and post every piece's data before waiting
            if r.handed:
                r.buffers = [_take(tag, r.rank) for tag in r.handed]
            elif r.header is not None:
                self._post_data_recv(r, m, what)
            elif r.deferred:
                self._post_grad_recv(r, m, outputs)
        for r in pieces:
            self.waiting_on = (f"{what} of micro-batch {m}", r.rank)
            for w in r.works:
                w.wait()
        self.waiting_on = None
        n = len(pieces[0].buffers)
        if len(pieces) == 1:
            return pieces[0].buffers
        return [torch.cat([r.buffers[i] for r in pieces]) for i in range(n)]

    def send_forward(self, m: int, peer: int, output: Sequence[Any]) -> list[Any]:
        """Post the sends of micro-batch ``m``'s activations ``output`` (this replica's rows)
        to replica ``peer`` of stage s+1; returns their works."""
        lo, hi = self.out_rows[peer]
        works = []
        for rank in self.next_ranks[peer][0]:
            if rank == self.p2p.rank:
                for i, t in enumerate(output):
                    _hand(self._rows(t.detach(), lo, hi), message_tag(m, False, i, self.s))
                continue
            if self.dynamic:
                hdr = shape_header(output, self.device)
                tag = message_tag(m, False, HEADER_INDEX, self.s)
                works.append(self.p2p.isend(hdr, rank, tag))
            for i, t in enumerate(output):
                piece = self._rows(t.detach(), lo, hi)
                works.append(self.p2p.isend(piece, rank, message_tag(m, False, i, self.s)))
        return works

    def keep_grads(self, m: int, inputs: Sequence[torch.Tensor]) -> None:
        """Keep the gradients of micro-batch ``m``'s ``inputs`` (zeros where none) for the
        ``SEND_B`` to each peer replica of stage s-1."""
        self._grad_in[m] = tuple(
            (x.grad if x.grad is not None else torch.zeros_like(x)) for x in _floating(inputs)
        )
        self._grad_in_left[m] = len(self.in_rows)

    def send_backward(self, m: int, peer: int) -> None:
        """Post the sends of the slice of micro-batch ``m``'s input gradients for replica
        ``peer`` of stage s-1 (:meth:`keep_grads`)."""
        lo, hi = self.in_rows[peer]
        for rank in self.prev_ranks[peer][0]:
            for i, g in enumerate(self._grad_in[m]):
                piece = self._rows(g, lo, hi)
                tag = message_tag(m, True, i, self.s - 1)
                if rank == self.p2p.rank:
                    _hand(piece, tag)
                else:
                    self.pending.append(self.p2p.isend(piece, rank, tag))
        self._grad_in_left[m] -= 1
        if self._grad_in_left[m] == 0:  # the pending sends keep their pieces alive
            del self._grad_in[m], self._grad_in_left[m]

    def _rows(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a micro-batch's tensor ``t`` of this replica's rows, contiguous
        (``t`` itself when they are all of its rows and it is)."""
        if lo == self.lo and hi == self.hi:
            return t.contiguous()
        return t[lo - self.lo : hi - self.lo].contiguous()

    def _irecv(self, bufs: list[torch.Tensor], rank: int, m: int, backward: bool) -> list[Any]:
        return [
            self.p2p.irecv(buf, rank, message_tag(m, backward, i, self.s - 1 + backward))
            for i, buf in enumerate(bufs)
        ]

    def _post_grad_recv(self, r: _Recv, m: int, outputs: Sequence[Any]) -> None:
        """Dynamic shapes: the gradient buffers of rows ``[r.lo, r.hi)`` of micro-batch ``m``'s
        activations ``outputs``, shaped like them."""
        r.buffers = [
            torch.empty((r.hi - r.lo, *t.shape[1:]), dtype=t.dtype, device=self.device)
            for t in _floating(outputs)
        ]
        r.works = self._irecv(r.buffers, r.rank, m, True)
        r.deferred = False

    def _post_data_recv(self, r: _Recv, m: int, what: str) -> None:
        """Dynamic shapes, forward: wait for ``r``'s header, then post its data receives."""
        assert self.in_spec is not None and r.header is not None
        self.waiting_on = (f"shape header of micro-batch {m}'s {what}", r.rank)
        for w in r.works:
            w.wait()
        shapes = sample_shapes(self.in_spec, r.header)
        r.buffers = [
            torch.empty((r.hi - r.lo, *shape), dtype=t.dtype, device=self.device)
            for t, shape in zip(self.in_spec.tensors, shapes, strict=True)
        ]
        r.works = self._irecv(r.buffers, r.rank, m, False)
        r.header = None
