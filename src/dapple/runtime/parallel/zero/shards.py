"""One replica's shard of its stage's training state (:mod:`dapple.runtime.parallel.zero` says how)."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.buckets import BUCKET_BYTES, MAX_STAGED
from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan
from dapple.runtime import comm
from dapple.runtime.checkpoint import LayerState, stage_layer_states
from dapple.runtime.parallel.zero.layout import (
    Bucket,
    Piece,
    ShardGroup,
    flat_layout,
    replica_slices,
    tied_slices,
)
from dapple.runtime.sync import bucket_runs

__all__ = ["MAX_STAGED", "TENSOR_COLLECTIVES_ENV", "FlatShards", "Piece", "ShardGroup"]

TENSOR_COLLECTIVES_ENV = "DAPPLE_TEST_ZERO_TENSOR_COLLECTIVES"
"""Test hook: with ``1`` here gloo groups use ``reduce_scatter_single``/``all_gather_single``
too (the path of other backends), so it can be tested on the CPU."""


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
        tied: the stage's tied parameters whose optimizer state is sharded
            (:func:`tied_parameters`): replica ``j`` updates elements
            ``[j c, (j + 1) c)``, ``c = ceil(n / r)``, of each, from its whole gradient.
        chunks: the parameters of each of the rank's chunks (interleaved plans): no bucket
            spans two, so a chunk's buckets are reduced at its own backward.
        bucket_bytes: the bucket size (default :data:`~dapple.core.buckets.BUCKET_BYTES`).
        tensor_index: the rank's index in its tensor group (t_s > 1): the replicas are the
            stage's devices of that index (:meth:`StagePlan.replica_group`), each holding the
            same slice of every cut parameter.
        held: ``id(parameter)`` -> the replicas holding it, for parameters fewer replicas
            than the stage's hold (an expert shard's r_s / e_s copies): their buckets are
            sharded, reduced and gathered over those only (no bucket mixes groups).
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
        tied: Sequence[nn.Parameter] = (),
        chunks: Sequence[Collection[nn.Parameter]] = (),
        bucket_bytes: int | None = None,
        tensor_index: int = 0,
        held: Mapping[int, ShardGroup] | None = None,
    ) -> None:
        self.devices = list(plan.stages[stage].replica_group(tensor_index))
        self.r = len(self.devices)
        self.replica, self.module, self.pg = replica, module, pg
        self.parallel = Parallelism(replicas=self.r, zero_stage=zero_stage)
        """ZeRO-1 or 2 over the :attr:`r` replicas (``shards_grads``: 2)."""
        self.params = params
        self.stage_group = ShardGroup(tuple(self.devices), pg, replica)
        """The stage's replicas (of the rank's tensor index): every bucket not in :attr:`held`."""
        self.held = dict(held or {})
        cap = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        chunk_of = {id(p): c for c, ps in enumerate(chunks) for p in ps}
        runs = bucket_runs(params[::-1], cap,
                           lambda p: (chunk_of.get(id(p)), self.group_of(p).devices))  # fmt: skip
        like = params[0] if params else torch.empty(0)
        kw: dict[str, Any] = {"dtype": like.dtype, "device": like.device}
        groups = [self.group_of(run[0]) for run in runs]
        with torch.no_grad():
            layout = flat_layout(runs, replica, self.r, not self.parallel.shards_grads, kw,
                                 held=[(g.index, g.size) for g in groups])  # fmt: skip
        for bk, g in zip(layout.buckets, groups, strict=True):
            bk.group = g
        self.buckets = layout.buckets
        self.pieces = layout.pieces
        """The optimizer's parameters, in bucket order (then the tied slices)."""
        self._where = layout.where
        """``id(stage parameter) -> (bucket, index in it, offset in its flat buffer)``."""
        self.grad_shard = layout.grad_shard
        """This replica's chunk of every bucket's reduced gradient, in bucket order."""
        self.tied = list(tied)
        """Tied parameters: whole gradients (summed across stages), optimizer state in slices."""
        self._tied_pieces = tied_slices(self.tied, replica, self.r)
        self.pieces += self._tied_pieces
        self.checked = False
        """Sum each bucket's local gradients as its reduction starts, for :meth:`grad_sums`
        (the non-finite guard turns it on while it replays a step to name its micro-batch)."""
        self._sums: list[torch.Tensor] = []
        self._inflight: list[Bucket] = []
        """ZeRO-2: the buckets whose reduction runs, oldest first."""
        self._gloo = (
            pg is not None
            and dist.get_backend(pg) == "gloo"
            and os.environ.get(TENSOR_COLLECTIVES_ENV) != "1"
        )
        """gloo: reductions as one ``reduce`` per chunk and gathers as one ``broadcast`` per
        chunk (see the module docstring)."""
        self._armed = False
        self._final: set[int] | None = None
        """The armed parameters (None: all), whose gradients are final in this backward."""
        self._todo: list[int] = []
        """The armed buckets, in the order they are reduced (the same on every replica)."""
        self._pos = 0
        """How many of them started."""
        self._gathers: dict[int, list[Any]] = {}
        """The gathers in flight by key - a bucket's index, or ``len(buckets) + t`` for tied
        parameter ``t`` - each waited for at the first use of its parameters."""
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in params]  # type: ignore[no-untyped-call]
        self._order: list[int] = []
        """The gather keys in the order the stage's forward first needs them."""
        self._hook_forward(module, params)

    # -- building ------------------------------------------------------------------------------
    def _hook_forward(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """Record in :attr:`_order` the gather keys in the order the layers first need them
        and hook each layer that needs some to wait for them before its forward."""
        key = {id(p): self._where[id(p)][0] for p in params}
        key.update({id(t): len(self.buckets) + i for i, t in enumerate(self.tied)})
        for layer in module.children():
            needs = sorted({key[id(p)] for p in layer.parameters() if id(p) in key})
            self._order += [k for k in needs if k not in self._order]
            if needs:
                self._hooks.append(layer.register_forward_pre_hook(self._before_forward(needs)))
        self._order += [
            k for k in range(len(self.buckets) + len(self.tied)) if k not in self._order
        ]

    def group_of(self, p: torch.Tensor) -> ShardGroup:
        """The replicas ``p``'s bucket is sharded over."""
        return self.held.get(id(p), self.stage_group)

    @staticmethod
    def _group(bk: Bucket) -> ShardGroup:
        assert bk.group is not None
        return bk.group

    # -- the step ----------------------------------------------------------------------------
    def _slices(self, t: torch.Tensor) -> list[tuple[int, int]]:
        """Each replica's elements ``[lo, hi)`` of tied parameter ``t``."""
        return replica_slices(t.numel(), self.r)

    def counted(self, counts: Collection[nn.Parameter]) -> list[nn.Parameter]:
        """The pieces whose gradients this replica adds to the global norm: those of the
        stage parameters in ``counts`` (what the stage's replica 0 would count whole), so
        every element counts once over the replicas."""
        ids = {id(p) for p in counts}
        return [pc.param for pc in self.pieces if id(pc.origin) in ids]

    def point_tied(self) -> None:
        """At ``OPT``, after the tied sums: each tied piece's gradient is its slice of the
        parameter's whole gradient (None without one)."""
        for pc in self._tied_pieces:
            g = pc.origin.grad
            n = pc.param.numel()
            pc.param.grad = None if g is None else g.reshape(-1)[pc.offset : pc.offset + n]

    def owned_fraction(self) -> float:
        """The share of the stage's sharded elements (tied parameters' included) this replica
        updates."""
        total = sum(p.numel() for p in [*self.params, *self.tied])
        return sum(pc.param.numel() for pc in self.pieces) / total if total else 0.0

    def begin_step(self) -> None:
        """Start of a step (``p.grad`` is None): ZeRO-2 zeroes the gradient shard. ZeRO-1's
        buckets are not zeroed: a parameter's first gradient of the step is copied into its
        bucket (:meth:`_own`), so only the gradients of parameters that get none are zeroed,
        when their bucket is read. The tied pieces drop their gradients: views of the last
        step's whole gradients, they would keep those alive beside the new ones."""
        if self.parallel.shards_grads:
            self.grad_shard.zero_()
        for pc in self._tied_pieces:
            pc.param.grad = None
        self._sums = []
        for bk in self.buckets:
            bk.launched_sum = None

    def arm(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Before a backward whose gradients of ``params`` (None: every parameter) are reduced
        - ZeRO-1: the step's last backward of the rank, or of the chunk holding ``params``;
        ZeRO-2: every backward: reduce-scatter their buckets, in order, as the gradients
        become final (the gradients of parameters not armed are not, and are ignored)."""
        if not self._armed:
            for bk in self.buckets:
                bk.ready.clear()
            self._final, self._todo, self._pos, self._armed = set(), [], 0, True
        if params is None:
            self._final = None
            new: Iterable[int] = range(len(self.buckets))
        else:
            ids = {id(p) for p in params if id(p) in self._where}
            if self._final is not None:
                self._final |= ids
            new = sorted({self._where[i][0] for i in ids})
        armed = set(self._todo)
        self._todo += [k for k in new if k not in armed]

    def on_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient of this backward is complete (autograd's hook, or a ``W``): start
        the buckets whose gradients are all final, in order; parameters not sharded here are
        ignored."""
        if id(p) not in self._where:
            return
        if not self.parallel.shards_grads:
            self._own(p)
        if not self._armed or (self._final is not None and id(p) not in self._final):
            return
        k, i, _ = self._where[id(p)]
        self.buckets[k].ready.add(i)
        while self._pos < len(self._todo):
            nb = self.buckets[self._todo[self._pos]]
            if len(nb.ready) < len(nb.params):
                break
            self._launch(nb)
            self._pos += 1

    def _launch_rest(self, *, every: bool) -> None:
        """Start the armed buckets not started yet, in order (``every``: then the others)."""
        rest = self._todo[self._pos :]
        if every:
            armed = set(self._todo)
            rest += [k for k in range(len(self.buckets)) if k not in armed]
        for k in rest:
            self._launch(self.buckets[k])
        self._armed, self._pos, self._todo = False, 0, []

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

    def _launch(self, bk: Bucket) -> None:
        if bk.grads is not None:  # ZeRO-1: the accumulated bucket, reduced in place
            for p in bk.params:
                self._own(p)
            src = bk.grads
            if self.checked:
                bk.launched_sum = src.sum()
        else:  # ZeRO-2: this micro-batch's gradients, then free them
            src = torch.empty_like(bk.flat)
            off = 0
            for p in bk.params:
                part = src[off : off + p.numel()]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(p.grad.reshape(-1))
                    p.grad = None
                off += p.numel()
            src[off:].zero_()  # the padding
            if self.checked:
                self._sums.append(src.sum())
            bk.staged = src
        g = self._group(bk)
        chunk = bk.padded // g.size
        if self._gloo:  # one reduce per chunk, to its owner: the reduce-scatter's bytes
            bk.works = [
                comm.reduce(src[j * chunk : (j + 1) * chunk], dst=d, group=g.pg, async_op=True)
                for j, d in enumerate(g.devices)
            ]
            bk.result = src[g.index * chunk : (g.index + 1) * chunk]
        else:  # ZeRO-1 reduces straight into the shard; ZeRO-2 adds its result to it
            at = self.grad_shard[bk.shard_start : bk.shard_start + chunk]
            bk.result = at if bk.grads is not None else torch.empty_like(at)
            bk.works = [comm.reduce_scatter_single(bk.result, src, op=dist.ReduceOp.SUM,
                                                   group=g.pg, async_op=True)]  # fmt: skip
        if bk.staged is not None:  # ZeRO-2: at most MAX_STAGED staging buffers alive
            self._inflight.append(bk)
            while len(self._inflight) > MAX_STAGED:
                self._land(self._inflight.pop(0), add=True)

    def _land(self, bk: Bucket, *, add: bool) -> None:
        """Wait for ``bk``'s reduction and copy (ZeRO-1) or add (ZeRO-2) it into the shard."""
        for w in bk.works:
            w.wait()
        if bk.works and bk.result is not None:
            dst = self.grad_shard[bk.shard_start : bk.shard_start + bk.result.numel()]
            if add:
                dst.add_(bk.result)
            elif dst.data_ptr() != bk.result.data_ptr():
                dst.copy_(bk.result)
        bk.works, bk.result, bk.staged = [], None, None

    def after_backward(self) -> None:
        """ZeRO-2, after each backward: reduce the buckets not started yet (in order), wait
        for all and add them to the gradient shard."""
        self._launch_rest(every=False)
        for bk in self._inflight:
            self._land(bk, add=True)
        self._inflight = []

    def grad_sums(self) -> list[torch.Tensor]:
        """For the non-finite guard, after a backward: the sums of this replica's local
        gradients of the sharded parameters - ZeRO-1: each bucket's as its reduction started
        (or now, when not started); ZeRO-2: those reduced since the last call (their ``p.grad``
        are freed)."""
        if self.parallel.shards_grads:
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
        if self.parallel.shards_grads:
            return
        self._launch_rest(every=True)
        for bk in self.buckets:
            self._land(bk, add=False)
            bk.launched_sum = None

    def drain(self) -> None:
        """Wait for the reductions in flight and drop them (the step is skipped or stopped)."""
        self._armed, self._pos, self._todo = False, 0, []
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
        :meth:`wait_gathers` waits for all (before the parameters are read otherwise). A tied
        parameter's slices are broadcast from their owners."""
        for k in self._order:
            if k >= len(self.buckets):
                t = self.tied[k - len(self.buckets)].detach().view(-1)
                self._gathers[k] = self._from_owners(
                    [t[lo:hi] for lo, hi in self._slices(t)], self.stage_group
                )
                continue
            bk = self.buckets[k]
            g = self._group(bk)
            chunk = bk.padded // g.size
            if self._gloo:
                parts = [bk.flat[j * chunk : (j + 1) * chunk] for j in range(g.size)]
                self._gathers[k] = self._from_owners(parts, g)
            else:
                mine = bk.flat[g.index * chunk : (g.index + 1) * chunk]
                self._gathers[k] = [
                    comm.all_gather_single(bk.flat, mine, group=g.pg, async_op=True)
                ]

    @staticmethod
    def _from_owners(parts: Sequence[torch.Tensor], g: ShardGroup) -> list[Any]:
        """Broadcast ``parts[i]`` from member ``i`` of ``g`` to the others, in place (empty
        parts are skipped): the works in flight."""
        return [
            comm.broadcast(part, src=d, group=g.pg, async_op=True)
            for part, d in zip(parts, g.devices, strict=True)
            if part.numel()
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
        """The stage's layer states with the WHOLE optimizer state of the parameters sharded
        over each group on that group's first member: replica 0 for the stage's replicas, and
        for :attr:`held` parameters their group's first (``{}`` on a rank first of none). A
        collective over the stage's replica group, then over each of the rank's :attr:`held`
        groups in device order: every replica calls it.

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
        groups = {self.stage_group.devices: self.stage_group}
        groups |= {g.devices: g for g in sorted(self.held.values(), key=lambda g: g.devices)}
        mine: dict[tuple[int, ...], list[Any]] = {d: [] for d in groups}
        for pc in self.pieces:
            st = optimizer.state.get(pc.param) if optimizer is not None else None
            if st:
                state = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                         for k, v in st.items()}  # fmt: skip
                row = (*names[id(pc.origin)], pc.offset, pc.origin.shape, state)
                mine[self.group_of(pc.origin).devices].append(row)
        got: list[Any] = []
        for d, g in groups.items():
            into: list[Any] | None = [None] * g.size if g.index == 0 else None
            dist.gather_object(mine[d], into, dst=g.devices[0], group=g.pg)
            got += into or []
        if not any(g.index == 0 for g in groups.values()):
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
