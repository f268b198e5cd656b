"""One replica of one stage executing lowered actions (F, B and split-concat send/recv).

Index conventions: ``s`` stage, ``j`` this replica, ``m`` micro-batch, ``b`` micro-batch size;
replica ``j`` of stage ``s`` owns samples ``slice_bounds(b, r_s, shares_s)[j] = [lo, hi)`` of
every micro-batch (an even split, or the stage's per-replica shares). Data: every rank builds
the same global batch locally (``workload.make_batch(G, seed + step)``) and slices its own rows,
so stage 0 replicas take their inputs and last-stage replicas their targets without any label
traffic. Between stages only activations (forward) and their gradients (backward) travel: the
split-concat messages of :class:`dapple.runtime.stage_links.StageLinks` (with shape headers
when ``dynamic=True``).

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
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from dapple.core.plan import Plan
from dapple.models.rng import KeyedAttention, KeyedDropout, keyed
from dapple.models.split_backward import (
    ParamGroups,
    input_gradients,
    weight_gradients,
    weight_nodes,
)
from dapple.runtime.memory import ActivationMeter, Held
from dapple.runtime.precision import Precision, to_fp32
from dapple.runtime.slowdown import Slowdown, slowdown_factor
from dapple.runtime.stage_links import StageLinks
from dapple.runtime.transport import BoundarySpec, flatten, unflatten
from dapple.schedule.ir import Action, ActionKind
from dapple.schedule.registry import get_schedule

__all__ = ["StageExecutor", "draws_keyed", "grad_accumulators"]

K = ActionKind
_UNKEYED = contextlib.nullcontext()
"""What a stage without keyed randomness runs its backwards under (reusable)."""


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


def _detachable(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Stage outputs the split backward may detach in place (:func:`input_gradients`): each
    output itself, or a copy where ``detach_`` would fail or reach back into the stage (a view,
    which torch refuses to detach in place, or a leaf: an input passed through). An output
    only its own node saved (tanh's) is kept as the node's own alias, which the detach leaves
    alone; with several outputs that carry gradients, one may be saved by the node of another
    (``(a, f(a))``), which a detach in place would break: all of them are copied."""
    grads = [isinstance(t, torch.Tensor) and t.requires_grad for t in outputs]
    every = sum(grads) > 1
    return tuple(
        t.clone() if g and (every or t._is_view() or t.grad_fn is None) else t
        for t, g in zip(outputs, grads, strict=True)
    )


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


