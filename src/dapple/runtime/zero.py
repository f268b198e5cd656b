"""Sharded training state inside a replicated stage (ZeRO-1 and ZeRO-2, per stage).

DAPPLE replicates stage ``s`` on ``r_s`` devices and all-reduces its gradients, AR(P_s, g_s);
without sharding every replica then runs the same optimizer update on the whole stage and
keeps the whole optimizer state (Adam: two fp32 moments, 8 of the 16 bytes per parameter).
With ``TrainConfig.zero_stage`` (every replicated stage) or ``StagePlan.zero_stage`` (that
stage, as ``dapple plan --zero-stage`` records it) at 1 or 2, each replica of a stage with
``r_s > 1`` keeps and updates ``1/r_s`` of the stage's parameters (:class:`FlatShards`):

- ZeRO-1: the gradients accumulate over the step's micro-batches, in place, in flat bucket
  buffers (``p.grad`` is a view of its bucket); from the last backward on each bucket is
  reduce-scattered (``torch.distributed.reduce_scatter_single``, SUM) as soon as its gradients are final, so
  every replica receives the reduced gradient of its own chunk of the bucket - the bytes of
  the AllReduce's reduce-scatter half - while backward still runs.
- ZeRO-2: no full-size gradient buffer: after *every* micro-batch's backward each bucket is
  copied into a staging buffer, the parameters' gradients are freed and the bucket is
  reduce-scattered and added to this replica's gradient shard - M times ZeRO-1's gradient
  traffic, for ``1/r_s`` of the gradient memory.

In both, the optimizer's parameters are views of this replica's chunks of the flat parameter
buffers (:attr:`FlatShards.pieces`, cut at parameter boundaries so each keeps its weight-decay
group), their gradients views of the gradient shard; after the update every bucket is
all-gathered in place (``torch.distributed.all_gather_single``, :meth:`FlatShards.gather`).
torch 2.13 runs both on gloo (CPU) and NCCL; they are the ``reduce_scatter_tensor`` /
``all_gather_into_tensor`` of earlier releases, which 2.13 deprecates.

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

__all__ = ["ZERO_STAGES", "FlatShards", "Piece", "flat_parameters", "unsharded_stages"]

logger = logging.getLogger(__name__)


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
    work: Any = None
    out: torch.Tensor | None = None
    """ZeRO-2: the reduce-scatter's output, added to the shard once it is done."""


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
        self._where: dict[int, tuple[int, int]] = {}
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
                    self._where[id(p)] = (k, i)
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
        self._armed = False
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]  # type: ignore[no-untyped-call]

    # -- the step ----------------------------------------------------------------------------
    def owned_fraction(self) -> float:
        """The share of the stage's sharded elements this replica updates."""
        total = sum(p.numel() for p in self.params)
        return sum(pc.param.numel() for pc in self.pieces) / total if total else 0.0

    def begin_step(self) -> None:
        """Start of a step: zero gradients (ZeRO-1: the buckets, ``p.grad`` their views;
        ZeRO-2: the gradient shard)."""
        if self.zero_stage == 1:
            for bk in self.buckets:
                assert bk.grads is not None
                bk.grads.zero_()
                off = 0
                for p in bk.params:
                    p.grad = bk.grads[off : off + p.numel()].view_as(p)
                    off += p.numel()
        else:
            self.grad_shard.zero_()
        self._sums = []

    def arm(self) -> None:
        """Before a backward whose gradients are reduced (ZeRO-1: the step's last; ZeRO-2:
        every one): reduce-scatter buckets as their gradients become final."""
        for bk in self.buckets:
            bk.ready.clear()
        self._next = 0
        self._armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        k, i = self._where[id(p)]
        self.buckets[k].ready.add(i)
        while self._next < len(self.buckets):
            nb = self.buckets[self._next]
            if len(nb.ready) < len(nb.params):
                break
            self._launch(nb)
            self._next += 1

    def _launch(self, bk: _Bucket) -> None:
        chunk = bk.padded // self.r
        out = self.grad_shard[bk.shard_start : bk.shard_start + chunk]
        if bk.grads is not None:  # ZeRO-1: the accumulated bucket, straight into the shard
            src = bk.grads
        else:  # ZeRO-2: this micro-batch's gradients, then free them
            src = torch.zeros_like(bk.flat)
            off = 0
            for p in bk.params:
                if p.grad is not None:
                    src[off : off + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
                off += p.numel()
            self._sums.append(src.sum())  # for the non-finite guard
            out = bk.out = torch.empty_like(out)
        bk.work = dist.reduce_scatter_single(out, src, op=dist.ReduceOp.SUM, group=self.pg,
                                             async_op=True)  # fmt: skip

    def after_backward(self) -> None:
        """ZeRO-2, after each backward: reduce the buckets not started yet (in order), wait
        for all and add them to the gradient shard."""
        for bk in self.buckets[self._next :]:
            self._launch(bk)
        self._armed = False
        for bk in self.buckets:
            bk.work.wait()
            bk.work = None
            assert bk.out is not None
            self.grad_shard[bk.shard_start : bk.shard_start + bk.out.numel()].add_(bk.out)
            bk.out = None

    def take_sums(self) -> list[torch.Tensor]:
        """ZeRO-2: the sums of the gradients reduced since the last call (whose ``p.grad`` are
        freed), for the non-finite guard."""
        out, self._sums = self._sums, []
        return out

    def finish(self) -> None:
        """The ``AR`` action (ZeRO-1): start the buckets not started yet (in order) and wait."""
        if self.zero_stage != 1:
            return
        for bk in self.buckets[self._next :]:
            self._launch(bk)
        self.drain()

    def drain(self) -> None:
        """Wait for the reduce-scatters in flight (the step is skipped or stopped)."""
        self._armed = False
        self._next = len(self.buckets)
        for bk in self.buckets:
            if bk.work is not None:
                bk.work.wait()
            bk.work, bk.out = None, None

    @torch.no_grad()
    def gather(self) -> None:
        """After the update of the pieces: every replica's chunks to every replica (an
        in-place all-gather of each bucket over the stage's replica group)."""
        works = []
        for bk in self.buckets:
            chunk = bk.padded // self.r
            full = bk.flat
            mine = full[self.replica * chunk : (self.replica + 1) * chunk]
            works.append(dist.all_gather_single(full, mine, group=self.pg, async_op=True))
        for w in works:
            w.wait()

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- checkpoints -------------------------------------------------------------------------
    def views(self) -> dict[int, tuple[nn.Parameter, int]]:
        """``id(optimizer parameter) -> (stage parameter, offset)`` (what
        :func:`dapple.runtime.checkpoint.restore_stage` slices a saved state with)."""
        return {id(pc.param): (pc.origin, pc.offset) for pc in self.pieces}

    def layer_states(
        self, first_layer: int, optimizer: torch.optim.Optimizer | None
    ) -> dict[int, LayerState]:
        """The stage's layer states with the WHOLE optimizer state on replica 0 (``{}`` on the
        others). A collective over the stage's replica group: every replica calls it.

        Args:
            first_layer: chain index of the stage's first layer.
            optimizer: this replica's optimizer (over :attr:`pieces` and the whole parameters).
        """
        names = {
            id(p): (first_layer + i, name)
            for i, layer in enumerate(self.module.children())
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
        out = stage_layer_states(self.module, first_layer, optimizer)
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
