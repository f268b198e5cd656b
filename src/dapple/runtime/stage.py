"""One replica of one stage executing lowered actions (F, B and split-concat send/recv).

Index conventions: ``s`` stage, ``j`` this replica, ``m`` micro-batch, ``b`` micro-batch size;
replica ``j`` of stage ``s`` owns samples ``slice_bounds(b, r_s, shares_s)[j] = [lo, hi)`` of
every micro-batch (an even split, or the stage's per-replica shares). Data: every rank builds
the same global batch locally (``workload.make_batch(G, seed + step)``) and slices its own rows,
so stage 0 replicas take their inputs and last-stage replicas their targets without any label
traffic. Between stages
only activations (forward) and their gradients (backward) travel, as the overlapping row
ranges of :func:`dapple.core.plan.transfers`, with non-blocking ``isend``/``irecv``.

With ``dynamic=True`` (the model's input shapes change from step to step) every activation
message is preceded by its shape header (:func:`dapple.runtime.transport.shape_header`): a
forward receive posts the header's ``irecv`` early and the data's once the header arrived; a
gradient receive sizes its buffers from the activations this stage sent (posted at once when
they exist, else when ``B`` waits for them).

A rank listed in ``DAPPLE_SLOWDOWN`` computes its F, B, I and W K times slower
(:mod:`dapple.runtime.slowdown`: an emulated slower device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dapple.core.plan import Plan, slice_bounds, transfers
from dapple.models.rng import KeyedAttention, KeyedDropout, keyed
from dapple.models.split_backward import ParamGroups, input_gradients, weight_gradients
from dapple.runtime import comm
from dapple.runtime.memory import ActivationMeter, Held
from dapple.runtime.parallel.stage_mesh import peer_ranks
from dapple.runtime.precision import Precision, to_fp32
from dapple.runtime.slowdown import Slowdown, slowdown_factor
from dapple.runtime.transport import (
    HEADER_INDEX,
    BoundarySpec,
    flatten,
    header_buffer,
    message_tag,
    sample_shapes,
    shape_header,
    unflatten,
)
from dapple.schedule.ir import Action, ActionKind
from dapple.schedule.registry import get_schedule

__all__ = ["StageExecutor", "draws_keyed"]

K = ActionKind
_UNKEYED = contextlib.nullcontext()
"""What a stage without keyed randomness runs its backwards under (reusable)."""


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
    """Dynamic shapes, backward: posted when ``B`` waits (the activations did not exist yet)."""


@dataclass
class _MicroBatch:
    inputs: tuple[Any, ...] = ()
    output: tuple[Any, ...] = ()
    loss: torch.Tensor | None = None
    held: list[Held] = field(default_factory=list)
    sends: list[Any] = field(default_factory=list)
    whole: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None
    """Split backward: what ``W`` back-propagates when it is the whole backward (a stage whose
    inputs carry no gradient): :meth:`StageExecutor._output_grads` as ``I`` found it."""
    groups: ParamGroups | None = None
    """Split backward: what ``I`` left for ``W`` (:func:`input_gradients`)."""
    weights: list[nn.Parameter] = field(default_factory=list)
    """Split backward, ``live_weights``: the parameters ``I`` found in the module."""


def draws_keyed(module: nn.Module) -> bool:
    """Whether ``module`` may draw keyed randomness (:mod:`dapple.models.rng`): it holds a
    random site of a traced piece (:class:`KeyedDropout`, :class:`KeyedAttention`), or a module
    of a class from neither torch nor dapple (user code, which may call the keyed functions)."""
    for sub in module.modules():
        if isinstance(sub, (KeyedDropout, KeyedAttention)):
            return True
        if not type(sub).__module__.startswith(("torch.", "dapple.")):
            return True
    return False


def _peers(plan: Plan, s: int, other: int, tensor_rank: int) -> dict[int, tuple[list[int], int]]:
    """Each replica of stage ``other`` -> (the ranks of its tensor group this rank sends to,
    the rank it receives from) (:func:`~dapple.runtime.parallel.stage_mesh.peer_ranks`)."""
    st, ot = plan.stages[s], plan.stages[other]
    t = st.tensor_width
    return {
        k: (peer_ranks(ot, k, tensor_rank, t, True), peer_ranks(ot, k, tensor_rank, t, False)[0])
        for k in range(ot.replicas)
    }


class StageExecutor:
    """Runs the compute and communication actions of replica ``j`` of stage ``s``.

    Attributes:
        waiting_on: ``(what, peer rank)`` while blocked on a peer (for error messages).
    """

    def __init__(
        self,
        plan: Plan,
        stage: int,
        replica: int,
        module: nn.Module,
        specs: list[BoundarySpec],
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        device: torch.device,
        recompute: bool,
        meter: ActivationMeter,
        precision: Precision | None = None,
        dynamic: bool = False,
        seed: int = 0,
        tensor_rank: int = 0,
    ) -> None:
        self.plan, self.s, self.j = plan, stage, replica
        self.tensor_rank = tensor_rank
        """This rank's index in its tensor group (t_s > 1; every index runs the same program)."""
        self.before_backward: Callable[[int], None] | None = None
        """Called with the micro-batch before each ``B`` or ``I`` (ZeRO-3's reduce switch)."""
        self.after_weights: Callable[[int], None] | None = None
        """Called with the micro-batch after each ``W`` or ``B`` (ZeRO-3's held reduce-scatter)."""
        self.live_weights = False
        """FSDP2 swaps shards for whole parameters in a step: ``I`` reads them, ``W`` reuses."""
        self.seed = seed
        """The run seed: with the step and the samples' global rows it keys the random sites
        (:mod:`dapple.models.rng`)."""
        self.keyed = draws_keyed(module)
        """The stage may draw keyed randomness: its F and B run under :func:`keyed` (a stage
        without random sites runs without it)."""
        self.step = 0
        self.dynamic = dynamic
        """Boundary shapes change from step to step: messages carry shape headers."""
        self.precision = precision or Precision("fp32", device)
        """Autocast of the stage's forwards and the fp16 loss scale."""
        self.module, self.loss_fn, self.device = module, loss_fn, device
        self.recompute, self.meter = recompute, meter
        self.split = get_schedule(plan.schedule).split_backward
        """The backward runs as ``I`` then ``W`` (:mod:`dapple.models.split_backward`)."""
        self.on_grad_ready: Callable[[torch.Tensor], None] | None = None
        """Told of each parameter whose gradient a ``W`` completed (the interpreter's gradient
        reductions; a whole backward tells them through autograd's hooks instead)."""
        self.weights = [p for p in module.parameters() if p.requires_grad]
        self.metering = True
        """Count held activations in ``meter`` this step (the engine turns it off on steps whose
        peak is already known: saved-tensor hooks cost ~5% of a CPU step)."""
        b = plan.micro_batch_size
        S = plan.num_stages
        self.last = stage == S - 1
        """The last stage: its forwards compute the loss."""
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
        self.waiting_on: tuple[str, int] | None = None
        rank = plan.stages[stage].tensor_group(replica)[tensor_rank]
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.slow = Slowdown(slowdown_factor(rank), sync)
        """This rank's emulated slow-down of its compute (``DAPPLE_SLOWDOWN``; 1: none)."""
        self._mb: dict[int, _MicroBatch] = {}
        self._recv_f: dict[int, list[_Recv]] = {}
        self._recv_b: dict[int, list[_Recv]] = {}
        self._grad_in: dict[int, tuple[torch.Tensor, ...]] = {}
        self._grad_in_left: dict[int, int] = {}
        self._pending_sends: list[Any] = []
        self._batch_inputs: tuple[Any, ...] = ()
        self._batch_is_tuple = False
        self._targets: torch.Tensor | None = None
        self._global_batch = plan.global_batch_size
        self.loss_sum: torch.Tensor | float = 0.0
        """The step's loss part so far (last stage): a float64 tensor on the device, summed
        without reading it on the host (0.0 before the first loss)."""

    # -- per step -----------------------------------------------------------------------------
    def begin_step(self, inputs: Any, targets: torch.Tensor, step: int = 0) -> None:
        """Take step ``step``'s global batch (only stage 0 reads inputs, the last stage
        targets)."""
        self.step = step
        self._batch_is_tuple = isinstance(inputs, (tuple, list))
        self._batch_inputs = flatten(inputs)
        self._targets = targets
        self.loss_sum = 0.0

    def finish_sends(self) -> None:
        """Wait for every outstanding send of this step (before buffers may be reused)."""
        for mb in self._mb.values():
            self._pending_sends += mb.sends
            mb.sends = []
        for w in self._pending_sends:
            self.waiting_on = ("send completion", -1)
            w.wait()
        self._pending_sends = []
        self.waiting_on = None
        self._mb.clear()
        self._grad_in.clear()
        self._grad_in_left.clear()

    def release(self, a: Action) -> None:
        """Forget the inputs and outputs of ``a``'s micro-batch (a forward-only pass keeps
        nothing for a backward); its sends stay pending until :meth:`finish_sends`."""
        assert a.micro_batch is not None
        self._drop(a.micro_batch)

    def _drop(self, m: int) -> None:
        """Forget micro-batch ``m`` (its held activations too); its sends stay pending."""
        st = self._mb.pop(m)
        self._pending_sends += st.sends
        for h in st.held:
            h.release()

    def handlers(self) -> dict[ActionKind, Callable[[Action], None]]:
        """The handler of each action kind this executor runs (F, B and the sends and receives;
        ``AR`` and ``OPT`` belong to :mod:`dapple.runtime.interpreter`)."""
        return {
            K.RECV_F: self.recv_forward,
            K.FORWARD: self.forward,
            K.SEND_F: self.send_forward,
            K.RECV_B: self.recv_backward,
            K.BACKWARD: self.backward,
            K.BACKWARD_INPUT: self.backward_input,
            K.BACKWARD_WEIGHT: self.backward_weight,
            K.SEND_B: self.send_backward,
        }

    def recv_forward(self, a: Action) -> None:
        """``RECV_F``: post the receives of a slice of micro-batch activations."""
        assert a.micro_batch is not None
        self._post_recv(self._recv_f, a.micro_batch, a.peer, backward=False)
        self._poll_sends()

    def forward(self, a: Action) -> None:
        """``F``: wait for the inputs, compute, and (last stage) the scaled loss."""
        assert a.micro_batch is not None
        if self.keyed:
            with self._keys(a.micro_batch):
                self._forward(a.micro_batch)
        else:
            self._forward(a.micro_batch)
        if self._pending_sends:
            self._poll_sends()

    def send_forward(self, a: Action) -> None:
        """``SEND_F``: post the sends of the activations' slice for replica ``a.peer``."""
        assert a.micro_batch is not None
        self._send_forward(a.micro_batch, a.peer)
        self._poll_sends()

    def recv_backward(self, a: Action) -> None:
        """``RECV_B``: post the receives of a slice of output gradients."""
        assert a.micro_batch is not None
        self._post_recv(self._recv_b, a.micro_batch, a.peer, backward=True)
        self._poll_sends()

    def backward(self, a: Action) -> None:
        """``B``: wait for the output gradients (not on the last stage) and back-propagate."""
        assert a.micro_batch is not None
        if self.keyed:
            with self._keys(a.micro_batch):  # a re-computation draws the forward's masks again
                self._backward(a.micro_batch)
        else:
            self._backward(a.micro_batch)
        if self._pending_sends:
            self._poll_sends()

    def backward_input(self, a: Action) -> None:
        """``I``: wait for the output gradients and compute the input gradients only (a stage
        whose inputs carry no gradient keeps the output gradients for its ``W``)."""
        assert a.micro_batch is not None
        m = a.micro_batch
        st = self._mb[m]
        outs, gs = self._output_grads(m)
        inputs = [x for x in st.inputs if x.requires_grad]
        if self.before_backward is not None:
            self.before_backward(m)
        if self.live_weights:
            st.weights = [p for p in self.module.parameters() if p.requires_grad]
        if inputs and outs:
            with self._keys(m), self.slow():
                st.groups = input_gradients(outs, gs, inputs, st.weights or self.weights)
        else:
            st.whole = (outs, gs)
        self._after_input_grads(m)
        self._poll_sends()

    def backward_weight(self, a: Action) -> None:
        """``W``: the parameters' gradients of micro-batch ``m`` from what its ``I`` left."""
        assert a.micro_batch is not None
        m = a.micro_batch
        st = self._mb[m]
        with self._keys(m), self.slow():
            if st.groups is not None:
                weight_gradients(st.groups, st.weights or self.weights, self.on_grad_ready)
            elif st.whole is not None and st.whole[0]:
                torch.autograd.backward(*st.whole)
        self._drop(m)
        if self.after_weights is not None:
            self.after_weights(m)
        self._poll_sends()

    def send_backward(self, a: Action) -> None:
        """``SEND_B``: post the sends of the input gradients' slice for replica ``a.peer``."""
        assert a.micro_batch is not None
        self._send_backward(a.micro_batch, a.peer)
        self._poll_sends()

    # -- helpers -------------------------------------------------------------------------------
    def _keys(self, m: int) -> contextlib.AbstractContextManager[None]:
        """Key the random sites by this step and micro-batch ``m``'s rows of this replica
        (nothing to key on a stage that draws none)."""
        if not self.keyed:
            return _UNKEYED
        b = self.plan.micro_batch_size
        return keyed(self.seed, self.step, m * b + self.lo, self.hi - self.lo)

    def _poll_sends(self) -> None:
        self._pending_sends = [w for w in self._pending_sends if not w.is_completed()]

    def _post_recv(self, table: dict[int, list[_Recv]], m: int, peer: Any, backward: bool) -> None:
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
        if not self.dynamic:
            bufs = [t.buffer(hi - lo, self.device) for t in specs]
            table.setdefault(m, []).append(
                _Recv(lo, hi, rank, bufs, self._irecv(bufs, rank, m, backward))
            )
        elif not backward:
            assert self.in_spec is not None
            hdr = header_buffer(self.in_spec, self.device)
            tag = message_tag(m, False, HEADER_INDEX, self.s - 1)
            work = comm.irecv(hdr, src=rank, tag=tag)
            table.setdefault(m, []).append(_Recv(lo, hi, rank, [], [work], header=hdr))
        else:
            r = _Recv(lo, hi, rank, [], [], deferred=True)
            if m in self._mb:
                self._post_grad_recv(r, m)
            table.setdefault(m, []).append(r)

    def _irecv(self, bufs: list[torch.Tensor], rank: int, m: int, backward: bool) -> list[Any]:
        return [
            comm.irecv(buf, src=rank, tag=message_tag(m, backward, i, self.s - 1 + backward))
            for i, buf in enumerate(bufs)
        ]

    def _post_grad_recv(self, r: _Recv, m: int) -> None:
        """Dynamic shapes: the gradient buffers of rows ``[r.lo, r.hi)`` of micro-batch ``m``'s
        activations, shaped like them."""
        outs = [t for t in self._mb[m].output if t.dtype.is_floating_point or t.dtype.is_complex]
        r.buffers = [
            torch.empty((r.hi - r.lo, *t.shape[1:]), dtype=t.dtype, device=self.device)
            for t in outs
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

    def _wait_concat(self, table: dict[int, list[_Recv]], m: int, what: str) -> list[torch.Tensor]:
        pieces = sorted(table.pop(m), key=lambda r: r.lo)
        for r in pieces:  # dynamic shapes: size and post every piece's data before waiting
            if r.header is not None:
                self._post_data_recv(r, m, what)
            elif r.deferred:
                self._post_grad_recv(r, m)
        for r in pieces:
            self.waiting_on = (f"{what} of micro-batch {m}", r.rank)
            for w in r.works:
                w.wait()
        self.waiting_on = None
        n = len(pieces[0].buffers)
        if len(pieces) == 1:
            return pieces[0].buffers
        return [torch.cat([r.buffers[i] for r in pieces]) for i in range(n)]

    def _stage_fn(self, *tensors: Any) -> Any:
        is_tuple = self.in_spec.is_tuple if self.in_spec is not None else self._batch_is_tuple
        return self.module(unflatten(is_tuple, tensors))

    def _forward(self, m: int) -> None:
        b = self.plan.micro_batch_size
        st = _MicroBatch()
        metering = self.metering
        if self.s == 0:
            r0, r1 = m * b + self.lo, m * b + self.hi
            # a copy, metered or not: a view would keep (and be metered as) the whole global
            # batch, and its offset in memory can change a kernel's rounding, so a step that is
            # metered (after a resume: its first) would not compute what an unmetered one does
            xs = [t[r0:r1].to(self.device, copy=True) for t in self._batch_inputs]
        else:
            xs = self._wait_concat(self._recv_f, m, "activations")
            for t in xs:
                if t.dtype.is_floating_point or t.dtype.is_complex:
                    t.requires_grad_(True)
        st.inputs = tuple(xs)
        if metering:
            st.held = self.meter.hold(xs)
            with self.meter.saved_tensors_hooks(), self.slow():
                out = self._compute(m, st, xs)
        else:
            with self.slow():
                out = self._compute(m, st, xs)
        if not self.last:
            st.output = flatten(out)
            if self.split:  # the split backward detaches its outputs in place: copies that
                # no autograd node saves (a layer may save its own output, e.g. tanh)
                st.output = tuple(
                    t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t
                    for t in st.output
                )
            if metering:
                st.held += self.meter.hold(st.output)
        self._mb[m] = st

    def _compute(self, m: int, st: _MicroBatch, xs: list[torch.Tensor]) -> Any:
        """The stage's layers on ``xs`` (under autocast, re-computed in ``B`` with
        ``recompute``) and, on the last stage, micro-batch ``m``'s scaled loss into ``st``
        and the step's loss sum."""
        if self.precision.dtype is not None:
            with self.precision.autocast():  # checkpoint replays the recompute under it too
                out = self._layers(xs)
        else:
            out = self._layers(xs)
        if self.last:
            b = self.plan.micro_batch_size
            assert self._targets is not None
            tgt = self._targets[m * b + self.lo : m * b + self.hi].to(self.device, copy=True)
            out = to_fp32(out) if self.precision.dtype is not None else out  # fp32 loss
            st.loss = self.loss_fn(out, tgt) * ((self.hi - self.lo) / self._global_batch)
            part = st.loss.detach()  # summed in float64, without a host read
            total = self.loss_sum
            self.loss_sum = (
                total + part if isinstance(total, torch.Tensor) else part.to(torch.float64)
            )
        return out

    def _layers(self, xs: list[torch.Tensor]) -> Any:
        if self.recompute:
            return checkpoint(self._stage_fn, *xs, use_reentrant=False)
        return self._stage_fn(*xs)

    def _send_forward(self, m: int, peer: Any) -> None:
        st = self._mb[m]
        lo, hi = self.out_rows[peer]
        for rank in self.next_ranks[peer][0]:
            if self.dynamic:
                hdr = shape_header(st.output, self.device)
                tag = message_tag(m, False, HEADER_INDEX, self.s)
                st.sends.append(comm.isend(hdr, dst=rank, tag=tag))
            for i, t in enumerate(st.output):
                piece = t.detach()[lo - self.lo : hi - self.lo].contiguous()
                st.sends.append(comm.isend(piece, dst=rank, tag=message_tag(m, False, i, self.s)))

    def _output_grads(self, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors micro-batch ``m``'s backward starts from and their gradients: the scaled
        loss (gradients None: ones) on the last stage, else the outputs that carry a gradient
        and the received gradients (waited for)."""
        st = self._mb[m]
        if st.loss is not None:
            return [self.precision.scale(st.loss)], None  # x S under fp16
        grads = self._wait_concat(self._recv_b, m, "gradients")
        outs, gs = [], []
        gi = iter(grads)
        for t in st.output:
            if t.dtype.is_floating_point or t.dtype.is_complex:
                g = next(gi)
                if t.requires_grad:
                    outs.append(t)
                    gs.append(g)
        return outs, gs

    def _backward(self, m: int) -> None:
        if self.before_backward is not None:
            self.before_backward(m)
        outs, gs = self._output_grads(m)
        if outs:
            with self.slow():
                torch.autograd.backward(outs, gs)
        self._after_input_grads(m)
        self._drop(m)
        if self.after_weights is not None:
            self.after_weights(m)

    def _after_input_grads(self, m: int) -> None:
        """Micro-batch ``m``'s input gradients are computed: keep them for ``SEND_B``."""
        st = self._mb[m]
        # The activations' sends finished logically (their gradient came back); reap them.
        self._pending_sends += st.sends
        st.sends = []
        if self.s > 0:
            self._grad_in[m] = tuple(
                (x.grad if x.grad is not None else torch.zeros_like(x))
                for x in st.inputs
                if x.dtype.is_floating_point or x.dtype.is_complex
            )
            self._grad_in_left[m] = len(self.in_rows)

    def _send_backward(self, m: int, peer: Any) -> None:
        lo, hi = self.in_rows[peer]
        for rank in self.prev_ranks[peer][0]:
            for i, g in enumerate(self._grad_in[m]):
                piece = g[lo - self.lo : hi - self.lo].contiguous()
                tag = message_tag(m, True, i, self.s - 1)
                self._pending_sends.append(comm.isend(piece, dst=rank, tag=tag))
        self._grad_in_left[m] -= 1
        if self._grad_in_left[m] == 0:  # the pending sends keep their pieces alive
            del self._grad_in[m], self._grad_in_left[m]