def grad_accumulators(params: list[nn.Parameter]) -> list[Any]:
    """The gradient accumulator (autograd's ``AccumulateGrad`` node) of each parameter that
    requires a gradient (a DTensor's are left out: ZeRO-3 computes on the whole parameters it
    gathers, each with its own).

    Autograd holds a parameter's accumulator only while a graph refers to it: once a
    micro-batch's backward has freed its graph, the next forward would build every one again
    (and the backward destroy them). Holding them, as DDP's reducer does, keeps one per
    parameter for the run."""
    with torch.enable_grad():
        return [
            p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            for p in params
            if p.requires_grad and not isinstance(p, DTensor)
        ]


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
        self._weight_nodes: dict[Any, nn.Parameter] | None = None
        """Split backward: :attr:`weights` by their gradient accumulators (built at the first
        ``W`` and held, :func:`weight_nodes`)."""
        self._accumulators = grad_accumulators(self.weights)
        """The parameters' gradient accumulators, held for the run (:func:`grad_accumulators`:
        a micro-batch's forward finds them instead of building them)."""
        self.metering = True
        """Count held activations in ``meter`` this step (the engine turns it off on steps whose
        peak is already known: saved-tensor hooks cost ~5% of a CPU step)."""
        self.last = stage == plan.num_stages - 1
        """The last stage: its forwards compute the loss."""
        self.links = StageLinks(plan, stage, replica, specs, device, dynamic, tensor_rank)
        """The stage's split-concat messages (its rows ``[lo, hi)`` of every micro-batch)."""
        self.lo, self.hi = self.links.lo, self.links.hi
        rank = plan.stages[stage].tensor_group(replica)[tensor_rank]
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.slow = Slowdown(slowdown_factor(rank), sync)
        """This rank's emulated slow-down of its compute (``DAPPLE_SLOWDOWN``; 1: none)."""
        self._slowed = self.slow.factor != 1.0
        """The compute runs under :attr:`slow` (K > 1); at K = 1 it runs without a context."""
        self._mb: dict[int, _MicroBatch] = {}
        self._batch_inputs: tuple[Any, ...] = ()
        self._batch_is_tuple = False
        self._targets: torch.Tensor | None = None
        self._inputs_here = False
        """The step's inputs are on the device already: a micro-batch's rows are sliced there
        (no conversion to look up)."""
        self._exact_inputs: tuple[bool, ...] = ()
        """Per input of the step: integers (token ids, labels), whose rows an unmetered forward
        reads through a view (no rounding depends on their place in memory)."""
        self._targets_here: bool | None = None
        """The step's targets are on the device already (None: not; a micro-batch's rows are
        copied there), and are integers (True: read through a view, where no rounding depends
        on their place in memory; False: cloned)."""
        self._global_batch = plan.global_batch_size
        self._part64 = torch.zeros((), dtype=torch.float64, device=device)
        """A micro-batch's loss as float64, overwritten by the next (its sum is a new tensor)."""
        self._zero64 = torch.zeros((), dtype=torch.float64, device=device)
        """The last stage's loss sum before a step's first loss (never written)."""
        self.loss_sum: torch.Tensor | float = 0.0
        """The step's loss part so far: on the last stage a float64 tensor on the device, summed
        without reading it on the host (:attr:`_zero64` before the first loss); 0.0 elsewhere."""

    # -- per step -----------------------------------------------------------------------------
    def begin_step(self, inputs: Any, targets: torch.Tensor, step: int = 0) -> None:
        """Take step ``step``'s global batch (only stage 0 reads inputs, the last stage
        targets)."""
        self.step = step
        self._batch_is_tuple = isinstance(inputs, (tuple, list))
        self._batch_inputs = tuple(self._staged(t) for t in flatten(inputs)) if self.s == 0 else ()
        self._targets = self._staged(targets) if self.last else targets
        self._inputs_here = all(t.device == self.device for t in self._batch_inputs)
        self._exact_inputs = tuple(
            not (t.dtype.is_floating_point or t.dtype.is_complex) for t in self._batch_inputs
        )
        t = self._targets
        here = isinstance(t, torch.Tensor) and t.device == self.device
        self._targets_here = (not t.dtype.is_floating_point) if here else None
        self.loss_sum = self._zero64 if self.last else 0.0

    def _staged(self, t: Any) -> Any:
        """A host tensor in pinned memory when this rank computes on CUDA, so that each
        micro-batch's slice goes to the device without waiting (a copy from pageable memory
        synchronises the stream first: the host would wait for the kernels already queued)."""
        if self.device.type == "cuda" and isinstance(t, torch.Tensor) and t.device.type == "cpu":
            return t.pin_memory()
        return t

    def finish_sends(self) -> None:
        """Wait for every outstanding send of this step (before buffers may be reused)."""
        self.links.finish([w for mb in self._mb.values() for w in mb.sends])
        self._mb.clear()

    def release(self, a: Action) -> None:
        """Forget the inputs and outputs of ``a``'s micro-batch (a forward-only pass keeps
        nothing for a backward); its sends stay pending until :meth:`finish_sends`."""
        assert a.micro_batch is not None
        self._drop(a.micro_batch)

    def _drop(self, m: int) -> None:
        """Forget micro-batch ``m`` (its held activations too); its sends stay pending."""
        st = self._mb.pop(m)
        self.links.pending += st.sends
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
        assert a.micro_batch is not None and a.peer is not None
        self.links.post_recv(a.micro_batch, a.peer, False, None)
        self.links.poll()

    def forward(self, a: Action) -> None:
        """``F``: wait for the inputs, compute, and (last stage) the scaled loss."""
        assert a.micro_batch is not None
        if self.keyed:
            with self._keys(a.micro_batch):
                self._forward(a.micro_batch)
        else:
            self._forward(a.micro_batch)
        if self.links.pending:
            self.links.poll()

    def send_forward(self, a: Action) -> None:
        """``SEND_F``: post the sends of the activations' slice for replica ``a.peer``."""
        assert a.micro_batch is not None and a.peer is not None
        self._mb[a.micro_batch].sends += self.links.send_forward(
            a.micro_batch, a.peer, self._mb[a.micro_batch].output
        )
        self.links.poll()

    def recv_backward(self, a: Action) -> None:
        """``RECV_B``: post the receives of a slice of output gradients."""
        assert a.micro_batch is not None and a.peer is not None
        st = self._mb.get(a.micro_batch)
        self.links.post_recv(a.micro_batch, a.peer, True, None if st is None else st.output)
        self.links.poll()

    def backward(self, a: Action) -> None:
        """``B``: wait for the output gradients (not on the last stage) and back-propagate."""
        assert a.micro_batch is not None
        if self.keyed:
            with self._keys(a.micro_batch):  # a re-computation draws the forward's masks again
                self._backward(a.micro_batch)
        else:
            self._backward(a.micro_batch)
        if self.links.pending:
            self.links.poll()

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
        self.links.poll()

    def backward_weight(self, a: Action) -> None:
        """``W``: the parameters' gradients of micro-batch ``m`` from what its ``I`` left."""
        assert a.micro_batch is not None
        m = a.micro_batch
        st = self._mb[m]
        with self._keys(m), self.slow():
            if st.groups is not None and st.weights:  # FSDP2's whole parameters of this step
                weight_gradients(st.groups, st.weights, self.on_grad_ready)
            elif st.groups is not None:
                if self._weight_nodes is None:
                    self._weight_nodes = weight_nodes(self.weights)
                weight_gradients(st.groups, self.weights, self.on_grad_ready, self._weight_nodes)
            elif st.whole is not None and st.whole[0]:
                torch.autograd.backward(*st.whole)
        self._drop(m)
        if self.after_weights is not None:
            self.after_weights(m)
        self.links.poll()

    def send_backward(self, a: Action) -> None:
        """``SEND_B``: post the sends of the input gradients' slice for replica ``a.peer``."""
        assert a.micro_batch is not None and a.peer is not None
        self.links.send_backward(a.micro_batch, a.peer)
        self.links.poll()

    # -- helpers -------------------------------------------------------------------------------
    def _keys(self, m: int) -> contextlib.AbstractContextManager[None]:
        """Key the random sites by this step and micro-batch ``m``'s rows of this replica
        (nothing to key on a stage that draws none)."""
        if not self.keyed:
            return _UNKEYED
        b = self.plan.micro_batch_size
        return keyed(self.seed, self.step, m * b + self.lo, self.hi - self.lo)

    def _stage_fn(self, *tensors: Any) -> Any:
        spec = self.links.in_spec
        is_tuple = spec.is_tuple if spec is not None else self._batch_is_tuple
        return self.module(unflatten(is_tuple, tensors))

    def _forward(self, m: int) -> None:
        b = self.plan.micro_batch_size
        st = _MicroBatch()
        metering = self.metering
        if self.s == 0:
            r0, r1 = m * b + self.lo, m * b + self.hi
            # floating rows: a copy, metered or not: a view's offset in memory can change a
            # kernel's rounding, so a step that is metered (after a resume: its first) would not
            # compute what an unmetered one does. Integer rows: a view, copied only while metered
            # (a view would keep, and be metered as, the whole global batch)
            if self._inputs_here:
                xs = [
                    t[r0:r1] if exact and not metering else t[r0:r1].clone()
                    for t, exact in zip(self._batch_inputs, self._exact_inputs, strict=True)
                ]
            else:
                xs = [t[r0:r1].to(self.device, copy=True, non_blocking=True)
                      for t in self._batch_inputs]  # fmt: skip
        else:
            xs = self.links.wait_concat(m, False)
            for t in xs:
                if t.dtype.is_floating_point or t.dtype.is_complex:
                    t.requires_grad_(True)
        st.inputs = tuple(xs)
        if metering:
            st.held = self.meter.hold(xs)
            with self.meter.saved_tensors_hooks(), self.slow():
                out = self._compute(m, st, xs)
        elif self._slowed:
            with self.slow():
                out = self._compute(m, st, xs)
        else:
            out = self._compute(m, st, xs)
        if not self.last:
            st.output = flatten(out)
            if self.split:  # the split backward detaches its outputs in place
                st.output = _detachable(st.output)
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
        elif self.recompute:
            out = self._layers(xs)
        else:
            out = self._stage_fn(*xs)
        if self.last:
            b = self.plan.micro_batch_size
            assert self._targets is not None
            tgt = self._targets[m * b + self.lo : m * b + self.hi]
            if self._targets_here is None:
                tgt = tgt.to(self.device, copy=True, non_blocking=True)
            elif not self._targets_here:  # integer targets already here: read as they are
                tgt = tgt.clone()
            out = to_fp32(out) if self.precision.dtype is not None else out  # fp32 loss
            st.loss = self.loss_fn(out, tgt) * ((self.hi - self.lo) / self._global_batch)
            # summed in float64 without a host read: the part is converted as it is copied
            # into a held float64 scalar, then added (each sum a new tensor: the guard keeps them)
            self.loss_sum = self.loss_sum + self._part64.copy_(st.loss.detach())
        return out

    def _layers(self, xs: list[torch.Tensor]) -> Any:
        if self.recompute:
            return checkpoint(self._stage_fn, *xs, use_reentrant=False)
        return self._stage_fn(*xs)

    def _output_grads(self, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors micro-batch ``m``'s backward starts from and their gradients: the scaled
        loss (gradients None: ones) on the last stage, else the outputs that carry a gradient
        and the received gradients (waited for)."""
        st = self._mb[m]
        if st.loss is not None:
            return [self.precision.scale(st.loss)], None  # x S under fp16
        grads = self.links.wait_concat(m, True, st.output)
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
        st = self._mb[m]
        if st.loss is not None and self.precision.scaler is None:  # _output_grads' own case
            outs, gs = [st.loss], None
        else:
            outs, gs = self._output_grads(m)
        if outs and self._slowed:
            with self.slow():
                torch.autograd.backward(outs, gs)
        elif outs:
            torch.autograd.backward(outs, gs)
        self._after_input_grads(m)
        self._drop(m)
        if self.after_weights is not None:
            self.after_weights(m)

    def _after_input_grads(self, m: int) -> None:
        """Micro-batch ``m``'s input gradients are computed: keep them for ``SEND_B``."""
        st = self._mb[m]
        # The activations' sends finished logically (their gradient came back); reap them.
        self.links.pending += st.sends
        st.sends = []
        if self.s > 0:
            self.links.keep_grads(m, st.inputs)

    @property
    def waiting_on(self) -> tuple[str, int] | None:
        """``(what, peer rank)`` while blocked on a peer (for error messages)."""
        return self.links.waiting_on
