"""Sharded training state inside a replicated stage (ZeRO-1 and ZeRO-2, per stage).

DAPPLE replicates stage ``s`` on ``r_s`` devices and all-reduces its gradients, AR(P_s, g_s);
without sharding every replica then runs the same optimizer update on the whole stage and
keeps the whole optimizer state (Adam: two fp32 moments, 8 of the 16 bytes per parameter).
With ``TrainConfig.zero_stage`` (every replicated stage) or ``StagePlan.zero_stage`` (that
stage, as ``dapple plan --zero-stage`` records it) at 1 or 2, each replica of a stage with
``r_s > 1`` keeps and updates ``1/r_s`` of the stage's parameters (:class:`FlatShards`):

- ZeRO-1: the gradients accumulate over the step's micro-batches, in place, in flat bucket
  buffers (``p.grad`` is a view of its bucket: a parameter's first gradient of the step is
  copied in - no zeroing, no full-size add - later ones add to it); from the last backward on
  each bucket is
  reduce-scattered (``torch.distributed.reduce_scatter_single``, SUM) as soon as its gradients are final, so
  every replica receives the reduced gradient of its own chunk of the bucket - the bytes of
  the AllReduce's reduce-scatter half - while backward still runs.
- ZeRO-2: no full-size gradient buffer: after *every* micro-batch's backward each bucket is
  copied into a staging buffer, the parameters' gradients are freed and the bucket is
  reduce-scattered and added to this replica's gradient shard - M times ZeRO-1's gradient
  traffic, for ``1/r_s`` of the gradient memory (at most :data:`MAX_STAGED` buckets are staged
  at once).

In both, the optimizer's parameters are views of this replica's chunks of the flat parameter
buffers (:attr:`FlatShards.pieces`, cut at parameter boundaries so each keeps its weight-decay
group), their gradients views of the gradient shard; after the update every bucket is
all-gathered in place (``torch.distributed.all_gather_single``, :meth:`FlatShards.gather`),
the first layers' buckets first, and waited for by each layer as it next runs forward (a
forward pre-hook), so the gather overlaps the next step up to and during its forward.
torch 2.13 runs both on gloo (CPU) and NCCL (they are the ``reduce_scatter_tensor`` /
``all_gather_into_tensor`` of earlier releases, which 2.13 deprecates), but gloo's are slow: 4
CPU processes on 2 cores took 590-750 ms to reduce-scatter 29.5M floats - twice the 330-390 ms
of an AllReduce of them, with a temporary the size of the input - and 210-270 ms to all-gather
them. On gloo, the stage's group therefore reduces each chunk to its owner
(``torch.distributed.reduce``, one per replica, asynchronous: 175 ms, the reduce-scatter's
bytes, in place) and gathers by one ``broadcast`` per chunk from its owner (86-95 ms).

Design choices:
    - Layout: the stage's trainable parameters, in reverse order (the order backward makes
      their gradients final), are cut into buckets of about :data:`~dapple.runtime.sync.BUCKET_BYTES`;
      a bucket of ``n`` elements is padded to ``P = r * ceil(n / r)`` and replica ``j`` owns
      its chunk ``[j P / r, (j + 1) P / r)``. The parameters become views of their bucket's
      flat buffer (built one bucket at a time, so the copy adds one bucket to the peak, not
      the stage). Each replica thus updates exactly ``1/r_s`` of every bucket, and a bucket's
      reduce-scatter can start while backward computes earlier layers.
    - The update of each element is the unsharded one (Adam/AdamW/SGD are elementwise), so a
      sharded run equals an unsharded one to rounding; the global gradient norm counts every
      replica's gradient shard (each element once over the replicas), clipping and fp16
      unscaling scale the shard.
    - Parameters of tied groups (``Workload.tied_parameters``) stay whole: their gradients are
      summed across copies after the stage reduction (:mod:`dapple.runtime.sync`), and every
      replica updates them as without sharding.
    - Checkpoints stay complete and layer-keyed: at a save every replica sends the optimizer
      state of its pieces to replica 0 (:meth:`FlatShards.layer_states`), which writes each
      parameter's state whole; at a resume each replica slices its pieces' state out of the
      layer files (:func:`dapple.runtime.checkpoint.restore_stage`), so a checkpoint saved
      under any plan or zero stage resumes under any other.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.plan import Plan
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import LayerState, stage_layer_states
from dapple.runtime.optim_config import ZERO_STAGES
from dapple.runtime.sync import BUCKET_BYTES

__all__ = [
    "MAX_STAGED",
    "ZERO_STAGES",
    "FlatShards",
    "Piece",
    "flat_parameters",
    "unsharded_stages",
]

logger = logging.getLogger(__name__)

TENSOR_COLLECTIVES_ENV = "DAPPLE_TEST_ZERO_TENSOR_COLLECTIVES"
"""Test hook: with ``1`` here gloo groups use ``reduce_scatter_single``/``all_gather_single``
too (the path of other backends), so it can be tested on the CPU."""

MAX_STAGED = 2
"""ZeRO-2: buckets being reduced at once; launching another first waits for the oldest (so the
staged gradients take at most this many buckets, not the stage)."""


def unsharded_stages(plan: Plan) -> list[int]:
    """The stages a zero stage does not change: those with one replica."""
    return [i for i, st in enumerate(plan.stages) if st.replicas == 1]


def flat_parameters(
    plan: Plan, workload: Workload, stage: int, module: nn.Module
) -> list[nn.Parameter]:
    """The parameters of stage ``stage`` that :class:`FlatShards` shards: the trainable ones of
    the first trainable parameter's dtype and device, without those of tied groups."""
    lo, hi = plan.stages[stage].layers
    layers = dict(zip(range(lo, hi), module.children(), strict=False))
    tied = {
        id(layers[int(i)].get_parameter(str(name)))
        for group in workload.tied_parameters
        for i, name in group
        if int(i) in layers
    }
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in tied]
    if not params:
        return []
    kind = (params[0].dtype, params[0].device)
    return [p for p in params if (p.dtype, p.device) == kind]


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one stage parameter inside this replica's chunk of a bucket."""

    param: nn.Parameter
    """The optimizer's parameter: a 1-D view of its bucket's flat parameter buffer."""
    origin: nn.Parameter
    """The stage parameter it is part of."""
    offset: int
    """Where it starts in ``origin.reshape(-1)``."""


@dataclass
class _Bucket:
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
    """Where this replica's reduced chunk lands (copied or added to the shard when done)."""
    staged: torch.Tensor | None = None
    """ZeRO-2: the micro-batch's gradients being reduced (kept alive until done)."""
    launched_sum: torch.Tensor | None = None
    """ZeRO-1: the sum of the bucket's local gradients when its reduction started (for the
    non-finite guard: on gloo the reduction overwrites them)."""


class FlatShards:
    """One replica's shard of its stage's parameters, gradients (ZeRO-2) and optimizer state.

    Args:
        plan: the plan.
        stage: s, a stage with ``r_s > 1``.
        replica: j, this rank's replica of the stage.
        module: the stage's layers.
        params: the parameters to shard (:func:`flat_parameters`); the stage's
            :class:`~dapple.runtime.sync.GradientSync` must leave them out.
        pg: the stage's replica group.
        zero_stage: 1 or 2.
        bucket_bytes: the bucket size (default :data:`~dapple.runtime.sync.BUCKET_BYTES`).
    """

    def __init__(
        self,
        plan: Plan,
        stage: int,
        replica: int,
        module: nn.Module,
        params: list[nn.Parameter],
        pg: Any,
        zero_stage: int,
        *,
        bucket_bytes: int | None = None,
    ) -> None:
        self.devices = list(plan.stages[stage].devices)
        self.r = len(self.devices)
        self.replica, self.module, self.pg, self.zero_stage = replica, module, pg, zero_stage
        self.params = params
        cap = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        runs: list[list[nn.Parameter]] = []
        size = 0
        for p in params[::-1]:
            nbytes = p.numel() * p.element_size()
            if not runs or size + nbytes > cap:
                runs.append([])
                size = 0
            runs[-1].append(p)
            size += nbytes
        like = params[0] if params else torch.empty(0)
        kw: dict[str, Any] = {"dtype": like.dtype, "device": like.device}
        self.buckets: list[_Bucket] = []
        self.pieces: list[Piece] = []
        """The optimizer's parameters, in bucket order."""
        self._where: dict[int, tuple[int, int, int]] = {}
        """``id(stage parameter) -> (bucket, index in it, offset in its flat buffer)``."""
        shard = 0
        pending: list[tuple[int, int, int, nn.Parameter]] = []  # (bucket, lo, hi, parameter)
        with torch.no_grad():
            for k, run in enumerate(runs):
                n = sum(p.numel() for p in run)
                padded = -(-n // self.r) * self.r
                chunk = padded // self.r
                bk = _Bucket(run, torch.zeros(padded, **kw), padded, shard)
                self.buckets.append(bk)
                lo, hi = replica * chunk, (replica + 1) * chunk
                off = 0
                for i, p in enumerate(run):
                    view = bk.flat[off : off + p.numel()]
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)  # the old storage goes now: one bucket extra at most
                    a, b = max(off, lo), min(off + p.numel(), hi)
                    if a < b:
                        pending.append((k, a - lo, b - a, p))
                        self.pieces.append(Piece(nn.Parameter(bk.flat[a:b]), p, a - off))
                    self._where[id(p)] = (k, i, off)
                    off += p.numel()
                if zero_stage == 1:
                    bk.grads = torch.zeros(padded, **kw)
                shard += chunk
        self.grad_shard = torch.zeros(shard, **kw)
        """This replica's chunk of every bucket's reduced gradient, in bucket order."""
        for pc, (k, at, n, _) in zip(self.pieces, pending, strict=True):
            g0 = self.buckets[k].shard_start + at
            pc.param.grad = self.grad_shard[g0 : g0 + n]
        self._sums: list[torch.Tensor] = []
        self._inflight: list[_Bucket] = []
        """ZeRO-2: the buckets whose reduction runs, oldest first."""
        self._gloo = (
            pg is not None
            and dist.get_backend(pg) == "gloo"
            and os.environ.get(TENSOR_COLLECTIVES_ENV) != "1"
        )
        """gloo: reductions as one ``reduce`` per chunk and gathers as one ``broadcast`` per
        chunk (see the module docstring)."""
        self._armed = False
        self._next = 0
        self._gathers: dict[int, list[Any]] = {}
        """The gathers in flight, by bucket (waited for at the first use of its parameters)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in params]  # type: ignore[no-untyped-call]
        for layer in module.children():
            needs = sorted({self._where[id(p)][0] for p in layer.parameters()
                            if id(p) in self._where})  # fmt: skip
            if needs:
                self._hooks.append(layer.register_forward_pre_hook(self._before_forward(needs)))

    # -- the step ----------------------------------------------------------------------------
    def owned_fraction(self) -> float:
        """The share of the stage's sharded elements this replica updates."""
        total = sum(p.numel() for p in self.params)
        return sum(pc.param.numel() for pc in self.pieces) / total if total else 0.0

    def begin_step(self) -> None:
        """Start of a step (``p.grad`` is None): ZeRO-2 zeroes the gradient shard. ZeRO-1's
        buckets are not zeroed: a parameter's first gradient of the step is copied into its
        bucket (:meth:`_own`), so only the gradients of parameters that get none are zeroed,
        when their bucket is read."""
        if self.zero_stage == 2:
            self.grad_shard.zero_()
        self._sums = []
        for bk in self.buckets:
            bk.launched_sum = None

    def arm(self) -> None:
        """Before a backward whose gradients are reduced (ZeRO-1: the step's last; ZeRO-2:
        every one): reduce-scatter buckets as their gradients become final."""
        for bk in self.buckets:
            bk.ready.clear()
        self._next = 0
        self._armed = True

    def on_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient of this backward is complete (autograd's hook, or a ``W``): start
        the buckets whose gradients are all final, in order; parameters not sharded here are
        ignored."""
        if id(p) not in self._where:
            return
        if self.zero_stage == 1:
            self._own(p)
        if not self._armed:
            return
        k, i, _ = self._where[id(p)]
        self.buckets[k].ready.add(i)
        while self._next < len(self.buckets):
            nb = self.buckets[self._next]
            if len(nb.ready) < len(nb.params):
                break
            self._launch(nb)
            self._next += 1

    def _own(self, p: torch.Tensor) -> None:
        """ZeRO-1: make ``p.grad`` the view of its bucket - autograd's first gradient of the
        step (a fresh tensor) is copied in, later ones accumulate in place; a parameter
        without a gradient has zeros there."""
        k, _, off = self._where[id(p)]
        grads = self.buckets[k].grads
        assert grads is not None
        view = grads[off : off + p.numel()]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)

    def _launch(self, bk: _Bucket) -> None:
        if bk.grads is not None:  # ZeRO-1: the accumulated bucket, reduced in place
            for p in bk.params:
                self._own(p)
            src = bk.grads
            bk.launched_sum = src.sum()
        else:  # ZeRO-2: this micro-batch's gradients, then free them
            src = torch.zeros_like(bk.flat)
            off = 0
            for p in bk.params:
                if p.grad is not None:
                    src[off : off + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
                off += p.numel()
            self._sums.append(src.sum())  # for the non-finite guard
            bk.staged = src
        chunk = bk.padded // self.r
        if self._gloo:  # one reduce per chunk, to its owner: the reduce-scatter's bytes
            bk.works = [
                dist.reduce(src[j * chunk : (j + 1) * chunk], dst=d, group=self.pg, async_op=True)
                for j, d in enumerate(self.devices)
            ]
            bk.result = src[self.replica * chunk : (self.replica + 1) * chunk]
        else:
            bk.result = torch.empty(chunk, dtype=src.dtype, device=src.device)
            bk.works = [dist.reduce_scatter_single(bk.result, src, op=dist.ReduceOp.SUM,
                                                   group=self.pg, async_op=True)]  # fmt: skip
        if bk.staged is not None:  # ZeRO-2: at most MAX_STAGED staging buffers alive
            self._inflight.append(bk)
            while len(self._inflight) > MAX_STAGED:
                self._land(self._inflight.pop(0), add=True)

    def _land(self, bk: _Bucket, *, add: bool) -> None:
        """Wait for ``bk``'s reduction and copy (ZeRO-1) or add (ZeRO-2) it into the shard."""
        for w in bk.works:
            w.wait()
        if bk.works and bk.result is not None:
            dst = self.grad_shard[bk.shard_start : bk.shard_start + bk.result.numel()]
            if add:
                dst.add_(bk.result)
            else:
                dst.copy_(bk.result)
        bk.works, bk.result, bk.staged = [], None, None

    def after_backward(self) -> None:
        """ZeRO-2, after each backward: reduce the buckets not started yet (in order), wait
        for all and add them to the gradient shard."""
        for bk in self.buckets[self._next :]:
            self._launch(bk)
        self._armed = False
        for bk in self._inflight:
            self._land(bk, add=True)
        self._inflight = []

    def grad_sums(self) -> list[torch.Tensor]:
        """For the non-finite guard, after a backward: the sums of this replica's local
        gradients of the sharded parameters - ZeRO-1: each bucket's as its reduction started
        (or now, when not started); ZeRO-2: those reduced since the last call (their ``p.grad``
        are freed)."""
        if self.zero_stage == 2:
            out, self._sums = self._sums, []
            return out
        sums = []
        for bk in self.buckets:
            assert bk.grads is not None
            if bk.launched_sum is None:
                for p in bk.params:
                    self._own(p)
            sums.append(bk.launched_sum if bk.launched_sum is not None else bk.grads.sum())
        return sums

    def finish(self) -> None:
        """The ``AR`` action (ZeRO-1): start the buckets not started yet (in order), wait and
        copy each reduced chunk into the gradient shard."""
        if self.zero_stage != 1:
            return
        for bk in self.buckets[self._next :]:
            self._launch(bk)
        self._armed = False
        self._next = len(self.buckets)
        for bk in self.buckets:
            self._land(bk, add=False)
            bk.launched_sum = None

    def drain(self) -> None:
        """Wait for the reductions in flight and drop them (the step is skipped or stopped)."""
        self._armed = False
        self._next = len(self.buckets)
        for bk in self.buckets:
            for w in bk.works:
                w.wait()
            bk.works, bk.result, bk.staged, bk.launched_sum = [], None, None, None
        self._inflight = []

    @torch.no_grad()
    def gather(self) -> None:
        """After the update of the pieces: start bringing every replica's chunks to every
        replica, in place (gloo: one broadcast per chunk from its owner; otherwise an
        all-gather per bucket), the first layers' buckets first. Nothing waits here: a layer
        waits for its buckets when it next runs forward (a pre-hook), so the gathers overlap
        the time up to the next step's forward and that forward itself;
        :meth:`wait_gathers` waits for all (before the parameters are read otherwise)."""
        for k in reversed(range(len(self.buckets))):
            bk = self.buckets[k]
            chunk = bk.padded // self.r
            if self._gloo:
                parts = [bk.flat[j * chunk : (j + 1) * chunk] for j in range(self.r)]
                self._gathers[k] = [
                    dist.broadcast(part, src=d, group=self.pg, async_op=True)
                    for part, d in zip(parts, self.devices, strict=True)
                ]
            else:
                mine = bk.flat[self.replica * chunk : (self.replica + 1) * chunk]
                self._gathers[k] = [
                    dist.all_gather_single(bk.flat, mine, group=self.pg, async_op=True)
                ]

    def _before_forward(self, needs: list[int]) -> Any:
        def wait(module: nn.Module, args: Any) -> None:
            self.wait_gathers(needs)

        return wait

    def wait_gathers(self, buckets: Sequence[int] | None = None) -> None:
        """Wait for the gathers in flight of ``buckets`` (default: all)."""
        for k in list(self._gathers) if buckets is None else buckets:
            for w in self._gathers.pop(k, ()):
                w.wait()

    def close(self, *, clean: bool = True) -> None:
        """Remove the hooks; ``clean``: first wait for the gathers in flight (the peers may be
        gone otherwise: then wait for nothing)."""
        if clean:
            self.wait_gathers()
        self._gathers = {}
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- checkpoints -------------------------------------------------------------------------
    def views(self) -> dict[int, tuple[nn.Parameter, int]]:
        """``id(optimizer parameter) -> (stage parameter, offset)`` (what
        :func:`dapple.runtime.checkpoint.restore_stage` slices a saved state with)."""
        return {id(pc.param): (pc.origin, pc.offset) for pc in self.pieces}

    def layer_states(
        self, layer_ids: Sequence[int], optimizer: torch.optim.Optimizer | None
    ) -> dict[int, LayerState]:
        """The stage's layer states with the WHOLE optimizer state on replica 0 (``{}`` on the
        others). A collective over the stage's replica group: every replica calls it.

        Args:
            layer_ids: the chain index of each of the stage's layers.
            optimizer: this replica's optimizer (over :attr:`pieces` and the whole parameters).
        """
        self.wait_gathers()
        names = {
            id(p): (i, name)
            for i, layer in zip(layer_ids, self.module.children(), strict=True)
            for name, p in layer.named_parameters(remove_duplicate=False)
        }
        mine = []
        for pc in self.pieces:
            st = optimizer.state.get(pc.param) if optimizer is not None else None
            if st:
                state = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                         for k, v in st.items()}  # fmt: skip
                mine.append((*names[id(pc.origin)], pc.offset, pc.origin.shape, state))
        got: list[Any] = [None] * self.r if self.replica == 0 else []
        dist.gather_object(mine, got if self.replica == 0 else None, dst=self.devices[0],
                           group=self.pg)  # fmt: skip
        if self.replica != 0:
            return {}
        out = stage_layer_states(self.module, layer_ids, optimizer)
        for pieces in got:
            for layer, name, offset, shape, state in pieces:
                whole = out[layer].optimizer.setdefault(name, {})
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.ndim > 0:
                        if k not in whole:
                            whole[k] = torch.zeros(shape, dtype=v.dtype)
                        whole[k].view(-1)[offset : offset + v.numel()] = v
                    else:
                        whole[k] = v
        return out
